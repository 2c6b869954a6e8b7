"""Calls of one signature but for their token count, in turn, against the float64 references
(GPU): the first count is prepared, each later one made from it (interop/prepared.with_rows, or
the op's remake), as an eager prefill step's ever-new counts are; a count seen before repeats
its call. Row-slot views of one buffer (x[:n]), the way an engine slices its step's arrays."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from tests import reference as ref
from tests import reference_attention as aref
from tests.checks import assert_close, assert_fp8, to_host
from tests.gpu import randn, upload

pytestmark = pytest.mark.gpu

COUNTS = [2, 7, 3, 129, 7, 64]  # the second 7: a count seen before
MOST = max(COUNTS)


@pytest.fixture
def arrays(rng):
    x, r = randn(rng, (MOST, 1024), "bfloat16"), randn(rng, (MOST, 1024), "bfloat16")
    w = randn(rng, (1024,), "bfloat16")
    return x, r, w


def test_norms(arrays):
    x, r, w = arrays
    xd, wd = upload(x), upload(w)
    for n in COUNTS:
        assert_close(rtcinfer.rmsnorm(xd[:n], wd), ref.rmsnorm_ref(x[:n], w), "bfloat16", f"{n}")
        out = upload(np.zeros((MOST, 1024), np.uint8))[:n]
        rtcinfer.rmsnorm_quant(out, xd[:n], wd, 0.05, out_dtype="float8_e4m3fn")
        exact = ref.fp8_quant_ref(ref.rmsnorm_ref(x[:n], w), np.float32(0.05), "float8_e4m3fn")
        assert_fp8(out, exact, "float8_e4m3fn")
    for n in COUNTS:  # in place: fresh copies each count
        xn, rn = upload(x[:n].copy()), upload(r[:n].copy())
        rtcinfer.fused_add_rmsnorm(xn, rn, wd)
        normed, residual = ref.fused_add_rmsnorm_ref(x[:n], r[:n], w, 1e-6, "bfloat16")
        assert_close(xn, normed, "bfloat16", f"fused {n}")
        np.testing.assert_array_equal(to_host(rn), residual)


def test_silu_and_mul(arrays):
    x, _, _ = arrays
    xd = upload(x)
    for n in COUNTS:
        assert_close(rtcinfer.silu_and_mul(xd[:n]), ref.silu_and_mul_ref(x[:n]), "bfloat16")


def test_rope(rng):
    q, k = randn(rng, (MOST, 8, 128), "bfloat16"), randn(rng, (MOST, 2, 128), "bfloat16")
    pos = rng.integers(0, 8192, MOST).astype(np.int32)
    qd, kd, pd = upload(q), upload(k), upload(pos)
    inv = ref.rope_inv_freq(128)
    for n in COUNTS:
        q_out, k_out = rtcinfer.apply_rope_pos_ids(qd[:n], kd[:n], pd[:n])
        assert_close(q_out, ref.rope_ref(q[:n], pos[:n], 128, False, inv), "bfloat16", f"q {n}")
        assert_close(k_out, ref.rope_ref(k[:n], pos[:n], 128, False, inv), "bfloat16", f"k {n}")


def test_merge_state(rng):
    v_a, v_b = randn(rng, (MOST, 4, 64), "float16"), randn(rng, (MOST, 4, 64), "float16")
    s_a, s_b = randn(rng, (MOST, 4), "float32", 3.0), randn(rng, (MOST, 4), "float32", 3.0)
    args = [upload(a) for a in (v_a, s_a, v_b, s_b)]
    for n in COUNTS:
        v, s = rtcinfer.merge_state(*(a[:n] for a in args))
        want_v, want_s = aref.merge_state_ref(v_a[:n], s_a[:n], v_b[:n], s_b[:n])
        assert_close(v, want_v, "float16", f"v {n}")
        assert_close(s, want_s, "float32", f"s {n}", tol=1e-5)


def test_append_paged_kv_cache(rng):
    """Each count's tokens go to the front of a request's pages (one request, MOST tokens of
    room), into a cache that starts from the same contents every count."""
    pages, page_size = MOST // 16 + 1, 16
    cache = randn(rng, (pages, 2, page_size, 2, 64), "bfloat16")
    indices = rng.permutation(pages).astype(np.int32)
    indptr = np.array([0, pages], np.int32)
    last = np.array([page_size], np.int32)
    k, v = randn(rng, (MOST, 2, 64), "bfloat16"), randn(rng, (MOST, 2, 64), "bfloat16")
    batch, pos = np.zeros(MOST, np.int32), np.arange(MOST, dtype=np.int32)
    kd, vd, bd, posd = upload(k), upload(v), upload(batch), upload(pos)
    table = [upload(a) for a in (indices, indptr, last)]
    for n in COUNTS:
        got = upload(cache)
        rtcinfer.append_paged_kv_cache(kd[:n], vd[:n], bd[:n], posd[:n], got, *table)
        want = aref.append_paged_kv_cache_ref(k[:n], v[:n], batch[:n], pos[:n], cache, indices,
                                              indptr, last)  # fmt: skip
        np.testing.assert_array_equal(to_host(got), want.astype(np.float64), err_msg=f"{n}")
