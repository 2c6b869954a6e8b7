"""RoPE's frequency table, computed on the host once per set of frequency scalars.

Pair i of R rotary dimensions turns by pos * f_i turns at position pos, where

    inv_i = theta ** (-2 i / R)                                          (fp64)
    theta:   inv_i' = inv_i / rope_scale
    llama31: s = clip(inv_i * old / (2 pi (high - low)) - 1 / (high / low - 1), 0, 1)
             inv_i' = (1 - s) inv_i / rope_scale + s inv_i
    f_i = inv_i' / (2 pi)

and the kernel (cuda_src/rope.cu) reads f_i as two floats (hi, lo), hi = fp32(f_i) and lo =
fp32(f_i - hi): their sum carries ~48 bits, so pos * f_i keeps its fractional turn exact to fp32
rounding for positions below 2^24. The scalars are rounded to fp32 first, as the kernel's
parameters hold them. The table rides in the launch's parameter block (TABLE_PAIRS pairs, the
rotary halves of head dims up to 256); the pairs past it, for wider heads, are computed by the
kernel itself.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

TABLE_PAIRS = 128  # RopeParams::freq holds 2 * TABLE_PAIRS floats


@functools.lru_cache(maxsize=64)
def frequency_table(mode: str, rotary_dim: int, scalars: tuple) -> np.ndarray:
    """[min(R / 2, TABLE_PAIRS), 2] float32: (hi, lo) turns per position of each pair.
    scalars: (rope_scale, rope_theta) for "theta", (rope_scale, rope_theta, low_freq_factor,
    high_freq_factor, old_context_len) for "llama31"."""
    rope_scale, theta, *llama = (float(np.float32(s)) for s in scalars)
    i = np.arange(min(rotary_dim // 2, TABLE_PAIRS), dtype=np.float64)
    inv = theta ** (-2.0 * i / rotary_dim)
    if mode == "llama31":
        low, high, old = llama
        a = old / (2 * np.pi * (high - low))
        b = -1.0 / (high / low - 1.0)
        smooth = np.clip(inv * a + b, 0.0, 1.0)
        inv = (1 - smooth) * inv / rope_scale + smooth * inv
    elif mode == "theta":
        inv = inv / rope_scale
    else:
        raise ValueError(f"no frequency table for RoPE mode {mode!r}")
    f = inv / (2 * np.pi)
    hi = f.astype(np.float32)
    lo = (f - hi.astype(np.float64)).astype(np.float32)
    table = np.stack([hi, lo], axis=1)
    table.flags.writeable = False
    return table


def table_writer(params, mode: str, rotary_dim: int):
    """write(scalars): puts `scalars` into `params`' frequency fields (rope_scale, rope_theta,
    and Llama 3.1's low_freq_factor, high_freq_factor, old_context_len) and their table into its
    freq field, unless the last write was of the same scalars (a model's calls all pass the
    same ones)."""
    address = ctypes.addressof(params) + type(params).freq.offset
    names = ("rope_scale", "rope_theta", "low_freq_factor", "high_freq_factor", "old_context_len")
    last = [None]

    def write(scalars: tuple) -> None:
        if scalars != last[0]:
            for name, value in zip(names, scalars, strict=False):
                setattr(params, name, value)
            table = frequency_table(mode, rotary_dim, scalars)
            ctypes.memmove(address, table.ctypes.data, table.nbytes)
            last[0] = scalars

    return write


__all__ = ["TABLE_PAIRS", "frequency_table", "table_writer"]
