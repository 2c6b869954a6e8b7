"""rtcinfer: LLM inference kernels compiled at run time by NVRTC, for PyTorch, JAX and CuPy."""

__version__ = "0.1.0"

from .norm import (  # noqa: E402
    fused_add_rmsnorm,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    layernorm,
    rmsnorm,
)

__all__ = [
    "fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "rmsnorm",
]
