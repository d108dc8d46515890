"""Utilities: argument checks (validation), the thread policy (threads), config files (resources)."""
