"""Utilities: argument checks (validation), the thread policy (threads), config files (resources).

ARCHITECTURE.md has the layers and what each module does."""
