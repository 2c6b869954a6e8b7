"""The prefill kernel seen from the host: its spec (cuda_src/attention/prefill.cu).

One kernel per (dtypes (KV: q's or fp8), head_dim, query tile, KV tile, pipeline depth, causal
or custom mask, position encoding, soft cap); lengths, page ids and the work list arrive
through the plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop.dtypes import FP8_DTYPES, itemsize
from ..launch import Kernel
from ..plan.prefill import choose_tile_rows
from .decode_kernel import PosEncoding

HEAD_DIMS = (64, 128, 256)
TILE_ROWS = (16, 64, 128)


@dataclass(frozen=True)
class PrefillSpec:
    q_dtype: str
    o_dtype: str
    head_dim: int
    tile_rows: int  # packed query rows per CTA (16 per warp; a 16-row tile has 4 warps)
    kv_tile: int  # keys per pipeline stage
    stages: int
    causal: bool
    custom_mask: bool  # a packed bit mask per request (then not causal)
    pos_encoding_mode: str  # "NONE", "ROPE_LLAMA" or "ALIBI"
    soft_cap: bool
    kv_dtype: str  # q's, or an fp8 type (widened to q's in shared memory)
    ragged: bool = False  # K/V rows of each request contiguous (no page table to read)
    warp_rows: int = 16  # packed rows per warp: 16, or 32 (two MMA row blocks) in 128-row tiles
    source: ClassVar[str] = "attention/prefill.cu"
    kernels: ClassVar[tuple[str, ...]] = ("prefill_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("PrefillParams", "PrefillWorkItem")

    @property
    def threads(self) -> int:
        """A warp per warp_rows rows; four warps splitting the keys of a 16-row tile."""
        return 128 if self.tile_rows == 16 else 32 * self.tile_rows // self.warp_rows

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, the K/V ring, the widened K/V tiles of fp8, RoPE
        frequencies, a flag."""
        row = self.head_dim * itemsize(self.q_dtype)
        ring = self.stages * 2 * self.kv_tile * self.head_dim * itemsize(self.kv_dtype)
        staging = 2 * self.kv_tile * row if self.kv_dtype in FP8_DTYPES else 0
        freq = self.head_dim // 2 * 8 if self.pos_encoding_mode == "ROPE_LLAMA" else 0
        return self.tile_rows * row + ring + staging + freq + 16

    def prelude(self) -> str:
        return jit.prelude(
            QT=self.q_dtype,
            KVT=self.kv_dtype,
            OT=self.o_dtype,
            HEAD_DIM=self.head_dim,
            TILE_ROWS=self.tile_rows,
            KV_TILE=self.kv_tile,
            STAGES=self.stages,
            CAUSAL=self.causal,
            CUSTOM_MASK=self.custom_mask,
            POS_ENCODING=PosEncoding[self.pos_encoding_mode],
            SOFT_CAP=self.soft_cap,
            SMEM_BYTES=self.smem_bytes,
            RAGGED=self.ragged,
            WARP_ROWS=self.warp_rows,
        )


def prefill_spec(
    q_dtype, o_dtype, head_dim, tile_rows, causal=False, pos_encoding_mode="NONE", soft_cap=False,
    max_smem=227 * 1024, custom_mask=False, kv_dtype=None, ragged=False, warp_rows=None,
) -> PrefillSpec:  # fmt: skip
    """The kernel for a configuration: K/V tiles of 64 keys (32 at head_dim 256 beside a Q
    tile of 64 rows; 32 with two row blocks a warp), as deep a ring (3 or 2 stages) as fits
    beside the Q tile; `ragged`: K/V rows addressed from each request's first row, without a
    page table; `warp_rows`: 16, or 32 in 128-row tiles at head_dim <= 128 without a custom
    mask (four warps, each K/V fragment feeding two MMAs); None chooses 32 where it was measured
    faster (128-row tiles at head_dim 128 without a custom mask: 5-18% on the H200, head_dim
    64 8% slower) and 16 elsewhere."""
    if warp_rows is None:
        warp_rows = 32 if (tile_rows, head_dim, bool(custom_mask)) == (128, 128, False) else 16
    if warp_rows not in (16, 32) or (
        warp_rows == 32 and (tile_rows != 128 or head_dim > 128 or custom_mask)
    ):
        raise ValueError(
            f"warp_rows {warp_rows} with {tile_rows}-row tiles at head_dim {head_dim}: 16, or 32 "
            "in 128-row tiles up to head_dim 128 without a custom mask"
        )
    kv_tile = 32 if (head_dim == 256 and tile_rows > 16) or warp_rows == 32 else 64
    for stages in (3, 2):
        spec = PrefillSpec(q_dtype, o_dtype, head_dim, tile_rows, kv_tile, stages, bool(causal),
                           bool(custom_mask), pos_encoding_mode, bool(soft_cap),
                           kv_dtype or q_dtype, bool(ragged), warp_rows)  # fmt: skip
        if spec.smem_bytes <= max_smem:
            return spec
    raise ValueError(
        f"head_dim {head_dim} with {tile_rows}-row query tiles needs {spec.smem_bytes} bytes of "
        f"shared memory per CTA; this device allows {max_smem}"
    )


def specs_for(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, max_smem) -> list:
    """The prefill kernels a model's serving loop may launch (warmup) on a GPU with max_smem
    bytes of shared memory per block: causal prefill in every query tile plan() may choose,
    over the paged cache (kv_dtype) and over ragged new keys (q's dtype), and the tile of
    decode with use_tensor_cores=True (one query per request, not causal)."""
    group = num_qo_heads // num_kv_heads
    tiles = [rows for rows in TILE_ROWS if rows < 128 or head_dim < 256]
    specs = [prefill_spec(q_dtype, q_dtype, head_dim, rows, True, max_smem=max_smem, kv_dtype=kv,
                          ragged=ragged)
             for kv, ragged in ((kv_dtype, False), (q_dtype, True)) for rows in tiles]  # fmt: skip
    decode_rows = choose_tile_rows(np.ones(1, np.int64), group, head_dim)
    specs.append(prefill_spec(q_dtype, q_dtype, head_dim, decode_rows, False, max_smem=max_smem,
                              kv_dtype=kv_dtype))  # fmt: skip
    return specs


@functools.cache
def kernel(spec: PrefillSpec) -> Kernel:
    return Kernel(spec, "prefill_kernel", "PrefillParams", spec.smem_bytes)


__all__ = ["HEAD_DIMS", "PrefillSpec", "TILE_ROWS", "kernel", "prefill_spec", "specs_for"]
