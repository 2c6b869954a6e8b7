"""The decode kernel seen from the host: spec, static configuration, launch helpers.

One kernel (cuda_src/attention/decode.cu) serves every group size, head_dim 64/128/256,
fp16/bf16 q and fp16/bf16/fp8 KV. Its spec fixes dtypes, head_dim, head tiles, the position
encoding, the soft cap and the pipeline shape; everything per step (lengths, page ids) arrives
through the plan.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np

from .. import jit
from ..interop.dtypes import FP8_DTYPES, itemsize, normalize
from ..launch import Kernel
from ..plan._checks import INT32_MAX, as_int
from .scalars import attention_scalars


class PosEncoding(enum.IntEnum):
    """pos_encoding_mode (FlashInfer's names): RoPE on q and k in the kernel, or ALiBi."""

    NONE = 0
    ROPE_LLAMA = 1
    ALIBI = 2


POS_ENCODING_MODES = tuple(m.name for m in PosEncoding)
HEAD_DIMS = (64, 128, 256)
Q_DTYPES = ("float16", "bfloat16")
KV_DTYPES = ("float16", "bfloat16", *FP8_DTYPES)
THREADS = 128
MAX_CTAS_PER_SM = 4  # the most resident CTAs per SM the planner is told about
STAGE_BYTES = 32 * 1024  # K + V bytes per pipeline stage the tile size aims at


@dataclass(frozen=True)
class DecodeSpec:
    q_dtype: str
    kv_dtype: str
    o_dtype: str
    head_dim: int
    head_tiles: int  # query heads per CTA / 8
    pos_encoding_mode: str
    soft_cap: bool
    stages: int
    token_groups: int  # 16-token groups per warp per tile
    lookahead: int = 0  # K/V tiles in flight ahead of the one computed; 0: stages - 1
    source: ClassVar[str] = "attention/decode.cu"
    kernels: ClassVar[tuple[str, ...]] = ("decode_kernel",)
    structs: ClassVar[tuple[str, ...]] = ("DecodeParams", "DecodeWorkItem")

    @property
    def tile(self) -> int:
        return 4 * 16 * self.token_groups

    @property
    def ring_bytes(self) -> int:
        """The K/V ring: stages x (K + V) tiles."""
        return self.stages * 2 * self.tile * self.head_dim * itemsize(self.kv_dtype)

    @property
    def epilogue_fits(self) -> bool:
        """Whether the epilogue's fp32 rows (4 warps x heads x (head_dim + 4)), which reuse the
        ring, fit in it (decode.cu asserts it at compile time)."""
        return 4 * 8 * self.head_tiles * (self.head_dim + 4) * 4 <= self.ring_bytes

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: ring, q rows, RoPE frequencies, per-warp (m, d) + flag."""
        heads = 8 * self.head_tiles
        q_rows = heads * (self.head_dim + 16) * 2
        freq = self.head_dim // 2 * 8 if self.pos_encoding_mode == "ROPE_LLAMA" else 0
        return self.ring_bytes + q_rows + freq + 2 * 4 * heads * 4 + 16

    def prelude(self) -> str:
        return jit.prelude(
            QT=self.q_dtype,
            KVT=self.kv_dtype,
            OT=self.o_dtype,
            HEAD_DIM=self.head_dim,
            HEAD_TILES=self.head_tiles,
            POS_ENCODING=PosEncoding[self.pos_encoding_mode],
            SOFT_CAP=self.soft_cap,
            STAGES=self.stages,
            TOKEN_GROUPS=self.token_groups,
            LOOKAHEAD=self.lookahead,
            SMEM_BYTES=self.smem_bytes,
        )


def decode_spec(
    q_dtype, kv_dtype, o_dtype, head_dim, group_size, pos_encoding_mode="NONE",
    soft_cap=False, max_smem=227 * 1024,
) -> DecodeSpec:  # fmt: skip
    """The kernel for a configuration: tiles of ~32 KB of K + V, 3 stages (2 if 3 do not fit)."""
    row = head_dim * itemsize(kv_dtype)
    token_groups = max(1, min(4, STAGE_BYTES // (2 * 64 * row)))
    if pos_encoding_mode == "ROPE_LLAMA":  # bound by the rotation math: small tiles suffice
        token_groups = 1
    head_tiles = heads_per_cta(group_size, head_dim) // 8
    for stages in (3, 2):
        spec = DecodeSpec(q_dtype, kv_dtype, o_dtype, head_dim, head_tiles, pos_encoding_mode,
                          bool(soft_cap), stages, token_groups)  # fmt: skip
        if spec.smem_bytes <= max_smem:
            return spec
    raise ValueError(
        f"head_dim {head_dim} with {kv_dtype} KV needs {spec.smem_bytes} bytes of shared memory "
        f"per CTA; this device allows {max_smem}"
    )


def kv_scales(k_scale, v_scale, q_scale=None) -> tuple[float, float]:
    """The calibration scales as (logit factor q_scale * k_scale, v_scale), floats (None: 1;
    0 is a scale, as in FlashInfer)."""
    if k_scale is None and v_scale is None and q_scale is None:  # the common call
        return 1.0, 1.0
    as_float = lambda x: 1.0 if x is None else float(x)  # noqa: E731
    return as_float(q_scale) * as_float(k_scale), as_float(v_scale)


def half_tiles(spec: DecodeSpec) -> DecodeSpec | None:
    """The kernel with tiles of half the tokens (16 KB of K + V per stage, twice the CTAs per
    SM); plan() picks it for fp8 KV in plans of whole requests (see _half_tile_kernel).
    None when the tile cannot be halved or the halved ring would not hold the epilogue (a
    2-stage ring on a GPU with less shared memory, 16 heads per CTA)."""
    if spec.token_groups < 2:
        return None
    half = replace(spec, token_groups=spec.token_groups // 2)
    return half if half.epilogue_fits else None


# Work items of at least this many K/V tiles on average stream "long rows" (see _lookahead).
LONG_ITEM_TILES = 64


def _lookahead(plan, tile: int) -> int:
    """The copy lookahead a plan's kernel is compiled with (DecodeSpec.lookahead): 1 (one K/V
    tile in flight ahead of the one computed) when every tile lies in one page
    (page_size >= tile) and the items are long (sum(kv_len) >= LONG_ITEM_TILES * tile *
    num_work), else 0 (the ring's depth - 1). Measured on an H200: 1 is 1-2% faster on such
    rows (32 x 8192 tokens, pages of 64: 246.2 vs 248.9 us) and 1-2% slower on short items or
    tiles across pages."""
    if plan.page_size < tile or plan.num_work == 0:
        return 0
    return int(int(plan.kv_len.sum()) >= LONG_ITEM_TILES * tile * plan.num_work)


def _half_tile_kernel(plan, spec, fixed_split_size):
    """The kernel with tiles of half the tokens (half_tiles: 16 KB of K + V per stage, twice
    the CTAs per SM) when a plan should run it, else None: fp8 KV in a plan of whole requests,
    where the halved kernel exists. Measured on an H200 (head_dim 128, page 16): 256 x 1024
    tokens 146 -> 136 us, 64 x 4096 134 -> 132; split plans keep the larger tile (1 x 32768:
    26.4 -> 28.0, the extra CTAs per SM double the partials to merge). Not with
    fixed_split_size, whose results must not depend on the batch (the tile sets the order of
    the float reduction)."""
    if spec.kv_dtype not in FP8_DTYPES or fixed_split_size is not None:
        return None
    return half_tiles(spec) if plan.num_work == plan.batch_size else None


def plan_kernel(plan, spec: DecodeSpec, fixed_split_size) -> DecodeSpec:
    """The variant of `spec` a plan of a wrapper without CUDA graphs runs (a graph wrapper
    keeps one kernel): one tile ahead for long rows (_lookahead), else half tiles for fp8 KV
    in plans of whole requests (_half_tile_kernel), else `spec`."""
    if _lookahead(plan, spec.tile):
        return replace(spec, lookahead=1)
    return _half_tile_kernel(plan, spec, fixed_split_size) or spec


def heads_per_cta(group_size: int, head_dim: int) -> int:
    """Query heads one CTA holds: 8, or 16 for larger groups (not at head_dim 256, where 16
    heads of fp32 accumulators would not fit in registers); bigger groups split across CTAs."""
    return 8 if group_size <= 8 or head_dim == 256 else 16


def specs_for(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, max_smem):
    """The decode kernels a model's batch decode may launch (warmup), KV of kv_dtype on a GPU
    with max_smem bytes of shared memory per block: plain attention with the ring's lookahead
    and with one tile ahead (plan() picks it for long rows in large pages, see
    _lookahead), and with fp8 KV the kernel of half tiles (plans of whole requests, see
    _half_tile_kernel), so that none of them compiles while serving."""
    spec = decode_spec(q_dtype, kv_dtype, q_dtype, head_dim, num_qo_heads // num_kv_heads,
                       max_smem=max_smem)  # fmt: skip
    specs = [spec, replace(spec, lookahead=1)]
    half = half_tiles(spec) if kv_dtype in FP8_DTYPES else None
    return specs + ([half] if half is not None else [])


def fast_div(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def rope_frequencies(head_dim: int, rope_scale: float, rope_theta: float) -> np.ndarray:
    """float32 [head_dim / 2, 2]: theta ** (-2i / D) / scale in turns per position, as hi + lo."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    turns = rope_theta ** (-2.0 * i / head_dim) / rope_scale / (2 * math.pi)
    hi = turns.astype(np.float32)
    return np.stack([hi, (turns - hi).astype(np.float32)], axis=1)


@functools.cache
def kernel(spec: DecodeSpec) -> Kernel:
    return Kernel(spec, "decode_kernel", "DecodeParams", spec.smem_bytes)


@functools.cache
def ctas_per_sm(spec: DecodeSpec, device_id: int) -> int:
    """Resident CTAs per SM of the kernel on a device, as the planner is told (at most 4)."""
    return max(1, min(MAX_CTAS_PER_SM, kernel(spec).occupancy(device_id, THREADS)))


def keeps_hash(cls):
    """Class decorator, above @dataclass(frozen=True): the hash a frozen dataclass computes
    from its fields on every call, computed once per object (a configuration keys every
    run()'s prepared launch, and hashing 13 fields cost 220-310 ns a run)."""
    kept = functools.cached_property(
        lambda self: hash(tuple(getattr(self, f.name) for f in fields(self)))
    )
    kept.__set_name__(cls, "_hash")
    cls._hash = kept
    cls.__hash__ = _kept_hash
    return cls


def _kept_hash(config) -> int:
    return config._hash


@keeps_hash
@dataclass(frozen=True)
class Config:
    """The static part of a plan: what selects the kernel and its scalar arguments."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pos_encoding_mode: str
    window_left: int
    logits_soft_cap: float
    q_dtype: str
    kv_dtype: str
    o_dtype: str
    sm_scale: float
    rope_scale: float
    rope_theta: float

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @functools.cached_property
    def kv_blocks(self) -> int:
        """Second grid dimension: kv heads x query-head sub-groups (one CTA each)."""
        return self.num_kv_heads * -(
            -self.group_size // heads_per_cta(self.group_size, self.head_dim)
        )

    def spec(self, max_smem: int) -> DecodeSpec:
        return decode_spec(
            self.q_dtype, self.kv_dtype, self.o_dtype, self.head_dim, self.group_size,
            self.pos_encoding_mode, self.logits_soft_cap > 0, max_smem,
        )  # fmt: skip

    def fill(self, p) -> None:
        """The configuration's fields of a DecodeParams block."""
        p.num_qo_heads, p.group_size, p.page_size = (
            self.num_qo_heads,
            self.group_size,
            self.page_size,
        )
        p.div_magic, p.div_shift = fast_div(self.page_size)
        p.window_left, p.soft_cap = self.window_left, self.logits_soft_cap

    def freq(self):
        if self.pos_encoding_mode != "ROPE_LLAMA":
            return None
        return rope_frequencies(self.head_dim, self.rope_scale, self.rope_theta)


def make_config(
    num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
    logits_soft_cap, q_dtype, kv_dtype, o_dtype, sm_scale, rope_scale, rope_theta,
    head_dims=HEAD_DIMS,
) -> Config:  # fmt: skip
    """Validate the static arguments of plan() / single decode; errors name what was received
    (head_dims: those the caller's kernels take)."""
    num_qo_heads = as_int("num_qo_heads", num_qo_heads, minimum=1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = as_int("head_dim", head_dim)
    if head_dim not in head_dims:
        raise ValueError(f"head_dim must be one of {head_dims}, got {head_dim}")
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise ValueError(
            f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {pos_encoding_mode!r}"
        )
    window_left = as_int("window_left", window_left, minimum=-1)
    if window_left > INT32_MAX:
        raise ValueError(f"window_left must be -1 or fit in int32, got {window_left}")
    sm_scale, cap, rope_scale, rope_theta = attention_scalars(
        head_dim, sm_scale, logits_soft_cap, rope_scale, rope_theta
    )
    q_dtype = normalize(q_dtype)
    kv_dtype = q_dtype if kv_dtype is None else normalize(kv_dtype)
    o_dtype = q_dtype if o_dtype is None else normalize(o_dtype)
    if q_dtype not in Q_DTYPES:
        raise TypeError(f"q_data_type must be one of {Q_DTYPES}, got {q_dtype}")
    if kv_dtype not in KV_DTYPES or (kv_dtype not in FP8_DTYPES and kv_dtype != q_dtype):
        raise TypeError(
            f"kv_data_type must be q's dtype ({q_dtype}) or one of {FP8_DTYPES}, got {kv_dtype}"
        )
    if o_dtype not in Q_DTYPES:
        raise TypeError(f"o_data_type must be one of {Q_DTYPES}, got {o_dtype}")
    return Config(
        num_qo_heads, num_kv_heads, head_dim, as_int("page_size", page_size, minimum=1),
        pos_encoding_mode, window_left, cap, q_dtype, kv_dtype, o_dtype, sm_scale, rope_scale,
        rope_theta,
    )  # fmt: skip
