"""PyTorch, JAX and CuPy round trips, streams and CUDA graphs (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_close, to_host
from tests.gpu import randn, upload

pytestmark = pytest.mark.gpu


def test_cupy_in_cupy_out_zero_copy(rng):
    import cupy

    x, w = randn(rng, (8, 256), "bfloat16"), randn(rng, (256,), "bfloat16")
    out = cupy.empty((8, 256), dtype=x.dtype)
    y = rtcinfer.rmsnorm(upload(x), upload(w), out=out)
    assert y is out
    assert_close(y, ref.rmsnorm_ref(x, w), "bfloat16")


def test_torch_round_trip_on_current_stream(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x2 = x * 2  # produced on the side stream: our kernel must run after it, on it
        y = rtcinfer.rmsnorm(x2, w)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.device == x.device
    stream.synchronize()
    expect = ref.rmsnorm_ref(to_host(x2), to_host(w))
    assert_close(y, expect, "bfloat16")


def test_torch_in_place_and_views(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(16, 2048, device="cuda", dtype=torch.float16)
    r = torch.randn(16, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, device="cuda", dtype=torch.float16)
    xh, rh, wh = to_host(x), to_host(r), to_host(w)
    out, res = rtcinfer.fused_add_rmsnorm(x, r, w)
    assert out is x and res is r
    expect, expect_res = ref.fused_add_rmsnorm_ref(xh, rh, wh, dtype="float16")
    assert_close(x, expect, "float16")
    np.testing.assert_array_equal(to_host(r), expect_res)
    g = torch.randn(4, 2 * 512, device="cuda", dtype=torch.bfloat16)
    y = rtcinfer.silu_and_mul(g[:, :])
    assert isinstance(y, torch.Tensor) and y.shape == (4, 512)
    assert_close(y, ref.silu_and_mul_ref(to_host(g)), "bfloat16")


def test_torch_rope_inplace_llama31():
    torch = pytest.importorskip("torch")
    q = torch.randn(33, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(33, 2, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(33, device="cuda", dtype=torch.int64) * 1000
    qh, kh = to_host(q), to_host(k)
    q2, k2 = rtcinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos)
    assert q2 is q and k2 is k
    inv = ref.llama31_inv_freq(128)
    assert_close(q, ref.rope_ref(qh, to_host(pos), 128, False, inv), "bfloat16")
    assert_close(k, ref.rope_ref(kh, to_host(pos), 128, False, inv), "bfloat16")


def test_torch_errors():
    torch = pytest.importorskip("torch")
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="input: expected a CUDA tensor, got a torch.Tensor on cpu"):
        rtcinfer.rmsnorm(torch.randn(2, 64, dtype=torch.bfloat16), w)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="different devices"):
            rtcinfer.rmsnorm(torch.randn(2, 64, device="cuda:1", dtype=torch.bfloat16), w)


def test_jax_eager_and_jit(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    x, w = randn(rng, (32, 4096), "bfloat16"), randn(rng, (4096,), "bfloat16")
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    y = rtcinfer.rmsnorm(xj, wj)
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16
    assert_close(np.asarray(y), ref.rmsnorm_ref(x, w), "bfloat16")

    @jax.jit
    def block(x, r, w, g, q, k, pos):
        h, r = rtcinfer.fused_add_rmsnorm(x * 1, r, w)
        a = rtcinfer.silu_and_mul(g)
        q, k = rtcinfer.apply_rope_pos_ids(q, k, pos)
        return h, r, a, q, k

    r = randn(rng, (32, 4096), "bfloat16", 10.0)
    g = randn(rng, (32, 2 * 1024), "bfloat16")
    q, k = randn(rng, (32, 8, 128), "bfloat16"), randn(rng, (32, 2, 128), "bfloat16")
    pos = np.arange(32, dtype=np.int32) * 37
    for _ in range(3):  # replays of the compiled (graph-captured) program
        h, r2, a, q2, k2 = block(xj, jnp.asarray(r), wj, jnp.asarray(g), jnp.asarray(q),
                                 jnp.asarray(k), jnp.asarray(pos))  # fmt: skip
    expect_h, expect_r = ref.fused_add_rmsnorm_ref(x, r, w, dtype="bfloat16")
    assert_close(np.asarray(h), expect_h, "bfloat16")
    np.testing.assert_array_equal(np.asarray(r2).astype(np.float64), expect_r)
    assert_close(np.asarray(a), ref.silu_and_mul_ref(g), "bfloat16")
    inv = ref.rope_inv_freq(128)
    assert_close(np.asarray(q2), ref.rope_ref(q, pos, 128, False, inv), "bfloat16")
    assert_close(np.asarray(k2), ref.rope_ref(k, pos, 128, False, inv), "bfloat16")


def test_jax_empty_inputs(rng):
    """XLA may hand an empty buffer over as a null pointer: merge_states of zero states per
    row (v = 0, s = -inf) and a decode of a request with no tokens run like the CuPy path."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    v, s = rtcinfer.merge_states(jnp.zeros((3, 0, 2, 64), jnp.float32),
                                 jnp.zeros((3, 0, 2), jnp.float32))  # fmt: skip
    assert (np.asarray(v) == 0).all() and np.isneginf(np.asarray(s)).all()
    q = jnp.asarray(randn(rng, (8, 128), "bfloat16"))
    k = jnp.zeros((0, 2, 128), jnp.bfloat16)
    o, lse = rtcinfer.single_decode_with_kv_cache(q, k, k, return_lse=True)
    assert (np.asarray(o).astype(np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_jax_rejects_out():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    x = jax.numpy.ones((2, 64), jax.numpy.float32)
    with pytest.raises(TypeError, match="out= is not supported for JAX"):
        rtcinfer.rmsnorm(x, jax.numpy.ones(64, jax.numpy.float32), out=x)


def test_cupy_graph_capture_and_replay(rng):
    import cupy

    x, w = randn(rng, (64, 4096), "bfloat16"), randn(rng, (4096,), "bfloat16")
    xd, wd = upload(x), upload(w)
    out = cupy.empty_like(xd)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        rtcinfer.rmsnorm(xd, wd, out=out)  # compile and load before capture
        stream.synchronize()
        stream.begin_capture()
        rtcinfer.rmsnorm(xd, wd, out=out)
        rtcinfer.silu_and_mul(xd, out=out[:, :2048])
        graph = stream.end_capture()
        x_new = randn(rng, (64, 4096), "bfloat16")
        xd.set(x_new)
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
    expect = ref.rmsnorm_ref(x_new, w)
    expect[:, :2048] = ref.silu_and_mul_ref(x_new)
    assert_close(out, expect, "bfloat16")


def test_torch_cuda_graph(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(128, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(128, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (128,), device="cuda", dtype=torch.int32)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        rtcinfer.apply_rope_pos_ids_inplace(q.clone(), k.clone(), pos)
        rtcinfer.rmsnorm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rtcinfer.rmsnorm(x, w)
        rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        q0, k0 = q.clone(), k.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, ref.rmsnorm_ref(to_host(x), to_host(w)), "bfloat16")
        inv = ref.rope_inv_freq(128)
        assert_close(q, ref.rope_ref(to_host(q0), to_host(pos), 128, False, inv), "bfloat16")
        assert_close(k, ref.rope_ref(to_host(k0), to_host(pos), 128, False, inv), "bfloat16")


_CUPY_ONLY = """
import sys, cupy, rtcinfer
x = cupy.ones((4, 256), dtype=cupy.float32)
rtcinfer.rmsnorm(x, cupy.ones(256, dtype=cupy.float32))
rtcinfer.silu_and_mul(x)
cupy.cuda.runtime.deviceSynchronize()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib")))
"""


def test_cupy_callers_never_import_torch_or_jax():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CUPY_ONLY], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "[]"
