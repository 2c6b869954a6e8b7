"""Arrays of any framework without importing one the caller did not use: which framework an
array comes from, its dtype name and device, host copies, the refusal by name of what no kernel
can read (`check_device_array`: lists, host arrays, arrays off the GPU), and `as_cupy`, the
zero-copy CuPy view (through DLPack) that the call path takes of producers other than PyTorch,
CuPy and JAX. fp8 tensors become uint8 views with their name kept by `dtype_name`.
"""

from __future__ import annotations

import functools
import inspect
import sys

from .dtypes import FP8_DTYPES, normalize
from .generated import compiled


def framework(x) -> str:
    """ "torch", "jax", "cupy", "numpy", "sequence" (a list or tuple) or "dlpack" (anything
    else: exporting __dlpack__ is checked where it is needed)."""
    if isinstance(x, (list, tuple)):
        return "sequence"
    module = type(x).__module__.partition(".")[0]
    if module in ("torch", "jax", "jaxlib", "cupy", "numpy"):
        return "jax" if module == "jaxlib" else module
    return "dlpack"


class _NoTensor:
    """What TORCH_TENSOR and CUPY_NDARRAY hold before their framework is seen: the type of no
    argument."""


TORCH_TENSOR: list = [_NoTensor, None]  # torch.Tensor and torch.compiler.is_compiling, set
# once by the first call that sees PyTorch (interop/call.py's _torch; interop/shortcut.py)
CUPY_NDARRAY: list = [_NoTensor]  # cupy.ndarray, set by the first call that sees CuPy


def torch_compiling(x) -> bool:
    """Whether `x` is a PyTorch tensor seen while torch.compile traces: the call then becomes a
    custom op node (rtcinfer/torch_ops.py). Cheap for every other caller: a type test (a
    torch.Tensor once PyTorch was seen), else one module-name test, and PyTorch is never
    imported here. (No cache of the test per type: TorchDynamo, tracing this function, would
    guard on the cache's contents and recompile when it grows; TORCH_TENSOR is set once.)"""
    if type(x) is TORCH_TENSOR[0]:
        return TORCH_TENSOR[1]()
    if type(x).__module__.partition(".")[0] != "torch":
        return False
    return sys.modules["torch"].compiler.is_compiling()


def compilable(tensor_arg: str, shortcut=None):
    """Decorates a public function so that its calls seen while PyTorch compiles become its
    custom op (rtcinfer/torch_ops.py); the others run as they are, after one compile test of
    the argument `tensor_arg`. The wrapper is generated with the function's own parameters
    (their defaults its own), so a call passes its arguments on without packing them into
    *args and **kwargs. `shortcut` (interop/shortcut.py: how the function calls its op) adds
    the branch that launches a PyTorch signature seen before without the function's path."""

    def wrap(fn):
        return functools.update_wrapper(_routed(fn, tensor_arg, shortcut), fn)

    return wrap


def with_shortcut(shortcut):
    """Decorates a public function that routes its calls under torch.compile itself with the
    shortcut's branch (interop/shortcut.py), as `compilable` does: the wrapper is generated
    with the function's own parameters."""

    def wrap(fn):
        return functools.update_wrapper(_routed(fn, None, shortcut), fn)

    return wrap


def _routed(fn, tensor_arg: str | None, shortcut=None):
    """`def <name>(<fn's parameters>)`: routed to the custom op while compiling (unless
    tensor_arg is None: fn routes itself), else (past the shortcut's branch, if any) fn."""
    params, positional, keyword = [], [], []
    names = {"_fn": fn, "_compiling": torch_compiling}  # the generated function's globals
    for p in inspect.signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"compilable: {fn.__name__}'s parameter {p} is not supported")
        if p.kind is p.KEYWORD_ONLY and not keyword:
            params.append("*")
        (keyword if p.kind is p.KEYWORD_ONLY else positional).append(p.name)
        if p.default is p.empty:
            params.append(p.name)
        else:
            names[f"_default_{p.name}"] = p.default
            params.append(f"{p.name}=_default_{p.name}")
    args = "".join(f"{n}, " for n in positional)
    kwargs = ", ".join(f"{n}={n}" for n in keyword)
    branch = ""
    if shortcut is not None:
        from . import shortcut as cuts

        branch = cuts.source(shortcut, f"_fn({args}{kwargs})")
        names.update(cuts.names(shortcut))
    route = (
        f"    if _compiling({tensor_arg}):\n"
        f"        from rtcinfer import torch_ops\n"
        f"        return torch_ops.call_public(_fn, ({args}), dict({kwargs}))\n"
    ) if tensor_arg is not None else ""  # fmt: skip
    source = (  # the shortcut's branch first: it tests for torch.compile itself, cheaply
        f"def {fn.__name__}({', '.join(params)}):\n{branch}{route}    return _fn({args}{kwargs})\n"
    )
    exec(compiled(source, f"<compilable {fn.__qualname__}>"), names)  # noqa: S102
    return names[fn.__name__]


def dtype_name(x) -> str:
    """Canonical dtype name of an array of any framework ("bfloat16", "float8_e4m3fn", ...)."""
    return normalize(x.dtype)


def cast(x, dtype: str, keep: tuple[str, ...] = ()):
    """x in dtype (a canonical name), converted by its own framework (PyTorch .to, CuPy and
    JAX .astype: a new array on x's device, inside jax.jit a traced convert), or x itself when
    its dtype is dtype or one of `keep`; other objects are returned as they are, for the call
    path to accept or refuse by name."""
    fw = framework(x)
    if fw not in ("torch", "cupy", "jax") or normalize(x.dtype) in (dtype, *keep):
        return x
    if fw == "torch":
        return x.to(getattr(sys.modules["torch"], dtype))
    return x.astype(dtype)


def _describe(x) -> str:
    shape = tuple(getattr(x, "shape", ()))
    return f"{type(x).__module__}.{type(x).__qualname__} of shape {shape}"


def jax_platforms(x) -> set[str]:
    """The platforms ("gpu", "cpu", ...) a JAX array is on. An array traced inside jax.jit has
    no devices yet: the computation runs on the devices of the mesh set around it, if any, else
    on JAX's default backend."""
    import jax

    if not isinstance(x, jax.core.Tracer):
        return {d.platform for d in x.devices()}
    mesh = getattr(getattr(x.aval, "sharding", None), "mesh", None)
    device = getattr(mesh, "abstract_device", None)
    return {device.platform if device is not None else jax.default_backend()}


def check_device_array(x, name: str, fw: str) -> None:
    """Refuse by name what no kernel can read: a list or tuple, a host NumPy array, a PyTorch
    tensor off the GPU, a JAX array off the GPU (all TypeError). `fw` is framework(x)."""
    if fw == "sequence":
        raise TypeError(
            f"{name} must be an array (PyTorch, JAX, CuPy or DLPack), got {type(x).__name__}"
        )
    if fw == "numpy":
        raise TypeError(
            f"{name}: expected a CUDA array (CuPy, PyTorch or JAX), got a host numpy.ndarray "
            f"of shape {x.shape}; move it to the GPU first"
        )
    if fw == "torch" and x.device.type != "cuda":
        raise TypeError(f"{name}: expected a CUDA tensor, got a torch.Tensor on {x.device}")
    if fw == "jax" and (platforms := jax_platforms(x)) != {"gpu"}:
        raise TypeError(f"{name}: expected a JAX array on a GPU, got one on {platforms}")


def as_cupy(x, name: str):
    """Zero-copy CuPy view of a CUDA array from any framework; what check_device_array refuses
    raises TypeError."""
    fw = framework(x)
    if fw == "cupy":
        return x
    check_device_array(x, name, fw)
    if fw == "torch" and dtype_name(x) in FP8_DTYPES:
        x = x.view(sys.modules["torch"].uint8)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name}: expected a CUDA array with __dlpack__, got {_describe(x)}")
    try:
        import cupy
    except ImportError:
        from .. import gpu

        gpu.require_cuda_wheels()  # raises: which extra to install
        raise
    try:
        return cupy.from_dlpack(x)
    except (TypeError, ValueError, BufferError, RuntimeError) as e:
        raise TypeError(f"{name}: cannot take {_describe(x)} as a CUDA array: {e}") from e


def device_like(host, like):
    """A device copy of the host array `host` in the framework and on the device of `like`."""
    fw = framework(like)
    if fw == "torch":
        return sys.modules["torch"].as_tensor(host, device=like.device)
    if fw == "jax":
        return sys.modules["jax"].device_put(host, next(iter(like.devices())))
    import cupy

    with cupy.cuda.Device(device_of(like)):
        return cupy.asarray(host)


def device_of(x) -> int:
    """CUDA device ordinal of an array of any framework (without conversion)."""
    fw = framework(x)
    if fw == "torch":
        return x.device.index if x.device.type == "cuda" else -1
    if fw == "cupy":
        return x.device.id
    if fw == "jax":
        return next(iter(x.devices())).id
    if hasattr(x, "__dlpack_device__"):
        kind, index = x.__dlpack_device__()
        return int(index) if int(kind) in (2, 3, 13) else -1  # CUDA, CUDA host, CUDA managed
    return -1


def to_numpy(x):
    """A host NumPy array of any array or sequence; device arrays cost one device-to-host copy."""
    import numpy as np

    fw = framework(x)
    if fw == "torch":
        return x.detach().cpu().numpy()
    if fw == "cupy":
        return x.get()
    return np.asarray(x)
