"""What rtcinfer ships: named model shapes, the kernel specs a serving loop of each one runs
(for `warmup`), and one spec per code path of every family (compiled for sm_80 and sm_90a in
CI; the cluster sampler, which needs sm_90, for sm_90a only)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from . import activation, bitpack, move, norm, rope, rope_quantize
from .attention import cascade, decode_device_plan, decode_kernel, page, prefill_kernel
from .attention.prefill_items import PrefillItemsSpec
from .sampling.cluster import ClusterSampleSpec, cluster_choices
from .sampling.renorm import RenormSpec
from .sampling.renorm import specs_for as renorm_specs
from .sampling.samplers import SampleSpec
from .sampling.samplers import specs_for as sampler_specs
from .sampling.softmax import cluster_choices as softmax_clusters
from .sampling.softmax import cluster_softmax_spec, softmax_spec
from .sampling.softmax import specs_for as softmax_specs
from .sampling.speculative import SpeculativeSpec


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False
    # MLA (DeepSeek's latent attention): the latent (ckv) and RoPE (kpe) dims of its cache and
    # q's low rank; its prefill attends with q and k of head_dim + rope_dim dims over v of
    # head_dim (num_kv_heads = num_qo_heads), its decode in the absorbed form over the cache
    kv_lora_rank: int = 0
    rope_dim: int = 0
    q_lora_rank: int = 0


MODELS = {
    "llama3-8b": ModelShape(4096, 14336, 32, 8, 128, 128256),
    "llama3-70b": ModelShape(8192, 28672, 64, 8, 128, 128256),
    "qwen3-32b": ModelShape(5120, 25600, 64, 8, 128, 151936, qk_norm=True),
    "deepseek-v3": ModelShape(
        7168, 18432, 128, 128, 128, 129280, kv_lora_rank=512, rope_dim=64, q_lora_rank=1536
    ),  # fmt: skip
}

# Opt-in shared memory per block (KB) by compute capability, which decode and prefill size their
# pipelines by and the cluster sampler needs: warmup's assumption for a GPU it cannot ask.
OPTIN_SMEM_KB = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99, 121: 99}


@dataclass(frozen=True)
class Target:
    """What a step's kernels depend on besides the model: the compile target and the GPU's
    opt-in shared memory per block (bytes)."""

    arch: str
    max_smem: int

    @property
    def compute_capability(self) -> int:
        return int(re.fullmatch(r"sm_(\d+)a?", self.arch)[1])


def target(arch: str, max_smem: int | None = None) -> Target:
    """The target `arch` with max_smem (the GPU's, when known), else OPTIN_SMEM_KB's value for
    it (99 KB, the least of them, for an arch not in it)."""
    if max_smem is None:
        cc = Target(arch, 0).compute_capability
        max_smem = OPTIN_SMEM_KB.get(cc, min(OPTIN_SMEM_KB.values())) * 1024
    return Target(arch, max_smem)


def model_specs(name: str, dtype: str = "bfloat16", kv_dtype: str | None = None,
                on: Target | None = None) -> list:  # fmt: skip
    """Every kernel spec a serving loop of the named model launches: a decode step (norms,
    RoPE in every position form, the activation, the KV append, batch decode, merges, softmax,
    every sampler and renorm at the model's vocabulary, each at every block and cluster size a
    batch may get) and a prefill step (causal prefill in every query tile). Activations and
    logits in `dtype`, the paged KV cache in kv_dtype (None: dtype; or an fp8 type), for the
    target `on` (default: sm_90a with 227 KB of shared memory per block)."""
    try:
        m = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
    kv_dtype = kv_dtype or dtype
    on = on or target("sm_90a")
    if m.kv_lora_rank:
        specs = _mla_specs(name, m, dtype, kv_dtype, on)
    else:
        specs = _attention_specs(m, dtype, kv_dtype, on)
    logits = tuple(dict.fromkeys(("float32", dtype)))
    specs += softmax_specs(m.vocab, logits, softmax_clusters(m.vocab, on.compute_capability))
    clusters = cluster_choices(m.vocab, 4, on.compute_capability, on.max_smem)  # float32 probs
    specs += sampler_specs(m.vocab, clusters)
    specs += renorm_specs(m.vocab, logits)
    return list(dict.fromkeys(specs))


def _attention_specs(m: ModelShape, dtype: str, kv_dtype: str, on: Target) -> list:
    """model_specs' layer and attention kernels of a model of GQA (or MHA) attention."""
    attention = (m.num_qo_heads, m.num_kv_heads, m.head_dim, dtype, kv_dtype, on.max_smem)
    specs = norm.specs_for(m.hidden, (dtype,))
    if m.qk_norm:
        specs.append(norm.norm_spec("rmsnorm", dtype, dtype, m.head_dim))
    specs += activation.specs_for(m.intermediate, (dtype,))
    specs += rope.specs_for(m.head_dim, (dtype,))
    specs += page.specs_for(m.head_dim, kv_dtype)
    specs += decode_kernel.specs_for(*attention) + [decode_device_plan.SPEC]
    specs += prefill_kernel.specs_for(*attention, on.arch) + [PrefillItemsSpec()]
    return specs + cascade.specs_for(m.head_dim, dtype)


def _mla_specs(name: str, m: ModelShape, dtype: str, kv_dtype: str, on: Target) -> list:
    """model_specs' layer and attention kernels of an MLA model: the norms (the hidden size
    and the two low ranks), RoPE over rope_dim, the activation, the latent cache's append (ckv
    and kpe rows), MLA over the cache (decode in 16-row tiles up to 16 heads, 32-row ones
    beyond; a causal chunk of several queries in 32-row tiles), and the prefill
    of head_dim + rope_dim q and k over head_dim v in every query tile (ragged, causal), with
    the merges of its outputs."""
    if kv_dtype != dtype:
        raise ValueError(f"{name}: MLA's latent cache is of q's dtype ({dtype}), got {kv_dtype}")
    specs = norm.specs_for(m.hidden, (dtype,))
    specs += [norm.norm_spec("rmsnorm", dtype, dtype, n) for n in (m.q_lora_rank, m.kv_lora_rank)]
    specs += activation.specs_for(m.intermediate, (dtype,))
    specs += rope.specs_for(m.rope_dim, (dtype,))
    specs += page.specs_for(m.kv_lora_rank, dtype, m.rope_dim)
    specs += [prefill_kernel.mla_spec(dtype, dtype, rows, causal, on.max_smem)
              for rows, causal in ((16, False), (32, False), (32, True))]  # fmt: skip
    qk, v = m.head_dim + m.rope_dim, m.head_dim
    spec = prefill_kernel.prefill_spec
    for rows in prefill_kernel.TILE_ROWS:
        wgmma = prefill_kernel.use_wgmma(on.arch, rows, "NONE", dtype, dtype)
        specs.append(spec(dtype, dtype, qk, rows, True, max_smem=on.max_smem, ragged=True,
                          wgmma=wgmma, head_dim_vo=v))  # fmt: skip
    return specs + [PrefillItemsSpec()] + cascade.specs_for(v, dtype)


def shipped_specs() -> list:
    """At least one spec for every compile-time branch of every kernel."""
    specs = []
    for dtype in ("float16", "bfloat16", "float32"):
        specs += [norm.norm_spec(op, dtype, dtype, 4096) for op in norm.OPS
                  if not op.endswith("_quant")]  # fmt: skip
        specs += [norm.norm_spec(op, dtype, dtype, 4096, out_dtype=fp8)
                  for op, fp8 in (("rmsnorm_quant", "float8_e4m3fn"),
                                  ("fused_add_rmsnorm_quant", "float8_e5m2"),
                                  ("layernorm_quant", "float8_e4m3fn"))]  # fmt: skip
        specs += [norm.norm_spec("rmsnorm", dtype, "float32", 1001)]  # scalar path
        specs += [activation.ActivationSpec(a, dtype, 16 // (2 if dtype != "float32" else 4))
                  for a in activation.ACTIVATIONS]  # fmt: skip
    specs += [norm.norm_spec("rmsnorm", "bfloat16", "bfloat16", 65536)]  # the widest row
    for op, wdtype, load_vec in (("fused_add_rmsnorm", "bfloat16", 1), ("layernorm", "float32", 2)):
        specs.append(replace(norm.norm_spec(op, "bfloat16", wdtype, 4096), load_vec=load_vec))
    for dtype in ("bfloat16", "float32"):
        for mode in rope.MODES:
            for interleave in (False, True):
                for inplace in (False, True):
                    pos_from = "indptr" if mode == "theta" and not inplace else "pos_ids"
                    vec = rope.rope_vec(dtype, 128, 64, interleave)
                    specs.append(
                        rope.RopeSpec(
                            dtype, "int64", 128, 64, interleave, mode, pos_from, inplace, vec
                        )  # fmt: skip
                    )
    specs += rope_quantize_specs()
    specs += decode_specs() + [decode_device_plan.SPEC]
    specs += prefill_specs() + [PrefillItemsSpec()]
    specs += [cascade.MergeSpec(d, 16 // (4 if d == "float32" else 2), has_b, mask, sink)
              for d, has_b, mask, sink in [("bfloat16", True, False, False),
                                           ("float16", True, True, False),
                                           ("float32", False, False, False),
                                           ("bfloat16", False, False, True)]]  # fmt: skip
    specs += [page.PageSpec(256, 16), page.PageSpec(64, 4), page.PageSpec(256, 16, "int64")]
    specs += list(page.INDEX_SPECS.values())
    specs += sampling_specs()
    specs += [bitpack.PackbitsSpec(True, "int32"), bitpack.PackbitsSpec(False, "int64")]
    specs.append(move.MoveSpec())
    return list(dict.fromkeys(specs))


def rope_quantize_specs() -> list:
    """RoPE with fp8 outputs: neox and interleaved, with and without the rest of the dims,
    e4m3 and e5m2, int64 positions; appended to a GQA cache (v) and to MLA's (no v), int64
    tables."""
    spec = rope_quantize.RopeQuantSpec
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    return [
        spec("bfloat16", e4m3, "int32", 64, 512, 8, False),
        spec("float16", e5m2, "int64", 128, 0, 8, True),
        spec("bfloat16", e4m3, "int64", 64, 64, 4, True, True, True, "int32", "int64"),
        spec("float16", e5m2, "int32", 64, 512, 8, False, True, False, "int64", "int32"),
        spec("bfloat16", e4m3, "int32", 2, 0, 1, False),  # one pair: scalar units
    ]


def decode_specs() -> list:
    """Every compile-time branch of the decode kernel once: q fp16/bf16, KV 16-bit/e4m3/e5m2,
    head_dim 64/128/256, one or two head tiles, NONE/ROPE_LLAMA/ALIBI, soft cap, 2-4 token
    groups per warp, the 2-stage pipeline (small shared memory), one tile in flight and the
    half-tile fp8 kernels plan() picks for whole-request plans."""
    spec = decode_kernel.decode_spec
    return [
        spec("bfloat16", "bfloat16", "bfloat16", 128, 4),
        spec("float16", "float16", "float16", 64, 16, "ROPE_LLAMA"),
        spec("bfloat16", "bfloat16", "float16", 256, 12, "ALIBI", True),
        spec("bfloat16", "bfloat16", "bfloat16", 256, 1, max_smem=163 * 1024),
        spec("bfloat16", "float8_e4m3fn", "bfloat16", 128, 8),
        spec("float16", "float8_e5m2", "float16", 256, 16, "ROPE_LLAMA", True),
        spec("bfloat16", "float8_e4m3fn", "bfloat16", 64, 5, "ALIBI"),
        replace(spec("bfloat16", "bfloat16", "bfloat16", 128, 4), lookahead=1),
        decode_kernel.half_tiles(spec("bfloat16", "float8_e4m3fn", "bfloat16", 128, 8)),
        decode_kernel.half_tiles(spec("bfloat16", "float8_e5m2", "bfloat16", 64, 4)),
    ]


def prefill_specs() -> list:
    """Every compile-time branch of the prefill kernel once: q fp16/bf16 with o of the other,
    head_dim 64/128/256, query tiles of 8 and 16 (four warps on the keys), 64 and 128 rows, causal,
    custom mask or neither, RoPE or ALiBi, soft cap, fp8 KV, the 2-stage ring (small shared
    memory), ragged K/V, 16- and 32-row warps (32 is plan()'s choice at head_dim 128), the
    warpgroup-MMA kernel of sm_90a (compiled for that target only: its min_sm), v of fewer
    dims than q and k (head_dim_vo), and MLA."""
    spec = prefill_kernel.prefill_spec
    return [
        spec("bfloat16", "bfloat16", 128, 128, True, warp_rows=16),
        spec("float16", "float16", 128, 64, False, "ALIBI", True),
        spec("bfloat16", "float16", 64, 128, False),
        spec("float16", "float16", 256, 64, True, "NONE", True),
        spec("bfloat16", "bfloat16", 128, 128, False, max_smem=100 * 1024, warp_rows=16),
        spec("float16", "float16", 128, 64, False, "NONE", True, custom_mask=True),
        spec("bfloat16", "bfloat16", 128, 128, True, "ROPE_LLAMA", warp_rows=16),
        spec("float16", "float16", 256, 64, False, "ROPE_LLAMA", True),
        spec("bfloat16", "bfloat16", 64, 64, True, "ROPE_LLAMA", custom_mask=False),
        spec("bfloat16", "bfloat16", 128, 128, True, kv_dtype="float8_e4m3fn", warp_rows=16),
        spec("float16", "float16", 64, 64, False, "ROPE_LLAMA", True, kv_dtype="float8_e5m2"),
        spec("float16", "bfloat16", 256, 64, True, "ALIBI", kv_dtype="float8_e4m3fn"),
        spec("bfloat16", "bfloat16", 128, 16, True),
        spec("float16", "float16", 256, 16, False, "ROPE_LLAMA", True),
        spec("bfloat16", "bfloat16", 64, 16, True, kv_dtype="float8_e4m3fn"),
        spec("bfloat16", "bfloat16", 128, 128, True, ragged=True, warp_rows=16),
        spec("float16", "float16", 64, 64, False, "ALIBI", True, ragged=True),
        spec("float16", "bfloat16", 256, 16, True, ragged=True),
        spec("bfloat16", "bfloat16", 128, 128, True, ragged=True, warp_rows=32),
        spec("float16", "float16", 128, 128, False, "ROPE_LLAMA", True, warp_rows=32),
        spec("bfloat16", "bfloat16", 128, 128, True, kv_dtype="float8_e4m3fn", warp_rows=32),
        # warpgroup MMAs (sm_90a): head_dim 64/128/256, 64- and 128-row tiles, every mask
        spec("bfloat16", "bfloat16", 128, 128, True, ragged=True, wgmma=True),
        spec("float16", "float16", 128, 64, False, "ALIBI", True, wgmma=True),
        spec("bfloat16", "float16", 64, 128, False, custom_mask=True, wgmma=True),
        spec("float16", "float16", 256, 128, True, "NONE", True, ragged=True, wgmma=True),
        spec("bfloat16", "bfloat16", 128, 128, False, max_smem=100 * 1024, wgmma=True),
        # paged 128-row tiles, registers capped for two CTAs a SM
        spec("bfloat16", "bfloat16", 128, 128, True, wgmma=True),
        spec("float16", "float16", 128, 128, True, "NONE", True, wgmma=True),
        # v of fewer dims than q and k (192 / 128): 24-chunk K rows, both kernels
        spec("bfloat16", "bfloat16", 192, 128, True, ragged=True, head_dim_vo=128),
        spec(
            "float16", "float16", 192, 64, False, "ALIBI", True, custom_mask=True, head_dim_vo=128
        ),
        spec("bfloat16", "float16", 192, 16, True, head_dim_vo=128),
        spec("bfloat16", "bfloat16", 192, 128, True, ragged=True, wgmma=True, head_dim_vo=128),
        # 8-row tiles (keys on the MMAs' M side): fp8 read from the ring, widened (RoPE), a
        # custom mask, ALiBi with a soft cap, ragged, head_dim 64 / 256, v of fewer dims
        spec("bfloat16", "bfloat16", 128, 8, False),
        spec("float16", "bfloat16", 128, 8, True, kv_dtype="float8_e4m3fn"),
        spec("bfloat16", "bfloat16", 64, 8, False, "ROPE_LLAMA", kv_dtype="float8_e5m2"),
        spec("float16", "float16", 128, 8, False, "ALIBI", True, custom_mask=True),
        spec("bfloat16", "float16", 256, 8, True, ragged=True),
        spec("float16", "float16", 192, 8, True, head_dim_vo=128),
        spec("float16", "float16", 192, 64, False, custom_mask=True, wgmma=True, head_dim_vo=128),
        # MLA (attention/mla.py): K of ckv + kpe, V its ckv part, four warps a row warp; 16- and
        # 32-row tiles, 64- and 32-key K tiles (sm_90's and sm_80's shared memory)
        prefill_kernel.mla_spec("bfloat16", "bfloat16", 16, True),
        prefill_kernel.mla_spec("float16", "bfloat16", 16, max_smem=163 * 1024),
        prefill_kernel.mla_spec("bfloat16", "bfloat16", 32),
        prefill_kernel.mla_spec("float16", "float16", 32, True, max_smem=163 * 1024),
    ]


def sampling_specs() -> list:
    """Each sampler and threshold op once at the common shape (fp32 rows, 1024 threads), and
    every dtype, vector width, token dtype and the single-warp block at least once."""
    specs = [SampleSpec(op, "float32", "int32", 4, 1024) for op in
             ("plain", "top_k", "top_p", "min_p", "top_k_top_p", "top_k_first")]  # fmt: skip
    specs += [
        SampleSpec("top_p", "bfloat16", "int64", 8, 256),
        SampleSpec("min_p", "float16", "int32", 2, 512),
        SampleSpec("top_k_first", "bfloat16", "int32", 1, 32),
    ]
    specs += [ClusterSampleSpec(op, "float32", "int32", 4, 8) for op in
              ("plain", "top_k", "top_p", "min_p", "top_k_top_p", "top_k_first")]  # fmt: skip
    specs += [
        ClusterSampleSpec("top_k_top_p", "float16", "int64", 8, 4),
        ClusterSampleSpec("top_p", "bfloat16", "int32", 1, 2),
    ]
    specs += [RenormSpec(op, "float32", 4, 1024) for op in
              ("top_k_renorm", "top_p_renorm", "top_k_mask")]  # fmt: skip
    specs += [RenormSpec("top_k_mask", "bfloat16", 8, 256)]
    specs += [RenormSpec("top_p_renorm", "float16", 1, 32)]
    specs += [
        RenormSpec("top_k_select", "bfloat16", 8, 1024),
        RenormSpec("top_k_select", "float32", 1, 64),
    ]
    specs += [softmax_spec("float32", 128256), softmax_spec("bfloat16", 111)]
    specs += [cluster_softmax_spec("float32", 32000, 8),
              cluster_softmax_spec("bfloat16", 151936, 2),
              cluster_softmax_spec("float16", 4098, 2)]  # fmt: skip
    specs += [SpeculativeSpec("float32", 4, 1024), SpeculativeSpec("float16", 1, 32)]
    return specs
