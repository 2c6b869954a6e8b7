"""The prefill kernel seen from the host: its spec (cuda_src/attention/prefill.cu).

One kernel per (dtypes (KV: q's or fp8), head_dim (q's and k's; v's where it differs), query
tile, KV tile, pipeline depth, causal or custom mask, position encoding, soft cap); lengths,
page ids and the work list arrive through the plan.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop.dtypes import FP8_DTYPES, itemsize
from ..launch import Kernel
from ..plan.prefill import choose_tile_rows
from .decode_kernel import PosEncoding

HEAD_DIMS = (64, 128, 256)
SM80_SMEM = 163 * 1024  # the most shared memory a block of any sm_8x GPU may take
# (head_dim_qk, head_dim_vo) pairs of different dims: DeepSeek's prefill (MLA's keys with their
# RoPE part, 128 + 64, over values of 128), as FlashInfer's batch prefill takes them
DIM_PAIRS = ((192, 128),)
TILE_ROWS = (8, 16, 64, 128)


@dataclass(frozen=True)
class PrefillSpec:
    q_dtype: str
    o_dtype: str
    head_dim: int
    tile_rows: int  # packed query rows per CTA (16 per warp; 8- and 16-row tiles have 4 warps)
    kv_tile: int  # keys per pipeline stage
    stages: int
    causal: bool
    custom_mask: bool  # a packed bit mask per request (then not causal)
    pos_encoding_mode: str  # "NONE", "ROPE_LLAMA" or "ALIBI"
    soft_cap: bool
    kv_dtype: str  # q's, or an fp8 type (widened to q's in shared memory)
    ragged: bool = False  # K/V rows of each request contiguous (no page table to read)
    # packed rows per warp: 16, or 32 (two MMA row blocks) in 128-row tiles; 8 in 8-row tiles
    # (the rows on the MMAs' N side, prefill_key_major.cuh)
    warp_rows: int = 16
    wgmma: bool = False  # sm_90a: warpgroup MMAs over 64-row blocks (16-row warps, 64-key tiles)
    min_ctas: int = 0  # CTAs per SM the registers must leave room for (launch bounds; 0: none)
    # fp8 K/V read by the MMAs straight from the ring, widened to fp16 in registers (16-row
    # tiles without RoPE; prefill_fp8_fragments.cuh), instead of widened into staging tiles.
    fp8_direct: bool = False
    # v's and o's head_dim where it is not q's and k's (DeepSeek's 192 / 128: DIM_PAIRS); 16-bit
    # KV, RoPE outside the kernel, the mma.sync kernel
    head_dim_vo: int | None = None
    # MLA (attention/mla.py): head_dim 576 (ckv 512 + kpe 64, from two caches and two query
    # arrays), V = ckv read from the K tile, four warps a row warp, each a quarter of O's dims
    mla: bool = False
    source: ClassVar[str] = "attention/prefill.cu"
    kernels: ClassVar[tuple[str, ...]] = ("prefill_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("PrefillParams", "PrefillWorkItem")

    @property
    def min_sm(self) -> int:
        """wgmma is sm_90a's own (see wgmma_supported); so is a kernel whose shared memory
        exceeds sm_80's 163 KB a block (no sm_8x GPU can launch it)."""
        return 90 if self.wgmma or self.smem_bytes > SM80_SMEM else 80

    @property
    def threads(self) -> int:
        """A warp per warp_rows rows; four warps splitting the keys of an 8- or 16-row tile;
        MLA: four warps a row warp, splitting O's dims."""
        if self.mla:
            return 4 * 32 * self.tile_rows // self.warp_rows
        return 128 if self.tile_rows <= 16 else 32 * self.tile_rows // self.warp_rows

    @property
    def dim_vo(self) -> int:
        return self.head_dim if self.head_dim_vo is None else self.head_dim_vo

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, the K/V ring, the widened K/V tiles of fp8 (but
        fp8_direct's), RoPE frequencies, a paged cache's row-offset table (two tiles of K and V
        int64 offsets), MLA's exchange, a flag."""
        row = self.head_dim * itemsize(self.q_dtype)
        v_ring = 0 if self.mla else self.dim_vo  # MLA's V is the K tile's first dims
        ring = self.stages * self.kv_tile * (self.head_dim + v_ring) * itemsize(self.kv_dtype)
        widened = self.kv_dtype in FP8_DTYPES and not self.fp8_direct
        staging = 2 * self.kv_tile * row if widened else 0
        freq = self.head_dim // 2 * 8 if self.pos_encoding_mode == "ROPE_LLAMA" else 0
        table = 0 if self.ragged else 2 * 2 * self.kv_tile * 8
        # MLA's exchange: P [16][kv_tile] 16-bit, the key groups' row maxima and sums
        xchg = 16 * self.kv_tile * 2 + 2 * (self.kv_tile // 16) * 16 * 4 if self.mla else 0
        xchg *= self.tile_rows // 16  # a row warp's each
        return self.tile_rows * row + ring + staging + freq + table + xchg + 16

    def prelude(self) -> str:
        return jit.prelude(
            QT=self.q_dtype,
            KVT=self.kv_dtype,
            OT=self.o_dtype,
            HEAD_DIM=self.head_dim,
            HEAD_DIM_VO=self.dim_vo,
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
            WGMMA=self.wgmma,
            MIN_CTAS=self.min_ctas,
            FP8_DIRECT=self.fp8_direct,
            MLA=self.mla,
        )


@functools.lru_cache(maxsize=256)  # plan() asks on every call
def prefill_spec(
    q_dtype, o_dtype, head_dim, tile_rows, causal=False, pos_encoding_mode="NONE", soft_cap=False,
    max_smem=227 * 1024, custom_mask=False, kv_dtype=None, ragged=False, warp_rows=None,
    wgmma=False, fp8_direct=None, head_dim_vo=None,
) -> PrefillSpec:  # fmt: skip
    """The kernel for a configuration: K/V tiles of 64 keys (32 at head_dim 256 beside a Q
    tile of 64 rows; 32 with two row blocks a warp), as deep a ring (3 or 2 stages) as fits
    beside the Q tile; `ragged`: K/V rows addressed from each request's first row, without a
    page table; `warp_rows`: 16, or 32 in 128-row tiles at head_dim <= 128 without a custom
    mask (four warps, each K/V fragment feeding two MMAs); None chooses 32 where it was measured
    faster (128-row tiles at head_dim 128 without a custom mask: 5-18% on the H200, head_dim
    64 8% slower) and 16 elsewhere. `wgmma` (sm_90a, wgmma_supported): each 64-row warpgroup
    multiplies with warpgroup MMAs, 16-row warps, 64-key tiles; over ragged K/V a 2-stage ring
    (two CTAs, four warpgroups, per SM at head_dim <= 128: 20-40% faster on the H200 than a
    3-stage ring and one CTA; bench/tune_prefill.py); over a paged cache the same with
    registers capped for two CTAs a SM (`min_ctas`, without a custom mask: 1.2x faster than one
    CTA on the H200; the row table, paged_rows.cuh, keeps the 128-row kernel within 128
    registers without spills on NVRTC 13.5, and tests/test_jit.py keeps any spill out of the
    loops), else 3 stages where they fit; an explicit warp_rows asks for the mma.sync kernel
    with that warp shape instead. `fp8_direct`: fp8 K/V of an 8- or 16-row tile without RoPE
    read by the MMAs from the ring (PrefillSpec.fp8_direct) in 128-key tiles (64 at head_dim
    256; busy_decode_spec's 64 on a batch that fills the GPU), 3 stages where they fit;
    None: wherever it applies, False: widened into staging tiles (64-key tiles, 2 stages).
    `head_dim_vo` (DIM_PAIRS): v's dims where they are fewer than q's and k's, with 16-row
    warps and 64-key tiles, 16-bit KV, RoPE outside the kernel (_unequal_dims_spec)."""
    if head_dim_vo is not None and head_dim_vo != head_dim:
        return _unequal_dims_spec(q_dtype, o_dtype, head_dim, head_dim_vo, tile_rows, causal,
                                  pos_encoding_mode, soft_cap, max_smem, custom_mask, kv_dtype,
                                  ragged, warp_rows, wgmma)  # fmt: skip
    direct_fits = (kv_dtype in FP8_DTYPES and tile_rows <= 16
                   and pos_encoding_mode != "ROPE_LLAMA")  # fmt: skip
    if fp8_direct is None:
        fp8_direct = direct_fits
    elif fp8_direct and not direct_fits:
        raise ValueError(
            f"fp8_direct with {tile_rows}-row tiles, KV {kv_dtype}, {pos_encoding_mode}: fp8 KV "
            "in 8- or 16-row tiles without in-kernel RoPE"
        )
    if wgmma and warp_rows is None:
        if not wgmma_supported(tile_rows, pos_encoding_mode, q_dtype, kv_dtype or q_dtype):
            raise ValueError(
                f"wgmma with {tile_rows}-row tiles, {pos_encoding_mode}, KV {kv_dtype}: 64 or 128 "
                "rows, RoPE outside the kernel, KV of q's dtype"
            )
        two_ctas = not ragged and tile_rows == 128 and head_dim <= 128 and not custom_mask
        return _fitting(q_dtype, o_dtype, head_dim, tile_rows, 64, causal, custom_mask,
                        pos_encoding_mode, soft_cap, kv_dtype, ragged, 16, True, max_smem,
                        stage_choices=(3, 2) if custom_mask and not ragged else (2,),
                        min_ctas=2 if two_ctas else 0)  # fmt: skip
    if warp_rows is None:
        warp_rows = 32 if (tile_rows, head_dim, bool(custom_mask)) == (128, 128, False) else 16
        warp_rows = 8 if tile_rows == 8 else warp_rows
    if (
        (warp_rows == 8) != (tile_rows == 8)
        or warp_rows not in (8, 16, 32)
        or (warp_rows == 32 and (tile_rows != 128 or head_dim > 128 or custom_mask))
    ):
        raise ValueError(
            f"warp_rows {warp_rows} with {tile_rows}-row tiles at head_dim {head_dim}: 16, or 32 "
            "in 128-row tiles up to head_dim 128 without a custom mask, 8 in 8-row tiles"
        )
    kv_tile = 32 if (head_dim == 256 and tile_rows > 16) or warp_rows == 32 else 64
    # fp8 in 16-row (decode) tiles, on an H200 at head_dim 128 with bf16 q (graph us,
    # bench/tune_decode_split.py): read from the ring in 128-key tiles, 3 stages: 1 x 32768
    # tokens 30.2, 64 x 4096 134.3, 256 x 1024 154.0 (2 stages 31.8 / 175.0 / 146.7; 64-key
    # tiles 32.5 / 168.4 / 152.7); widened into staging tiles (each warp its own keys, a
    # variant since dropped) 45-55 / 239-360 / 241-392. Widened (RoPE, fp8_direct=False), a
    # 2-stage ring leaves room for three CTAs a SM beside the staging tiles.
    widened_decode = tile_rows <= 16 and kv_dtype in FP8_DTYPES and not fp8_direct
    if fp8_direct and head_dim <= 128:
        kv_tile = 128
    return _fitting(q_dtype, o_dtype, head_dim, tile_rows, kv_tile, causal, custom_mask,
                    pos_encoding_mode, soft_cap, kv_dtype, ragged, warp_rows, False,
                    max_smem, stage_choices=(2,) if widened_decode else (3, 2),
                    fp8_direct=fp8_direct)  # fmt: skip


@functools.lru_cache(maxsize=256)  # plan() asks on every call
def wide_decode_spec(spec: PrefillSpec, max_smem: int) -> PrefillSpec | None:
    """The 8- or 16-row tile over 128-key K/V tiles in a 3-stage ring, for a decode-shaped
    batch too small to give every SM a CTA (plan_launch): not causal, 16-bit KV, head_dim <=
    128, no in-kernel RoPE or custom mask, where the ring fits max_smem (one CTA a SM); None
    elsewhere. On an H200 (bf16, 32 / 8 heads, head_dim 128, graph us, 16-row tiles;
    bench/tune_decode_split.py): 1 x 32768 tokens 41.2 against 43.5 in 64-key tiles, 16 x 4096
    68.7 against 71.0; batches that fill the GPU are faster in 64-key tiles with two CTAs a SM
    (64 x 4096 251.7 against 257.9, 256 x 1024 255.0 against 271.7)."""
    if (spec.tile_rows > 16 or spec.causal or spec.kv_dtype != spec.q_dtype
            or spec.head_dim > 128 or spec.pos_encoding_mode == "ROPE_LLAMA"
            or spec.custom_mask):  # fmt: skip
        return None
    wide = replace(spec, kv_tile=128, stages=3)
    return wide if wide.smem_bytes <= max_smem else None


@functools.lru_cache(maxsize=256)
def busy_decode_spec(spec: PrefillSpec) -> PrefillSpec | None:
    """The 8- or 16-row tile over fp8 K/V read from the ring in 64-key tiles, 3 stages, for a
    decode-shaped batch that gives every SM a CTA (plan_launch): half the ring of 128-key
    tiles, twice the CTAs a SM (as the decode kernel's half tiles over fp8). On an H200 (bf16 q,
    e4m3 KV, 32 / 8 heads, head_dim 128, 8-row tiles, graph us): 64 x 4096 tokens 132.4
    against 134.1 in 128-key tiles, 256 x 1024 139.7 against 143.5 (2 stages of 64 keys:
    129.1 / 143.6); a batch that leaves SMs idle keeps 128 keys (1 x 32768: 28.1 against 32.6).
    None elsewhere (16-bit KV, widened fp8, tiles of other heights)."""
    if spec.tile_rows > 16 or not spec.fp8_direct or spec.kv_tile != 128:
        return None
    return replace(spec, kv_tile=64, stages=3)


def check_dims(head_dim, head_dim_vo, q_dtype, kv_dtype, pos_encoding_mode,
               warp_rows=None) -> None:  # fmt: skip
    """Raise ValueError unless the kernel takes v of head_dim_vo dims beside q and k of
    head_dim: equal, or a pair of DIM_PAIRS over 16-bit KV of q's dtype with RoPE outside the
    kernel (16-row warps)."""
    if head_dim_vo is None or head_dim_vo == head_dim:
        return
    problems = [what for what, bad in (
        (f"this pair (the pairs taken: {', '.join(map(str, DIM_PAIRS))})",
         (head_dim, head_dim_vo) not in DIM_PAIRS),
        (f"KV {kv_dtype} (16-bit KV of q's dtype)", kv_dtype not in (None, q_dtype)),
        ("in-kernel RoPE (apply it to q and k before the call)", pos_encoding_mode == "ROPE_LLAMA"),
        (f"warp_rows {warp_rows} (16; 8 in 8-row tiles)", warp_rows not in (None, 8, 16)),
    ) if bad]  # fmt: skip
    if problems:
        raise ValueError(f"head_dim_vo {head_dim_vo} != head_dim_qk {head_dim}: not with "
                         + "; ".join(problems))  # fmt: skip


def _unequal_dims_spec(q_dtype, o_dtype, head_dim, head_dim_vo, tile_rows, causal,
                       pos_encoding_mode, soft_cap, max_smem, custom_mask, kv_dtype, ragged,
                       warp_rows, wgmma) -> PrefillSpec:  # fmt: skip
    """prefill_spec's kernel for q and k of head_dim dims over v of head_dim_vo: 64-key tiles,
    16-row warps (8 in 8-row tiles); with `wgmma` (64- or 128-row tiles) the warpgroup-MMA
    kernel, whose 128-row tile has an SM to itself (3 stages where they fit) and whose 64-row
    tile leaves room for two (2 stages), as a guess not yet measured."""
    check_dims(head_dim, head_dim_vo, q_dtype, kv_dtype, pos_encoding_mode, warp_rows)
    if wgmma and tile_rows not in (64, 128):
        raise ValueError(f"wgmma with {tile_rows}-row tiles: 64 or 128 rows")
    warp_rows = 8 if tile_rows == 8 else 16
    return _fitting(q_dtype, o_dtype, head_dim, tile_rows, 64, causal, custom_mask,
                    pos_encoding_mode, soft_cap, q_dtype, ragged, warp_rows, wgmma, max_smem,
                    stage_choices=(3, 2) if not wgmma or tile_rows == 128 else (2,),
                    head_dim_vo=head_dim_vo)  # fmt: skip


MLA_CKV, MLA_KPE = 512, 64  # MLA's latent and RoPE dims


@functools.lru_cache(maxsize=64)
def mla_spec(q_dtype, o_dtype, tile_rows, causal=False, max_smem=227 * 1024) -> PrefillSpec:
    """MLA's kernel (prefill.cu's MLA, attention/mla.py): K rows of ckv + kpe (576 dims) in
    the ring, V = their ckv part; 16- or 32-row query tiles, four warps on each 16 rows
    splitting the scores' keys and O's 512 dims (prefill_mla.cuh; 64-row tiles, sixteen
    warps, would cap registers at 128 a thread and spill); 64-key K tiles where two stages fit
    (sm_90), else 32-key ones; 3 stages where they fit, else 2."""
    if tile_rows not in (16, 32):
        raise ValueError(f"MLA takes 16- or 32-row query tiles, got {tile_rows}")
    error = None
    for kv_tile in (64, 32):
        try:
            return _fitting(q_dtype, o_dtype, MLA_CKV + MLA_KPE, tile_rows, kv_tile, causal,
                            False, "NONE", False, q_dtype, False, 16, False, max_smem,
                            head_dim_vo=MLA_CKV, mla=True)  # fmt: skip
        except ValueError as e:  # too much shared memory: fewer keys a tile
            error = e
    raise error


def use_wgmma(arch, tile_rows, pos_encoding_mode, q_dtype, kv_dtype) -> bool:
    """Whether prefill on `arch` takes the warpgroup-MMA kernel: on sm_90a where it covers the
    configuration, unless RTCINFER_PREFILL_WGMMA=0 (the mma.sync kernel everywhere)."""
    return (
        arch == "sm_90a"
        and os.environ.get("RTCINFER_PREFILL_WGMMA") != "0"
        and wgmma_supported(tile_rows, pos_encoding_mode, q_dtype, kv_dtype or q_dtype)
    )


def wgmma_supported(tile_rows, pos_encoding_mode, q_dtype, kv_dtype) -> bool:
    """Whether the warpgroup-MMA kernel covers a configuration: 64- or 128-row tiles (whole
    warpgroups), RoPE outside the kernel, 16-bit KV of q's dtype (no fp8 widening)."""
    return tile_rows in (64, 128) and pos_encoding_mode != "ROPE_LLAMA" and kv_dtype == q_dtype


def _fitting(q_dtype, o_dtype, head_dim, tile_rows, kv_tile, causal, custom_mask,
             pos_encoding_mode, soft_cap, kv_dtype, ragged, warp_rows, wgmma, max_smem,
             stage_choices=(3, 2), min_ctas=0, fp8_direct=False, head_dim_vo=None,
             mla=False):  # fmt: skip
    """The first configuration of stage_choices whose ring fits in max_smem."""
    for stages in stage_choices:
        spec = PrefillSpec(q_dtype, o_dtype, head_dim, tile_rows, kv_tile, stages, bool(causal),
                           bool(custom_mask), pos_encoding_mode, bool(soft_cap),
                           kv_dtype or q_dtype, bool(ragged), warp_rows, wgmma,
                           min_ctas, bool(fp8_direct), head_dim_vo, mla)  # fmt: skip
        if spec.smem_bytes <= max_smem:
            return spec
    raise ValueError(
        f"head_dim {head_dim} with {tile_rows}-row query tiles needs {spec.smem_bytes} bytes of "
        f"shared memory per CTA; this device allows {max_smem}"
    )


def specs_for(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, max_smem,
              arch="sm_80") -> list:  # fmt: skip
    """The prefill kernels a model's serving loop may launch (warmup) on a GPU of `arch` with
    max_smem bytes of shared memory per block: causal prefill in every query tile plan() may
    choose, over the paged cache (kv_dtype) and over ragged new keys (q's dtype), and the tile
    of decode with use_tensor_cores=True (one query per request, not causal; also over
    128-key K/V tiles where wide_decode_spec gives them, 64-key ones where busy_decode_spec
    does)."""
    group = num_qo_heads // num_kv_heads
    wide = use_wgmma(arch, 128, "NONE", q_dtype, q_dtype)  # 128 rows at head_dim 256 too
    tiles = [rows for rows in TILE_ROWS if rows < 128 or head_dim < 256 or wide]
    decode_rows = choose_tile_rows(np.ones(1, np.int64), group, head_dim, wide)
    calls = [(rows, True, kv, ragged) for kv, ragged in ((kv_dtype, False), (q_dtype, True))
             for rows in tiles] + [(decode_rows, False, kv_dtype, False)]  # fmt: skip
    specs = [prefill_spec(q_dtype, q_dtype, head_dim, rows, causal, max_smem=max_smem,
                          kv_dtype=kv, ragged=ragged,
                          wgmma=use_wgmma(arch, rows, "NONE", q_dtype, kv))
             for rows, causal, kv, ragged in calls]  # fmt: skip
    # the decode tile of a batch too small to fill the GPU, and of one that fills it
    more = (wide_decode_spec(specs[-1], max_smem), busy_decode_spec(specs[-1]))
    return specs + [spec for spec in more if spec is not None]


@functools.cache
def kernel(spec: PrefillSpec) -> Kernel:
    return Kernel(spec, "prefill_kernel", "PrefillParams", spec.smem_bytes)


__all__ = [
    "DIM_PAIRS",
    "HEAD_DIMS",
    "PrefillSpec",
    "TILE_ROWS",
    "check_dims",
    "kernel",
    "mla_spec",
    "prefill_spec",
    "specs_for",
    "use_wgmma",
    "busy_decode_spec",
    "wgmma_supported",
    "wide_decode_spec",
]
