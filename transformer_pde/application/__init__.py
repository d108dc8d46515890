"""The application layer: plotting, animation, studies, run directories, sweeps and the CLI.

ARCHITECTURE.md has the layers and what each module does."""
