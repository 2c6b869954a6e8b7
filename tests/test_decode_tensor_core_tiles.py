"""Tensor-core decode (use_tensor_cores=True) with its tile choices forced against the float64
references (GPU): fp8 KV widened into staging tiles instead of read from the ring, and 128-key
K/V tiles in a 3-stage ring on every batch."""

from __future__ import annotations

import pytest

from .test_decode_tensor_cores import tensor_core_decode_checked, with_decode_tiles

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("feature", ["plain", "alibi_cap_window", "window0"])
@pytest.mark.parametrize("case", ["group1", "group4", "group5_fp16", "d64", "d256",
                                  "page1", "hnd_strided_tuple"])  # fmt: skip
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_tensor_core_decode_widening_fp8_into_staging_tiles(monkeypatch, feature, case, kv_dtype):
    """The prefill kernel's decode tiles over fp8 KV the other way (fp8_direct=False: the
    tiles are widened into staging tiles, 64-key tiles, 3 stages) give the reference's
    results."""
    with_decode_tiles(monkeypatch, fp8_direct=False, kv_tile=64, stages=3)
    spec = tensor_core_decode_checked(("tc staged", feature, case, kv_dtype))
    assert not spec.fp8_direct


@pytest.mark.parametrize("feature", ["plain", "alibi_cap_window", "window0"])
@pytest.mark.parametrize("case", ["group4", "group5_fp16", "d64", "page1"])
def test_tensor_core_decode_with_128_key_tiles(monkeypatch, feature, case):
    """8-row tiles over 128-key K/V tiles in a 3-stage ring (32 keys a warp: plan()'s choice
    for a batch that leaves SMs idle, wide_decode_spec; forced here on every batch) give the
    reference's results."""
    from rtcinfer import jit

    if jit.device_limits(0)[1] < 200 * 1024:
        pytest.skip("a 3-stage ring of 128-key tiles needs 200 KB of shared memory a CTA")
    with_decode_tiles(monkeypatch, kv_tile=128, stages=3)
    spec = tensor_core_decode_checked(("tc 128 keys", feature, case, None))
    assert (spec.kv_tile, spec.stages) == (128, 3)


@pytest.mark.parametrize("feature", ["plain", "alibi_cap_window"])
@pytest.mark.parametrize("case", ["group4", "group1", "d64", "page1"])
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_tensor_core_decode_over_fp8_in_64_key_tiles(monkeypatch, feature, case, kv_dtype):
    """fp8 read from the ring in 64-key tiles, 3 stages (16 keys a warp; forced here) give the
    reference's results."""
    with_decode_tiles(monkeypatch, kv_tile=64, stages=3)
    spec = tensor_core_decode_checked(("tc fp8 64 keys", feature, case, kv_dtype))
    assert spec.fp8_direct and (spec.kv_tile, spec.stages) == (64, 3)
