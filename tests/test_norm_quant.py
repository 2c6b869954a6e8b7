"""The norms with an fp8 output against the float64 references (GPU): CuPy (uint8 storage and
out_dtype), PyTorch (fp8 tensors, eager and compiled) and JAX (new arrays, inside jax.jit)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests.checks import assert_fp8, to_host
from tests.gpu import randn, upload

pytestmark = pytest.mark.gpu

FP8 = ["float8_e4m3fn", "float8_e5m2"]
DTYPES = ["float16", "bfloat16", "float32"]


def _nan_bytes(shape):
    """A CuPy uint8 array of fp8 NaNs (0x7F in both types), to prove every element is written."""
    import cupy

    return cupy.full(shape, 0x7F, dtype=np.uint8)


@pytest.mark.parametrize("out_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 1001), (129, 8192), (5, 6, 2048)])
def test_rmsnorm_quant(rng, shape, dtype, out_dtype):
    """Scales that keep the values in range and one that saturates many (0.004: |y| / scale
    up to ~1000, past e4m3's 448); the scale from device memory and as a number."""
    x, w = randn(rng, shape, dtype, 3.0), randn(rng, shape[-1:], dtype)
    exact = ref.rmsnorm_ref(x, w, 1e-6)
    for scale in (0.5, 0.004):
        for given in (upload(np.array([scale], np.float32)), scale):
            out = _nan_bytes(shape)
            got = rtcinfer.rmsnorm_quant(out, upload(x), upload(w), given, out_dtype=out_dtype)
            assert got is out
            assert_fp8(out, ref.fp8_quant_ref(exact, np.float32(scale), out_dtype), out_dtype)


@pytest.mark.parametrize("out_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 1001), (129, 8192), (3, 16384)])
def test_fused_add_rmsnorm_quant(rng, shape, dtype, out_dtype):
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype)
    w = randn(rng, shape[-1:], dtype)
    xd, rd, out = upload(x), upload(r), _nan_bytes(shape)
    scale = upload(np.array([0.05], np.float32))
    got = rtcinfer.fused_add_rmsnorm_quant(out, xd, rd, upload(w), scale, out_dtype=out_dtype)
    assert got[0] is out and got[1] is rd
    normed, residual = ref.fused_add_rmsnorm_ref(x, r, w, 1e-6, dtype)
    np.testing.assert_array_equal(to_host(rd), residual)
    np.testing.assert_array_equal(to_host(xd), x.astype(np.float64))  # the input only read
    assert_fp8(out, ref.fp8_quant_ref(normed, np.float32(0.05), out_dtype), out_dtype)


@pytest.mark.parametrize("out_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 1001), (129, 8192), (5, 6, 2048)])
def test_layernorm_quant(rng, shape, dtype, out_dtype):
    """gemma and beta float32 (FlashInfer's) or the input's dtype; a scale that saturates
    many values, from device memory and as a number."""
    x = randn(rng, shape, dtype, 3.0)
    for wdtype in ("float32", dtype):
        g, b = randn(rng, shape[-1:], wdtype), randn(rng, shape[-1:], wdtype)
        exact = ref.layernorm_ref(x, g, b, 1e-6)
        for scale in (0.5, 0.004):
            for given in (upload(np.array([scale], np.float32)), scale):
                out = _nan_bytes(shape)
                got = rtcinfer.layernorm_quant(out, upload(x), upload(g), upload(b), given,
                                               out_dtype=out_dtype)  # fmt: skip
                assert got is out
                assert_fp8(out, ref.fp8_quant_ref(exact, np.float32(scale), out_dtype),
                           out_dtype)  # fmt: skip


def test_strided_rows_and_a_strided_out(rng):
    """Rows strided in two levels, an out that is a column slice of a wider buffer (its other
    bytes untouched), an unaligned row length (narrow vectors)."""
    big = randn(rng, (4, 3, 2 * 1000), "bfloat16")
    w = randn(rng, (1000,), "bfloat16")
    buffer = _nan_bytes((4, 3, 1004))
    out = buffer[:, :, 3:1003]
    rtcinfer.rmsnorm_quant(out, upload(big)[:, :, 1000:], upload(w), 0.02,
                           out_dtype="float8_e4m3fn")  # fmt: skip
    exact = ref.fp8_quant_ref(ref.rmsnorm_ref(big[:, :, 1000:], w), np.float32(0.02),
                              "float8_e4m3fn")  # fmt: skip
    assert_fp8(out, exact, "float8_e4m3fn")
    edges = buffer.get()[:, :, [0, 1, 2, 1003]]
    assert (edges == 0x7F).all()


def test_empty_batch():
    import cupy

    out = cupy.empty((0, 64), np.uint8)
    x, w = cupy.empty((0, 64), np.float16), cupy.ones(64, np.float16)
    assert rtcinfer.rmsnorm_quant(out, x, w, 1.0, out_dtype="float8_e4m3fn") is out


def test_pytorch_fp8_tensors_eager_and_compiled(rng):
    """fp8 tensors of PyTorch (no out_dtype), the scale a tensor or a number; compiled with
    fullgraph=True the same bits as eager, the residual's in-place update included."""
    torch = pytest.importorskip("torch")
    x, r = randn(rng, (8, 4096), "bfloat16"), randn(rng, (8, 4096), "bfloat16")
    w = randn(rng, (4096,), "bfloat16")

    def dev(a):
        return torch.from_numpy(a.astype(np.float32)).to("cuda", torch.bfloat16)

    scale = torch.tensor([0.03], device="cuda")
    out = torch.empty(8, 4096, device="cuda", dtype=torch.float8_e4m3fn)
    xt, rt = dev(x), dev(r)
    assert rtcinfer.rmsnorm_quant(out, xt, dev(w), scale) is out
    exact = ref.fp8_quant_ref(ref.rmsnorm_ref(x, w), np.float32(0.03), "float8_e4m3fn")
    assert_fp8(out, exact, "float8_e4m3fn")

    def step(out, x, residual, w, scale):
        rtcinfer.fused_add_rmsnorm_quant(out, x, residual, w, scale)
        return out, residual

    eager = [a.clone() for a in (out, xt, rt)]
    want = step(eager[0], eager[1], eager[2], dev(w), scale)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(out, xt, rt, dev(w), scale)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    normed, residual = ref.fused_add_rmsnorm_ref(x, r, w, 1e-6, "bfloat16")
    np.testing.assert_array_equal(to_host(rt), residual)
    assert_fp8(out, ref.fp8_quant_ref(normed, np.float32(0.03), "float8_e4m3fn"), "float8_e4m3fn")

    def layer(out, x, g, b):  # layernorm_quant, FlashInfer's float32 gemma and beta, a number
        rtcinfer.layernorm_quant(out, x, g, b, 0.03)
        return out

    g, b = randn(rng, (4096,), "float32"), randn(rng, (4096,), "float32")
    gt, bt = (torch.from_numpy(a).to("cuda") for a in (g, b))
    want = layer(torch.empty_like(out), xt, gt, bt)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.empty_like(out), xt,
                                                                    gt, bt)  # fmt: skip
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    exact = ref.fp8_quant_ref(ref.layernorm_ref(to_host(xt), g, b), np.float32(0.03),
                              "float8_e4m3fn")  # fmt: skip
    assert_fp8(got, exact, "float8_e4m3fn")


def test_jax_new_arrays_eager_and_jitted(jax_gpu, rng):
    """JAX arrays are immutable: out and the residual come back as new arrays, eager and
    inside jax.jit (launched by XLA), and the arrays given are left as they were."""
    jax = jax_gpu
    jnp = jax.numpy
    x, r = randn(rng, (6, 2048), "bfloat16"), randn(rng, (6, 2048), "bfloat16")
    w = randn(rng, (2048,), "bfloat16")
    xj, rj, wj = (jnp.asarray(a) for a in (x, r, w))
    out = jnp.zeros((6, 2048), jnp.float8_e5m2)
    scale = jnp.asarray([0.25], jnp.float32)
    normed, residual = ref.fused_add_rmsnorm_ref(x, r, w, 1e-6, "bfloat16")
    exact = ref.fp8_quant_ref(normed, np.float32(0.25), "float8_e5m2")
    plain = ref.fp8_quant_ref(ref.rmsnorm_ref(x, w), np.float32(0.25), "float8_e5m2")
    for fn in (rtcinfer.fused_add_rmsnorm_quant, jax.jit(rtcinfer.fused_add_rmsnorm_quant)):
        got_out, got_residual = fn(out, xj, rj, wj, scale)
        assert_fp8(np.asarray(got_out), exact, "float8_e5m2")
        np.testing.assert_array_equal(to_host(got_residual), residual)
    jitted = jax.jit(lambda o, x, w: rtcinfer.rmsnorm_quant(o, x, w, 0.25))
    for fn in (lambda o, x, w: rtcinfer.rmsnorm_quant(o, x, w, 0.25), jitted):
        assert_fp8(np.asarray(fn(out, xj, wj)), plain, "float8_e5m2")
    np.testing.assert_array_equal(to_host(rj), r.astype(np.float64))
    assert (to_host(out) == 0).all()
