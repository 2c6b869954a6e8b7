"""Host planners: NumPy only."""
