"""Float64 NumPy references and the test suite."""
