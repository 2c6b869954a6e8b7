"""Randomness for the samplers without PyTorch: Philox4x32-10 keyed by (seed, offset).

Every sampling kernel draws uniforms u = philox(counter = (draw, row, offset), key = seed)
(cuda_src/sampling/philox.cuh), so a call is a pure function of its inputs, `seed` and `offset`:
the same seed, offset and inputs give the same tokens on every run. Calls with different
offsets (or seeds) draw independent numbers; any change of offset will do, +1 is enough.

How a call gets its (seed, offset), in order:
1. `seed=` (and `offset=`, default 0): Python ints, or device arrays of int64 / uint64 with 1 or
   batch entries (read by the kernel at run time: use these under CUDA-graph capture and
   advance them on the device between replays).
2. `generator=`: a `Generator` (uses its (seed, offset), then advances offset by 1), or a
   CUDA `torch.Generator` (its Philox seed and offset; offset advances by 4, as PyTorch's own
   kernels would).
3. Neither: a fresh random seed (not reproducible), drawn from a Mersenne Twister seeded from
   the OS once per process and again in every forked child (a draw from the OS each call
   cost ~0.9 us of a call's host time; forked workers must not share seeds).
"""

from __future__ import annotations

import os
import random
import secrets
import threading

import numpy as np

from ..interop import framework

_MASK64 = (1 << 64) - 1
_SEEDS = random.Random(secrets.randbits(128))  # fresh seeds of calls given none
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _SEEDS.seed(secrets.randbits(128)))


class Generator:
    """Seed and offset for the samplers; each call that takes this generator uses the current
    (seed, offset) and then advances offset by 1 (thread-safe)."""

    def __init__(self, seed: int | None = None, offset: int = 0):
        self.seed = secrets.randbits(64) if seed is None else int(seed) & _MASK64
        self.offset = int(offset) & _MASK64
        self._lock = threading.Lock()

    def manual_seed(self, seed: int) -> Generator:
        with self._lock:
            self.seed, self.offset = int(seed) & _MASK64, 0
        return self

    def next(self) -> tuple[int, int]:
        """The (seed, offset) for one call; advances offset."""
        with self._lock:
            state = (self.seed, self.offset)
            self.offset = (self.offset + 1) & _MASK64
        return state

    def __repr__(self) -> str:
        return f"Generator(seed={self.seed}, offset={self.offset})"


def _torch_state(generator) -> tuple[int, int]:
    import torch

    if generator.device.type != "cuda":
        raise TypeError(f"generator: expected a CUDA torch.Generator, got a {generator.device} one")
    seed, offset = generator.get_state().view(torch.int64).tolist()  # signed 64-bit words
    generator.set_state(torch.tensor([seed, offset + 4], dtype=torch.int64).view(torch.uint8))
    return seed & _MASK64, offset & _MASK64


def resolve(generator, seed, offset):
    """(seed, offset) for one call: each an int, or a device array (see the module docstring)."""
    if seed is not None:
        return seed, 0 if offset is None else offset
    if offset is not None:
        raise ValueError("offset= needs seed=; or pass a generator")
    if generator is None:
        return _SEEDS.getrandbits(64), 0
    if isinstance(generator, Generator):
        return generator.next()
    if type(generator).__module__.startswith("torch"):
        return _torch_state(generator)
    raise TypeError(
        f"generator: expected rtcinfer.Generator or a CUDA torch.Generator, got "
        f"{type(generator).__module__}.{type(generator).__qualname__}"
    )


def draw(generator) -> tuple[int, int]:
    """(seed, offset) of a call given neither seed= nor offset=, as kernel_inputs passes them
    for PyTorch and CuPy arrays (the samplers' shortcut calls it directly)."""
    seed, offset = resolve(generator, None, None)
    return seed & _MASK64, offset & _MASK64


def check_array(name: str, info, batch: int) -> int:
    """Entries (1 or batch) of a seed or offset array (an ArrayInfo): int64/uint64 of shape (1,)
    or (batch,), or, for JAX without 64-bit types, uint32 (lo, hi) words of shape (1, 2) or
    (batch, 2)."""
    shape, dtype = info.shape, info.dtype
    if dtype in ("int64", "uint64") and len(shape) == 1 and shape[0] in (1, batch):
        return shape[0]
    words = dtype in ("int32", "uint32") and len(shape) == 2 and shape[1] == 2
    if words and shape[0] in (1, batch):
        return shape[0]
    raise ValueError(
        f"{name}: expected int64/uint64 of shape (1,) or ({batch},), or uint32 words of shape "
        f"(1, 2) or ({batch}, 2), got {dtype} of shape {shape}"
    )


def as_words(value: int) -> np.ndarray:
    """A 64-bit value as the (1, 2) uint32 (lo, hi) words it occupies in memory (for JAX,
    whose default configuration has no 64-bit integers)."""
    value = int(value) & _MASK64
    return np.array([[value & 0xFFFFFFFF, value >> 32]], dtype=np.uint32)


_AS_WORDS: dict[type, bool] = {}  # array type -> whether its calls take int seeds as arrays


def _ints_as_arrays(like) -> bool:
    """JAX: one compiled call serves every seed only when the seed is an input array."""
    words = _AS_WORDS.get(type(like))
    if words is None:
        words = _AS_WORDS[type(like)] = framework(like) == "jax"
    return words


def kernel_inputs(like, generator, seed, offset):
    """((seed array, offset array), (seed, offset)) for a sampling kernel called on arrays of
    `like`'s kind: an int stays a scalar (its array None); an array (checked by the op's
    prepare, check_array) carries the value (its scalar 0). JAX callers get ints as device
    arrays, so one compiled handler serves every call."""
    seed, offset = resolve(generator, seed, offset)
    if type(seed) is int and type(offset) is int and not _ints_as_arrays(like):
        return (None, None), (seed & _MASK64, offset & _MASK64)  # the common case, cheaply
    arrays, values = [], []
    for v in (seed, offset):
        if isinstance(v, (int, np.integer)):
            if not _ints_as_arrays(like):
                arrays.append(None)
                values.append(int(v) & _MASK64)
                continue
            import jax.numpy as jnp

            v = jnp.asarray(as_words(v))
        arrays.append(v)
        values.append(0)
    return tuple(arrays), tuple(values)
