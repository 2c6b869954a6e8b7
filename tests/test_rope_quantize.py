"""rope_quantize_fp8, mla_rope_quantize_fp8 and rope_quantize_fp8_append_paged_kv_cache on the
GPU against the float64 references: GQA and MLA shapes of real models, neox and interleaved,
e4m3 and e5m2 with scales that saturate, strided inputs, NHD and HND caches over permuted
pages with padding tokens, the bad entries reported; CuPy (uint8 storage), PyTorch (fp8
tensors) and JAX (eager and inside jax.jit, the caches returned)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop.dtypes import numpy_dtype
from tests import reference as ref
from tests.checks import assert_fp8, to_host
from tests.gpu import cos_sin_table, fp8_cache_shapes, randn, upload

pytestmark = pytest.mark.gpu

FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _as(a, dtype):
    """uint8 storage (CuPy) or fp8 values, seen as fp8 values on the host."""
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    return host.view(numpy_dtype(dtype)) if host.dtype == np.uint8 else host


@pytest.mark.parametrize("out_dtype", FP8)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(
    "nnz, hq, hk, rope_dim, nope",
    [(1, 32, 8, 128, None), (37, 32, 8, 64, 64), (300, 16, None, 64, 512), (5, 128, None, 64, 512),
     (17, 8, 1, 32, 96)],
)  # fmt: skip
def test_rope_quantize_fp8(rng, out_dtype, neox, nnz, hq, hk, rope_dim, nope):
    k_lead = (nnz,) if hk is None else (nnz, hk)
    q = randn(rng, (nnz, hq, rope_dim), "bfloat16", 4.0)
    k = randn(rng, (*k_lead, rope_dim), "bfloat16", 4.0)
    qn = None if nope is None else randn(rng, (nnz, hq, nope), "bfloat16", 4.0)
    kn = None if nope is None else randn(rng, (*k_lead, nope), "bfloat16", 4.0)
    table = cos_sin_table(rng, 4096, rope_dim)
    pos = rng.integers(0, 4096, nnz).astype(np.int32)
    scales = (0.5, 120.0)  # k's saturates e4m3 often
    outs = rtcinfer.rope_quantize_fp8(
        upload(q), upload(k), None if qn is None else upload(qn),
        None if kn is None else upload(kn), upload(table), upload(pos), is_neox=neox,
        quantize_dtype=out_dtype, quant_scale_q=scales[0], quant_scale_kv=scales[1],
    )  # fmt: skip
    expect = ref.rope_quantize_ref(q, k, qn, kn, table, pos, not neox, *scales, out_dtype)
    for name, out, exact in zip(("q_rope", "k_rope", "q_nope", "k_nope"), outs, expect,
                                strict=True):  # fmt: skip
        assert_fp8(_as(out, out_dtype), exact, out_dtype, name)


def test_strided_inputs_and_given_outputs(rng):
    """q_rope and q_nope as views of one [nnz, H, R + N] array (the layout of a fused
    projection), k's likewise; given outputs written in place."""
    nnz, hq, hk, rope_dim, nope = 64, 8, 2, 64, 128
    qf = randn(rng, (nnz, hq, nope + rope_dim), "float16")
    kf = randn(rng, (nnz, hk, nope + rope_dim), "float16")
    qd, kd = upload(qf), upload(kf)
    table, pos = cos_sin_table(rng, 512, rope_dim), rng.integers(0, 512, nnz).astype(np.int64)
    import cupy

    outs = [cupy.zeros(s, cupy.uint8) for s in ((nnz, hq, rope_dim), (nnz, hk, rope_dim),
                                                 (nnz, hq, nope), (nnz, hk, nope))]  # fmt: skip
    got = rtcinfer.rope_quantize_fp8(
        qd[..., nope:], kd[..., nope:], qd[..., :nope], kd[..., :nope], upload(table),
        upload(pos), quantize_dtype="float8_e4m3fn", q_rope_out=outs[0], k_rope_out=outs[1],
        q_nope_out=outs[2], k_nope_out=outs[3],
    )  # fmt: skip
    assert all(a is b for a, b in zip(got, outs, strict=True))
    expect = ref.rope_quantize_ref(qf[..., nope:], kf[..., nope:], qf[..., :nope],
                                   kf[..., :nope], table, pos, False, 1.0, 1.0,
                                   "float8_e4m3fn")  # fmt: skip
    for out, exact in zip(outs, expect, strict=True):
        assert_fp8(_as(out, "float8_e4m3fn"), exact, "float8_e4m3fn")


def _append_inputs(rng, mla, nnz, hq, hk, rope_dim, nope, page_size, kv_layout, out_dtype):
    """A batch of 5 requests over permuted pages, nnz new tokens spread over them (appended at
    their ends), then 3 padding tokens (-1), and caches holding earlier values."""
    lengths = np.array([3, 70, 1, 200, 33])
    new = np.diff(np.linspace(0, nnz, 6).astype(np.int64))
    pages = -(-lengths // page_size)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(kv_indptr[-1]) + 7
    kv_indices = rng.permutation(num_pages)[: kv_indptr[-1]].astype(np.int32)
    batch = np.concatenate([np.repeat(np.arange(5), new), [-1, -1, -1]]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(n) + lengths[b] - n for b, n in enumerate(new)] + [[-1, -1, -1]]
    ).astype(np.int32)  # fmt: skip
    total = batch.shape[0]
    k_lead = (total,) if mla else (total, hk)
    x = {"q_rope": randn(rng, (total, hq, rope_dim), "bfloat16", 3.0),
         "k_rope": randn(rng, (*k_lead, rope_dim), "bfloat16", 3.0),
         "q_nope": randn(rng, (total, hq, nope), "bfloat16", 3.0),
         "k_nope": randn(rng, (*k_lead, nope), "bfloat16", 3.0),
         "v": None if mla else randn(rng, (total, hk, rope_dim + nope), "bfloat16",
                                     3.0)}  # fmt: skip
    shapes = fp8_cache_shapes(mla, kv_layout, num_pages, page_size, hk, rope_dim, nope)
    old = [randn(rng, s, out_dtype) for s in shapes]
    table = cos_sin_table(rng, 8192, rope_dim)
    pos_ids = rng.integers(0, 8192, total).astype(np.int32)
    return x, old, table, pos_ids, (kv_indices, kv_indptr, batch, positions)


@pytest.mark.parametrize(
    "mla, kv_layout, page_size, neox, out_dtype",
    [(False, "NHD", 16, True, "float8_e4m3fn"), (False, "HND", 1, False, "float8_e5m2"),
     (True, "NHD", 64, True, "float8_e4m3fn"), (True, "NHD", 1, False, "float8_e5m2")],
)  # fmt: skip
def test_rope_quantize_fp8_append_paged_kv_cache(rng, mla, kv_layout, page_size, neox,
                                                 out_dtype):  # fmt: skip
    hq, hk, rope_dim, nope = (16, 1, 64, 512) if mla else (32, 8, 64, 64)
    x, old, table, pos_ids, tbl = _append_inputs(rng, mla, 40, hq, hk, rope_dim, nope,
                                                 page_size, kv_layout, out_dtype)  # fmt: skip
    caches = tuple(upload(o.view(np.uint8)) for o in old)
    dev = {n: None if a is None else upload(a) for n, a in x.items()}
    outs = rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
        dev["q_rope"], dev["k_rope"], dev["q_nope"], dev["k_nope"], dev["v"], upload(table),
        upload(pos_ids), caches, *(upload(a) for a in tbl), is_neox=neox,
        quantize_dtype=out_dtype, quant_scale_q=2.0, quant_scale_kv=0.75, page_size=page_size,
        kv_layout=kv_layout,
    )  # fmt: skip
    rtcinfer.check_errors()
    expect = ref.rope_quantize_append_ref(x["q_rope"], x["k_rope"], x["q_nope"], x["k_nope"],
                                          x["v"], table, pos_ids, old, *tbl, not neox, 2.0, 0.75,
                                          out_dtype, page_size, kv_layout)  # fmt: skip
    for name, got, exact in zip(("q_rope_out", "q_nope_out", "cache_0", "cache_1"),
                                (*outs, *caches), expect, strict=True):  # fmt: skip
        assert_fp8(_as(got, out_dtype), exact, out_dtype, name)


def test_bad_entries_are_skipped_and_reported(rng):
    nnz, hq, hk, rope_dim, page_size = 3, 4, 1, 64, 16
    q = randn(rng, (nnz, hq, rope_dim), "bfloat16")
    k, v = randn(rng, (nnz, hk, rope_dim), "bfloat16"), randn(rng, (nnz, hk, rope_dim), "bfloat16")
    old = [randn(rng, (2, page_size, hk, rope_dim), "float8_e4m3fn") for _ in range(2)]
    caches = tuple(upload(o.view(np.uint8)) for o in old)
    table = cos_sin_table(rng, 64, rope_dim)
    tbl = (np.array([1, 0], np.int32), np.array([0, 1, 2], np.int32),
           np.array([1, 5, 0], np.int32), np.array([3, 0, 40], np.int32))  # fmt: skip
    args = (upload(q), upload(k), None, None, upload(v), upload(table),
            upload(np.arange(nnz, dtype=np.int32)), caches, *(upload(a) for a in tbl))  # fmt: skip
    rtcinfer.rope_quantize_fp8_append_paged_kv_cache(*args, page_size=page_size)
    first = r"(batch_indices\[1\] = 5|positions\[2\] = 40)"  # whichever CTA came first
    with pytest.raises(
        rtcinfer.BadIndexError, match=r"^rope_quantize_fp8_append_paged_kv_cache: " + first
    ):
        rtcinfer.check_errors()
    keep = np.array([True, False, False])
    tbl_ok = (tbl[0], tbl[1], np.where(keep, tbl[2], -1), np.where(keep, tbl[3], -1))
    expect = ref.rope_quantize_append_ref(q, k, None, None, v, table, np.arange(nnz), old,
                                          *tbl_ok, False, 1.0, 1.0, "float8_e4m3fn",
                                          page_size)  # fmt: skip
    for got, exact in zip(caches, expect[2:], strict=True):
        assert_fp8(_as(got, "float8_e4m3fn"), exact, "float8_e4m3fn")


def test_pytorch_fp8_tensors(rng):
    torch = pytest.importorskip("torch")
    nnz, hq, hk, rope_dim, nope = 9, 8, 2, 64, 64
    x = [randn(rng, s, "bfloat16") for s in ((nnz, hq, rope_dim), (nnz, hk, rope_dim),
                                              (nnz, hq, nope), (nnz, hk, nope))]  # fmt: skip
    table, pos = cos_sin_table(rng, 128, rope_dim), rng.integers(0, 128, nnz)

    def dev(a, dtype=torch.bfloat16):
        return torch.from_numpy(np.asarray(a, np.float32)).to("cuda", dtype)

    outs = rtcinfer.rope_quantize_fp8(*(dev(a) for a in x), dev(table, torch.float32),
                                      torch.from_numpy(pos).cuda(),
                                      quantize_dtype=torch.float8_e5m2)  # fmt: skip
    assert all(o.dtype == torch.float8_e5m2 for o in outs)
    expect = ref.rope_quantize_ref(*x, table, pos, False, 1.0, 1.0, "float8_e5m2")
    for out, exact in zip(outs, expect, strict=True):
        assert_fp8(out.view(torch.uint8).cpu().numpy().view(numpy_dtype("float8_e5m2")), exact,
                   "float8_e5m2")  # fmt: skip


def test_jax_eager_and_jitted_with_the_caches_returned(jax_gpu, rng):
    jax = jax_gpu
    jnp = jax.numpy
    x, old, table, pos_ids, tbl = _append_inputs(rng, False, 12, 8, 2, 32, 32, 16, "NHD",
                                                 "float8_e4m3fn")  # fmt: skip
    args = dict(x)
    expect = ref.rope_quantize_append_ref(x["q_rope"], x["k_rope"], x["q_nope"], x["k_nope"],
                                          x["v"], table, pos_ids, old, *tbl, False, 1.0, 1.0,
                                          "float8_e4m3fn", 16)  # fmt: skip

    def step(q_rope, k_rope, q_nope, k_nope, v, table, pos, c0, c1, *t):
        return rtcinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, table, pos, (c0, c1), *t, page_size=16
        )

    inputs = [jnp.asarray(args[n]) for n in ("q_rope", "k_rope", "q_nope", "k_nope", "v")]
    inputs += [jnp.asarray(table), jnp.asarray(pos_ids), *(jnp.asarray(o) for o in old)]
    inputs += [jnp.asarray(a) for a in tbl]
    for fn in (step, jax.jit(step)):
        q_rope_out, q_nope_out, (c0, c1) = fn(*inputs)
        for got, exact in zip((q_rope_out, q_nope_out, c0, c1), expect, strict=True):
            assert_fp8(np.asarray(got), exact, "float8_e4m3fn")
    np.testing.assert_array_equal(to_host(inputs[7]), old[0].astype(np.float64))


def test_jax_rope_quantize_fp8_inside_jit(jax_gpu, rng):
    jax = jax_gpu
    jnp = jax.numpy
    nnz, hq, rope_dim, nope = 11, 16, 64, 512
    x = [randn(rng, s, "bfloat16") for s in ((nnz, hq, rope_dim), (nnz, rope_dim),
                                              (nnz, hq, nope), (nnz, nope))]  # fmt: skip
    table, pos = cos_sin_table(rng, 64, rope_dim), rng.integers(0, 64, nnz).astype(np.int32)
    expect = ref.rope_quantize_ref(*x, table, pos, True, 1.0, 0.5, "float8_e5m2")

    def step(*args):
        return rtcinfer.mla_rope_quantize_fp8(*args, is_neox=False, quant_scale_kv=0.5,
                                              quantize_dtype="float8_e5m2")  # fmt: skip

    inputs = [jnp.asarray(a) for a in (*x, table, pos)]
    for fn in (step, jax.jit(step)):
        for got, exact in zip(fn(*inputs), expect, strict=True):
            assert_fp8(np.asarray(got), exact, "float8_e5m2")
