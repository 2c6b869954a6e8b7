"""The calls bench_overhead times: one Case per public op, tiny shapes, every framework.

Each maker returns (call, sync) or None when the op has no such form: `call()` issues one op,
`sync()` waits for everything issued. FlashInfer's sampling module takes many minutes to
compile, so its samplers are left out.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

import rtcinfer

Arrays = Callable[[np.random.Generator], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Case:
    name: str
    arrays: Arrays  # host inputs, by name
    op: Callable[..., object]  # op(**device arrays) with rtcinfer
    flashinfer_op: Callable[..., object] | None = None  # op(fi, **torch tensors)
    pytorch_op: Callable[..., object] | None = None  # op(torch, **torch tensors)
    jax_op: Callable[..., object] | None = None  # op(**JAX arrays) where it differs from op
    host_only: bool = False  # plan(): no device arrays, one column
    jax_form: bool = True  # False: no JAX form (a given out= array: JAX arrays are immutable)

    def _torch_arrays(self, torch):
        return {k: _to_torch(torch, v) for k, v in self.arrays(np.random.default_rng(0)).items()}

    def torch(self, torch):
        a = self._torch_arrays(torch)
        return (lambda: self.op(**a)), torch.cuda.synchronize

    def flashinfer(self, fi, torch):
        if self.flashinfer_op is None:
            return None
        a = self._torch_arrays(torch)
        return (lambda: self.flashinfer_op(fi, **a)), torch.cuda.synchronize

    def pytorch(self, torch):
        if self.pytorch_op is None:
            return None
        a = self._torch_arrays(torch)
        return (lambda: self.pytorch_op(torch, **a)), torch.cuda.synchronize

    def cupy(self, cp):
        if self.host_only:
            return None
        a = {k: cp.asarray(_storage(v)) for k, v in self.arrays(np.random.default_rng(0)).items()}
        return (lambda: self.op(**a)), cp.cuda.Device().synchronize

    def jax(self, jax, jitted: bool):
        if self.host_only or not self.jax_form:
            return None
        a = {k: jax.numpy.asarray(v) for k, v in self.arrays(np.random.default_rng(0)).items()}
        op = self.jax_op or self.op
        fn = jax.jit(lambda **kw: op(**kw)) if jitted else (lambda **kw: op(**kw))
        box = [None]

        def call():
            box[0] = fn(**a)

        return call, lambda: jax.block_until_ready(box[0])

    def jax_floor(self, jax):
        """A jitted no-op of the case's JAX arrays: `x + 1` of each (XLA's dispatch cost grows
        with the buffers a computation takes and returns: on the H200 host a jitted `x + 1`
        took 28.8 us, the same of three arrays 41.3)."""
        if self.host_only or not self.jax_form:
            return None
        a = {k: jax.numpy.asarray(v) for k, v in self.arrays(np.random.default_rng(0)).items()}
        fn = jax.jit(lambda **kw: [v + 1 for v in kw.values()])
        box = [None]

        def call():
            box[0] = fn(**a)

        return call, lambda: jax.block_until_ready(box[0])


def _to_torch(torch, v: np.ndarray):
    """A CUDA tensor of a host array (torch.from_numpy takes no ml_dtypes: bf16 and fp8 as their
    bits)."""
    if v.dtype.name in ("bfloat16", "float8_e4m3fn"):
        bits = np.ascontiguousarray(v).view(np.uint16 if v.dtype.itemsize == 2 else np.uint8)
        return torch.from_numpy(bits).view(getattr(torch, v.dtype.name)).cuda()
    return torch.from_numpy(np.ascontiguousarray(v)).cuda()


def _storage(v: np.ndarray) -> np.ndarray:
    """What CuPy takes of a host array: fp8 as its uint8 bytes (CuPy has no fp8 dtype)."""
    return v.view(np.uint8) if v.dtype.name.startswith("float8") else v


def _torch():
    return sys.modules["torch"]


def _bf16(rng, *shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def _probs(rng, *shape):
    p = rng.random(shape).astype(np.float32) ** 8
    return p / p.sum(-1, keepdims=True)


# ---------------------------------------------------------------- decode: one request of 64 tokens

DECODE_TABLE = (np.array([0, 4], np.int32), np.arange(4, dtype=np.int32), np.array([16], np.int32))
DECODE_SHAPE = (32, 8, 128, 16)  # num_qo_heads, num_kv_heads, head_dim, page_size


@functools.cache
def _decode_wrapper():
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    wrapper.plan(*DECODE_TABLE, *DECODE_SHAPE, q_data_type="bfloat16")
    return wrapper


@functools.cache
def _fi_decode_wrapper(fi, torch):
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    dev = [torch.from_numpy(a).cuda() for a in DECODE_TABLE]
    wrapper.plan(*dev, *DECODE_SHAPE, q_data_type=torch.bfloat16)
    return wrapper


def _decode_arrays(rng):
    return {"q": _bf16(rng, 1, 32, 128), "cache": _bf16(rng, 4, 2, 16, 8, 128)}


@functools.cache
def _decode_array_wrapper():
    """The JAX form: a wrapper of fixed capacity whose plan reaches the call as an array
    (run(plan_array=...): launched by XLA itself; on a plain wrapper's plan the call keeps the
    Python handler, which reads the latest plan at every execution)."""
    import jax.numpy as jnp

    wrapper = _graph_decode_wrapper()
    return wrapper, jnp.asarray(wrapper.plan_array())


@functools.cache
def _graph_decode_wrapper():
    """A decode wrapper of fixed capacity planned for DECODE_TABLE."""
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True, paged_kv_indptr_buffer=np.zeros(2, np.int32),
        paged_kv_indices_buffer=np.zeros(4, np.int32))  # fmt: skip
    wrapper.plan(*DECODE_TABLE, *DECODE_SHAPE, q_data_type="bfloat16")
    return wrapper


def _decode_table_arrays(rng):
    """The decode table as device arrays (int32), for the plan built on the device."""
    return dict(zip(("indptr", "indices", "last"), (np.asarray(a, np.int32) for a in DECODE_TABLE),
                    strict=True))  # fmt: skip


def _jax_decode(q, cache):
    wrapper, plan = _decode_array_wrapper()
    return wrapper.run(q, cache, plan_array=plan)


def _fi_plan(fi, torch):
    wrapper = _fi_decode_wrapper(fi, torch)
    host = [torch.from_numpy(a) for a in DECODE_TABLE]
    return lambda: wrapper.plan(*host, *DECODE_SHAPE, q_data_type=torch.bfloat16)


# ---------------------------------------------------------------- prefill: 16 queries over 64 keys

PREFILL_TABLE = (np.array([0, 16], np.int32), np.array([0, 64], np.int32))  # ragged, causal
PREFILL_SHAPE = (32, 8, 128)  # num_qo_heads, num_kv_heads, head_dim


@functools.cache
def _prefill_wrapper():
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(*PREFILL_TABLE, *PREFILL_SHAPE, causal=True, q_data_type="bfloat16")
    return wrapper


@functools.cache
def _prefill_array_wrapper():
    """The JAX form, as for decode: a fixed-capacity wrapper, its plan passed as an array."""
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper(
        use_cuda_graph=True, qo_indptr_buf=np.zeros(2, np.int32),
        kv_indptr_buf=np.zeros(2, np.int32))  # fmt: skip
    wrapper.plan(*PREFILL_TABLE, *PREFILL_SHAPE, causal=True, q_data_type="bfloat16")
    import jax.numpy as jnp

    return wrapper, jnp.asarray(wrapper.plan_array())


def _jax_prefill(q, k, v):
    wrapper, plan = _prefill_array_wrapper()
    return wrapper.run(q, k, v, plan_array=plan)


@functools.cache
def _fi_prefill_wrapper(fi, torch):
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    host = [torch.from_numpy(a) for a in PREFILL_TABLE]
    wrapper.plan(*host, *PREFILL_SHAPE, causal=True, q_data_type=torch.bfloat16)
    return wrapper


def _prefill_arrays(rng):
    return {"q": _bf16(rng, 16, 32, 128), "k": _bf16(rng, 64, 8, 128), "v": _bf16(rng, 64, 8, 128)}


def _fi_prefill_plan(fi, torch):
    wrapper = _fi_prefill_wrapper(fi, torch)
    host = [torch.from_numpy(a) for a in PREFILL_TABLE]
    return lambda: wrapper.plan(*host, *PREFILL_SHAPE, causal=True, q_data_type=torch.bfloat16)


# ---------------------------------------------------------------- the cases


def _norm_arrays(rng):
    return {"x": _bf16(rng, 1, 4096), "w": _bf16(rng, 4096)}


def _rope_arrays(rng):
    return {"q": _bf16(rng, 4, 32, 128), "k": _bf16(rng, 4, 8, 128),
            "pos": np.arange(4, dtype=np.int32) + 100}  # fmt: skip


def _ragged_rope_arrays(rng):
    """One request of 4 tokens at offset 100 (its own array: a slice taken in the timed call
    would time the framework's slicing, which for eager JAX is a dispatch of its own)."""
    q_k = {k: v for k, v in _rope_arrays(rng).items() if k != "pos"}
    return {**q_k, "indptr": np.array([0, 4], np.int32), "offsets": np.array([100], np.int32)}


def _append_arrays(rng):
    return {
        "key": _bf16(rng, 4, 8, 128), "value": _bf16(rng, 4, 8, 128),
        "bi": np.zeros(4, np.int32), "pos": np.arange(4, dtype=np.int32),
        "cache": _bf16(rng, 8, 2, 16, 8, 128), "indices": np.array([3], np.int32),
        "indptr": np.array([0, 1], np.int32), "last": np.array([4], np.int32),
    }  # fmt: skip


def _sampling_arrays(rng):
    return {"probs": _probs(rng, 1, 32000), "logits": rng.standard_normal((1, 32000), np.float32),
            "seed": np.array([[7, 0]], np.uint32)}  # fmt: skip


def _seeded(fn):
    """JAX callers pass the Philox seed as device words (a Python int would be a new constant
    in every call); the other frameworks draw a fresh seed per call, as engines do."""
    return lambda seed, **kw: fn(**kw, seed=seed, offset=seed)


def _unseeded(fn):
    return lambda seed, **kw: fn(**kw)


def _spec_arrays(rng):
    return {"draft": _probs(rng, 1, 4, 32000), "ids": rng.integers(0, 32000, (1, 4), np.int32),
            "target": _probs(rng, 1, 5, 32000), "seed": np.array([[7, 0]], np.uint32)}  # fmt: skip


SAMPLERS = [
    ("sampling_from_probs", lambda probs, logits, **kw: rtcinfer.sampling_from_probs(probs, **kw)),
    ("top_k_sampling_from_probs",
     lambda probs, logits, **kw: rtcinfer.top_k_sampling_from_probs(probs, 50, **kw)),
    ("top_p_sampling_from_probs",
     lambda probs, logits, **kw: rtcinfer.top_p_sampling_from_probs(probs, 0.9, **kw)),
    ("min_p_sampling_from_probs",
     lambda probs, logits, **kw: rtcinfer.min_p_sampling_from_probs(probs, 0.1, **kw)),
    ("top_k_top_p_sampling_from_probs",
     lambda probs, logits, **kw: rtcinfer.top_k_top_p_sampling_from_probs(probs, 50, 0.9, **kw)),
    ("sampling_from_logits",
     lambda probs, logits, **kw: rtcinfer.sampling_from_logits(logits, **kw)),
    ("top_k_top_p_sampling_from_logits",
     lambda probs, logits, **kw: rtcinfer.top_k_top_p_sampling_from_logits(logits, 50, 0.9, **kw)),
]  # fmt: skip

CASES = [
    Case("rmsnorm 1 x 4096", _norm_arrays, lambda x, w: rtcinfer.rmsnorm(x, w),
         lambda fi, x, w: fi.norm.rmsnorm(x, w),
         lambda torch, x, w: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)),
    Case("rmsnorm 1 x 4096, out given",
         lambda rng: {**_norm_arrays(rng), "o": _bf16(rng, 1, 4096)},
         lambda x, w, o: rtcinfer.rmsnorm(x, w, out=o),
         lambda fi, x, w, o: fi.norm.rmsnorm(x, w, out=o), jax_form=False),
    Case("gemma_rmsnorm 1 x 4096", _norm_arrays, lambda x, w: rtcinfer.gemma_rmsnorm(x, w),
         lambda fi, x, w: fi.norm.gemma_rmsnorm(x, w)),
    Case("layernorm 1 x 4096", lambda rng: {**_norm_arrays(rng), "b": _bf16(rng, 4096)},
         lambda x, w, b: rtcinfer.layernorm(x, w, b)),
    Case("fused_add_rmsnorm 1 x 4096",
         lambda rng: {**_norm_arrays(rng), "r": _bf16(rng, 1, 4096)},
         lambda x, w, r: rtcinfer.fused_add_rmsnorm(x, r, w),
         lambda fi, x, w, r: fi.norm.fused_add_rmsnorm(x, r, w)),
    Case("rmsnorm_quant 1 x 4096",
         lambda rng: {**_norm_arrays(rng), "o": np.zeros((1, 4096), ml_dtypes.float8_e4m3fn),
                      "s": np.array([0.05], np.float32)},
         lambda x, w, o, s: rtcinfer.rmsnorm_quant(o, x, w, s, out_dtype="float8_e4m3fn"),
         lambda fi, x, w, o, s: fi.norm.rmsnorm_quant(o, x, w, s)),
    Case("fused_add_rmsnorm_quant 1 x 4096",
         lambda rng: {**_norm_arrays(rng), "r": _bf16(rng, 1, 4096),
                      "o": np.zeros((1, 4096), ml_dtypes.float8_e4m3fn),
                      "s": np.array([0.05], np.float32)},
         lambda x, w, r, o, s: rtcinfer.fused_add_rmsnorm_quant(o, x, r, w, s,
                                                                out_dtype="float8_e4m3fn"),
         lambda fi, x, w, r, o, s: fi.norm.fused_add_rmsnorm_quant(o, x, r, w, s)),
    Case("silu_and_mul 1 x 8192", lambda rng: {"x": _bf16(rng, 1, 16384)},
         lambda x: rtcinfer.silu_and_mul(x), lambda fi, x: fi.activation.silu_and_mul(x),
         lambda torch, x: torch.nn.functional.silu(x[..., :8192]) * x[..., 8192:]),
    Case("silu_and_mul 1 x 8192, out given",
         lambda rng: {"x": _bf16(rng, 1, 16384), "o": _bf16(rng, 1, 8192)},
         lambda x, o: rtcinfer.silu_and_mul(x, out=o),
         lambda fi, x, o: fi.activation.silu_and_mul(x, out=o), jax_form=False),
    Case("gelu_tanh_and_mul 1 x 8192", lambda rng: {"x": _bf16(rng, 1, 16384)},
         lambda x: rtcinfer.gelu_tanh_and_mul(x),
         lambda fi, x: fi.activation.gelu_tanh_and_mul(x)),
    Case("apply_rope_pos_ids_inplace 4 tokens", _rope_arrays,
         lambda q, k, pos: rtcinfer.apply_rope_pos_ids_inplace(q, k, pos),
         lambda fi, q, k, pos: fi.rope.apply_rope_pos_ids_inplace(q, k, pos)),
    Case("apply_llama31_rope_pos_ids_inplace 4 tokens", _rope_arrays,
         lambda q, k, pos: rtcinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos),
         lambda fi, q, k, pos: fi.rope.apply_llama31_rope_pos_ids_inplace(q, k, pos)),
    Case("apply_rope_inplace 4 tokens (ragged)", _ragged_rope_arrays,
         lambda q, k, indptr, offsets: rtcinfer.apply_rope_inplace(q, k, indptr, offsets),
         lambda fi, q, k, indptr, offsets: fi.rope.apply_rope_inplace(q, k, indptr, offsets)),
    Case("merge_state 1 x 32 x 128",
         lambda rng: {"va": _bf16(rng, 1, 32, 128), "sa": np.zeros((1, 32), np.float32),
                      "vb": _bf16(rng, 1, 32, 128), "sb": np.ones((1, 32), np.float32)},
         lambda va, sa, vb, sb: rtcinfer.merge_state(va, sa, vb, sb),
         lambda fi, va, sa, vb, sb: fi.merge_state(va, sa, vb, sb)),
    Case("merge_states 1 x 4 x 32 x 128",
         lambda rng: {"v": _bf16(rng, 1, 4, 32, 128), "s": np.zeros((1, 4, 32), np.float32)},
         lambda v, s: rtcinfer.merge_states(v, s), lambda fi, v, s: fi.merge_states(v, s)),
    Case("append_paged_kv_cache 4 tokens", _append_arrays,
         lambda key, value, bi, pos, cache, indices, indptr, last:
         rtcinfer.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last),
         lambda fi, key, value, bi, pos, cache, indices, indptr, last:
         fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)),
    Case("decode run() 1 x 64 tokens", _decode_arrays,
         lambda q, cache: _decode_wrapper().run(q, cache),
         lambda fi, q, cache: _fi_decode_wrapper(fi, _torch()).run(q, cache),
         jax_op=_jax_decode),
    Case("decode plan() 1 x 64 tokens (host)", lambda rng: {},
         lambda: _decode_wrapper().plan(*DECODE_TABLE, *DECODE_SHAPE, q_data_type="bfloat16"),
         lambda fi: _fi_plan(fi, _torch())(), host_only=True),
    Case("decode device_plan_array() 1 x 64 tokens", _decode_table_arrays,
         lambda indptr, indices, last: _graph_decode_wrapper().device_plan_array(
             indptr, indices, last, 4)),
    Case("prefill run() 16 x 64 tokens (ragged)", _prefill_arrays,
         lambda q, k, v: _prefill_wrapper().run(q, k, v),
         lambda fi, q, k, v: _fi_prefill_wrapper(fi, _torch()).run(q, k, v),
         jax_op=_jax_prefill),
    Case("prefill plan() 16 x 64 tokens (host)", lambda rng: {},
         lambda: _prefill_wrapper().plan(*PREFILL_TABLE, *PREFILL_SHAPE, causal=True,
                                         q_data_type="bfloat16"),
         lambda fi: _fi_prefill_plan(fi, _torch())(), host_only=True),
    Case("single_decode_with_kv_cache 64 tokens",
         lambda rng: {"q": _bf16(rng, 32, 128), "k": _bf16(rng, 64, 8, 128),
                      "v": _bf16(rng, 64, 8, 128)},
         lambda q, k, v: rtcinfer.single_decode_with_kv_cache(q, k, v),
         lambda fi, q, k, v: fi.single_decode_with_kv_cache(q, k, v)),
    Case("softmax 1 x 32000", _sampling_arrays,
         lambda probs, logits, seed: rtcinfer.softmax(logits),
         pytorch_op=lambda torch, probs, logits, seed: torch.softmax(logits, -1)),
    Case("top_k_renorm_probs 1 x 32000", _sampling_arrays,
         lambda probs, logits, seed: rtcinfer.top_k_renorm_probs(probs, 50)),
    Case("top_p_renorm_probs 1 x 32000", _sampling_arrays,
         lambda probs, logits, seed: rtcinfer.top_p_renorm_probs(probs, 0.9)),
    Case("top_k_mask_logits 1 x 32000", _sampling_arrays,
         lambda probs, logits, seed: rtcinfer.top_k_mask_logits(logits, 50)),
    *[Case(f"{name} 1 x 32000", _sampling_arrays, _unseeded(fn), jax_op=_seeded(fn),
           pytorch_op=(lambda torch, probs, logits, seed:
                       torch.multinomial(torch.softmax(logits, -1), 1))
           if name == "sampling_from_logits" else None)
      for name, fn in SAMPLERS],
    Case("chain_speculative_sampling 1 x 4 x 32000", _spec_arrays,
         lambda draft, ids, target, seed: rtcinfer.chain_speculative_sampling(draft, ids, target),
         jax_op=lambda draft, ids, target, seed: rtcinfer.chain_speculative_sampling(
             draft, ids, target, seed=seed, offset=seed)),
]  # fmt: skip
