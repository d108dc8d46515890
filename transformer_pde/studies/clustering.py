"""Clustering studies: phase diagrams, metastability (filled in this session)."""
