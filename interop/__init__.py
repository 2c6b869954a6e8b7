"""Bridges between rtcinfer kernels and array frameworks (JAX, CuPy, ...)."""
