"""CUDA C++ kernel sources, compiled at run time by NVRTC."""
