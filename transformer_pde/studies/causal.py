"""Causal-attention clustering study (filled in this session)."""
