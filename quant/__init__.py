"""Quantised linear layers (int8, AWQ) that the engine's model can swap in."""
