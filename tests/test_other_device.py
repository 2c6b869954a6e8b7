"""Calls whose arrays live on another GPU than the current one (GPU): an op of every family with
its arrays on the last GPU while the first is current, for PyTorch, CuPy and JAX, against
float64 NumPy (a wrapper made on that GPU, one per device); and one call's arrays on two GPUs,
or a run() on another GPU than its wrapper's, refused by name. On a machine with one GPU the
first GPU is the last: the calls run on it, and the refusals need two."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests import reference_attention as aref
from tests import reference_sampling as sref
from tests.checks import assert_close, to_host
from tests.gpu import randn
from tests.paged_batch import page_table_for

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 8, 2, 128, 16
FRAMEWORKS = ("cupy", "torch", "jax")


class Framework:
    """Arrays of one framework on GPU d (put), and a context in which GPU d is current."""

    def __init__(self, name: str):
        import cupy

        self.name, self.cupy = name, cupy
        if name == "torch":
            self.torch = pytest.importorskip("torch")
        if name == "jax":
            self.jax = pytest.importorskip("jax")
            if self.jax.default_backend() != "gpu":
                pytest.skip("JAX has no GPU backend here")
        self.count = cupy.cuda.runtime.getDeviceCount()

    def put(self, x: np.ndarray, d: int):
        if self.name == "cupy":
            with self.cupy.cuda.Device(d):
                return self.cupy.asarray(x)
        if self.name == "torch":
            return self.torch.as_tensor(x).to(f"cuda:{d}")
        return self.jax.device_put(x, self.jax.devices("gpu")[d])

    def current(self, d: int):
        """GPU d current for the framework and for the CUDA runtime."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.cupy.cuda.Device(d))
        if self.name == "torch":
            stack.enter_context(self.torch.cuda.device(d))
        if self.name == "jax":
            stack.enter_context(self.jax.default_device(self.jax.devices("gpu")[d]))
        return stack


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return Framework(request.param)


def test_every_family_runs_on_the_arrays_gpu_while_another_is_current(fw):
    rng = np.random.default_rng(5)
    d = fw.count - 1  # the arrays' GPU; GPU 0 is current during the calls
    f16 = "float16"
    x, w = randn(rng, (4, 256), f16), randn(rng, (256,), f16)
    g = randn(rng, (4, 512), f16)
    q, k = randn(rng, (3, HQ, D), f16), randn(rng, (3, HKV, D), f16)
    pos = np.array([0, 7, 300], np.int32)
    logits = randn(rng, (2, 1000), "float32", 3.0)
    v_a, v_b = randn(rng, (3, HQ, D), f16), randn(rng, (3, HQ, D), f16)
    s_a, s_b = randn(rng, (3, HQ), "float32"), randn(rng, (3, HQ), "float32")
    with fw.current(0):
        assert_close(rtcinfer.rmsnorm(fw.put(x, d), fw.put(w, d)), ref.rmsnorm_ref(x, w), f16)
        assert_close(rtcinfer.silu_and_mul(fw.put(g, d)), ref.silu_and_mul_ref(g), f16)
        q2, k2 = rtcinfer.apply_rope_pos_ids(fw.put(q, d), fw.put(k, d), fw.put(pos, d))
        inv = ref.rope_inv_freq(D)
        assert_close(q2, ref.rope_ref(q, pos, D, False, inv), f16, "q")
        assert_close(k2, ref.rope_ref(k, pos, D, False, inv), f16, "k")
        probs = rtcinfer.softmax(fw.put(logits, d))
        assert_close(probs, sref.softmax_ref(logits), "float32", "softmax")
        tokens = rtcinfer.top_k_sampling_from_probs(probs, 1, seed=1)
        np.testing.assert_array_equal(to_host(tokens), logits.argmax(-1))
        v, s = rtcinfer.merge_state(*(fw.put(a, d) for a in (v_a, s_a, v_b, s_b)))
        v_ref, s_ref = aref.merge_state_ref(v_a, s_a, v_b, s_b)
        assert_close(v, v_ref, f16, "v")
        assert_close(s, s_ref, "float32", "s")
        keys = randn(rng, (40, HKV, D), f16), randn(rng, (40, HKV, D), f16)
        o = rtcinfer.single_decode_with_kv_cache(fw.put(q[0], d), *(fw.put(a, d) for a in keys))
        assert_close(o, aref.single_decode_ref(q[0], *keys), f16, "single decode")


def test_a_wrapper_made_on_the_arrays_gpu_appends_and_decodes_there(fw):
    """The paged cache's append and a batch decode wrapper made on GPU d (its workspace and
    plan there), called while GPU 0 is current."""
    rng = np.random.default_rng(6)
    d = fw.count - 1
    lengths = [37, 5, 20]
    indptr, indices, last, _ = page_table_for(lengths, PAGE, rng)
    pages = int(indices.max()) + 1
    cache = randn(rng, (pages, 2, PAGE, HKV, D), "float16")
    q = randn(rng, (3, HQ, D), "float16")
    k, v = randn(rng, (3, HKV, D), "float16"), randn(rng, (3, HKV, D), "float16")
    pos = np.array(lengths, np.int32) - 1
    bidx = np.arange(3, dtype=np.int32)
    with fw.current(d):
        decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    with fw.current(0):
        decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type="float16")
        tables = [fw.put(a.astype(np.int32), d) for a in (indices, indptr, last)]
        c = fw.put(cache, d)
        appended = rtcinfer.append_paged_kv_cache(
            fw.put(k, d), fw.put(v, d), fw.put(bidx, d), fw.put(pos, d), c, *tables
        )
        c = c if appended is None else appended  # JAX returns the updated cache
        o = decode.run(fw.put(q, d), c)
    want_cache = aref.append_paged_kv_cache_ref(k, v, bidx, pos, cache, indices, indptr, last)
    np.testing.assert_array_equal(to_host(c), want_cache.astype(np.float64))
    assert_close(o, aref.batch_decode_paged_ref(q, want_cache, indptr, indices, last), "float16")


def test_arrays_on_two_gpus_and_a_wrapper_on_another_are_refused(fw):
    if fw.count < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(7)
    x, w = randn(rng, (4, 256), "float16"), randn(rng, (256,), "float16")
    with pytest.raises((ValueError, RuntimeError), match="different devices|incompatible devices"):
        rtcinfer.rmsnorm(fw.put(x, 1), fw.put(w, 0))  # JAX refuses them itself
    with fw.current(0):
        decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
        decode.plan([0, 1], [0], [5], HQ, HKV, D, PAGE, q_data_type="float16")
    q = fw.put(randn(rng, (1, HQ, D), "float16"), 1)
    cache = fw.put(randn(rng, (1, 2, PAGE, HKV, D), "float16"), 1)
    with pytest.raises((ValueError, RuntimeError), match="arrays are on device 1, this wrapper"):
        decode.run(q, cache)  # (JAX may carry the error out of XLA as a RuntimeError)
