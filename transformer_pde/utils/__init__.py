"""Utilities: argument checks (validation), the thread policy (threads), config files (resources), the CPU
model and cache sizes (hardware).

ARCHITECTURE.md has the layers and what each module does."""
