"""Utilities: argument checks (validation), the thread policy (threads), config files (resources), the CPU
model and cache sizes (hardware), memory a run step writes into again (recycle).

ARCHITECTURE.md has the layers and what each module does."""
