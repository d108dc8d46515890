"""The application layer: plotting, animation, studies, run directories, sweeps and the CLI."""
