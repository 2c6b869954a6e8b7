"""The host side of decode without a GPU: argument validation, kernel choice, workspace layout
and the packed plan, read back the way decode_kernel reads it."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import rtcinfer
from rtcinfer import jit
from rtcinfer.attention.decode_kernel import (
    LONG_ITEM_TILES,
    _lookahead,
    decode_spec,
    half_tiles,
    make_config,
    rope_frequencies,
)
from rtcinfer.attention.decode_plan import ITEM_INTS, WORK_ITEM, Capacity, header_ints, pack_plan
from rtcinfer.plan.decode import plan_decode

from .paged_batch import page_table_for

GOOD = dict(
    num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pos_encoding_mode="NONE",
    window_left=-1, logits_soft_cap=None, q_dtype="bfloat16", kv_dtype=None, o_dtype=None,
    sm_scale=None, rope_scale=None, rope_theta=None,
)  # fmt: skip


def test_config_defaults():
    cfg = make_config(**GOOD)
    assert cfg.kv_dtype == cfg.o_dtype == "bfloat16" and cfg.group_size == 4
    assert cfg.sm_scale == pytest.approx(1 / math.sqrt(128)) and cfg.logits_soft_cap == 0
    assert (cfg.rope_scale, cfg.rope_theta, cfg.kv_blocks) == (1.0, 1e4, 8)
    assert make_config(**{**GOOD, "num_kv_heads": 1}).kv_blocks == 2  # 32 heads: 2 CTAs
    assert make_config(**{**GOOD, "num_kv_heads": 2, "head_dim": 256}).kv_blocks == 4


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(num_qo_heads=30), ValueError, r"num_qo_heads \(30\) must be a multiple of .* \(8\)"),
        (dict(head_dim=96), ValueError, "head_dim must be one of .* got 96"),
        (dict(pos_encoding_mode="ROPE"), ValueError, "pos_encoding_mode must be one of"),
        (dict(window_left=-2), ValueError, "window_left must be >= -1, got -2"),
        (dict(window_left=2**31), ValueError, "window_left must be -1 or fit in int32"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be None or >= 0"),
        (dict(q_dtype="float32"), TypeError, "q_data_type must be one of"),
        (dict(kv_dtype="float16"), TypeError, r"kv_data_type must be q's dtype \(bfloat16\)"),
        (dict(o_dtype="float8_e4m3fn"), TypeError, "o_data_type must be one of"),
        (dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
        (dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be an integer"),
    ],
)
def test_config_errors_name_the_value(change, error, match):
    with pytest.raises(error, match=match):
        make_config(**{**GOOD, **change})


def test_wrapper_checks_the_layout_before_touching_the_gpu():
    with pytest.raises(ValueError, match="kv_layout must be one of .* got 'NDH'"):
        rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NDH")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group_size", [1, 4, 8, 16])
def test_spec_fits_shared_memory(kv_dtype, head_dim, group_size):
    for limit in (227 * 1024, 163 * 1024):  # H100/H200, A100
        spec = decode_spec("bfloat16", kv_dtype, "bfloat16", head_dim, group_size, max_smem=limit)
        assert spec.smem_bytes <= limit and spec.stages in (2, 3)
        assert spec.head_tiles == (1 if group_size <= 8 or head_dim == 256 else 2)
        tile_bytes = spec.tile * head_dim * (1 if kv_dtype != "bfloat16" else 2) * 2
        assert tile_bytes <= 64 * 1024


SMEM_LIMITS = (227 * 1024, 163 * 1024, 99 * 1024)  # H100/H200, A100, sm_86/sm_89


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group_size", [1, 4, 8, 16])
def test_every_kernel_and_its_half_tile_variant_holds_its_epilogue(kv_dtype, head_dim,
                                                                   group_size):  # fmt: skip
    """The epilogue reuses the ring (a compile-time assert in decode.cu): every spec
    decode_spec makes satisfies it, and half_tiles offers only variants that do."""
    for limit in SMEM_LIMITS:
        if limit < 128 * 1024 and kv_dtype == "bfloat16" and head_dim == 256:
            continue  # no kernel: two 64-token stages of 512-byte rows need 128 KB
        spec = decode_spec("bfloat16", kv_dtype, "bfloat16", head_dim, group_size, max_smem=limit)
        assert spec.epilogue_fits
        half = half_tiles(spec)
        if half is not None:
            assert half.epilogue_fits and half.tile == spec.tile // 2
            assert half.smem_bytes < spec.smem_bytes <= limit


def test_half_tiles_refuses_a_ring_too_small_for_the_epilogue():
    """fp8, head_dim 128, 16 heads per CTA on a 99 KB GPU: 2 stages, and half tiles would leave
    a 32 KB ring for a 33 KB epilogue, which decode.cu rejects at compile time."""
    spec = decode_spec("bfloat16", "float8_e4m3fn", "bfloat16", 128, 16, max_smem=99 * 1024)
    assert spec.stages == 2 and spec.token_groups == 2 and half_tiles(spec) is None
    halved = replace(spec, token_groups=1)
    assert not halved.epilogue_fits
    with pytest.raises(jit.CompileError, match="epilogue fits in the ring"):
        jit.compile_spec(halved, "sm_90a")


def test_spec_that_cannot_fit_says_so():
    with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
        decode_spec("bfloat16", "bfloat16", "bfloat16", 256, 4, max_smem=99 * 1024)


def test_rope_frequencies_are_split_exactly():
    freq = rope_frequencies(128, 2.0, 5e5).astype(np.float64)
    i = np.arange(64)
    exact = 5e5 ** (-2.0 * i / 128) / 2.0 / (2 * math.pi)
    np.testing.assert_allclose(freq[:, 0] + freq[:, 1], exact, rtol=1e-13)


def test_capacity_regions_are_aligned_and_disjoint():
    cap = Capacity(max_batch=7, max_work=33, max_pages=101, num_qo_heads=12, kv_blocks=3,
                   head_dim=64, partial_work=33)  # fmt: skip
    off = cap.offsets()
    names = ["plan", "counters", "lse", "o", "end"]
    assert [off[n] % 256 for n in names] == [0] * 5
    assert off["counters"] >= 4 * cap.plan_ints and off["o"] - off["lse"] >= 4 * 33 * 12
    assert off["end"] - off["o"] >= 4 * 33 * 12 * 64
    grown = cap.grown(Capacity(8, 20, 500, 12, 3, 64, 0))
    assert (grown.max_batch, grown.max_work, grown.max_pages, grown.partial_work) == (
        14, 33, 500, 33)  # fmt: skip
    assert grown.covers(cap) and not cap.covers(grown)


def test_whole_request_capacity_has_no_partials():
    """A plan without splits writes no partials: 4096 requests x 64 heads x 128 dims fit in
    a 128 MiB workspace (the partials alone would take 128 MiB)."""
    whole = Capacity(4096, 4096, 4096 * 64, 64, 8, 128, 0)
    assert whole.offsets()["end"] < 2 << 20
    split = Capacity(4096, 4096, 4096 * 64, 64, 8, 128, 4096)
    assert split.offsets()["end"] > 128 << 20
    assert split.covers(whole) and not whole.covers(split)


def test_capacity_after_a_change_of_heads_starts_afresh():
    big = Capacity(4096, 4096, 1 << 20, 64, 8, 128, 4096)
    small = Capacity(8, 8, 100, 32, 8, 64, 8)
    assert big.grown(small) == small and not big.covers(small)


def test_a_caller_workspace_is_used_from_its_first_aligned_byte():
    from rtcinfer.attention.workspace import user_base

    cap = Capacity(1, 1, 1, 8, 2, 128, 0)
    assert user_base(0x7F0000000100, 4096, 4096, cap) == 0x7F0000000100
    assert user_base(0x7F0000000101, 4096, 3800, cap) == 0x7F0000000200
    with pytest.raises(ValueError, match=r"4096 bytes at address 0x7f0000000101 \(255 skipped"):
        user_base(0x7F0000000101, 4096, 4000, cap)


@pytest.mark.parametrize("split", [dict(num_sms=132, ctas_per_sm=2), dict(fixed_split_size=3),
                                   dict(disable_split_kv=True)])  # fmt: skip
@pytest.mark.parametrize("page_size", [1, 16])
def test_packed_plan_reads_back(split, page_size):
    """Walk the packed buffer as decode_kernel does: every request's tokens are covered once,
    in chunk order, with the right page ids and merge groups."""
    rng = np.random.default_rng(page_size)
    lengths = [0, 1, page_size, page_size + 1, 513, 5000, 0]
    indptr, indices, last, _ = page_table_for(lengths, page_size, rng)
    kwargs = {"num_sms": 132, "ctas_per_sm": 2, **split}
    plan = plan_decode(indptr, last, page_size, 2, **kwargs)
    freq = rope_frequencies(64, 1.0, 1e4)
    buf = np.full(header_ints(64) + ITEM_INTS * plan.num_work + len(indices) + 5, -7, np.int32)
    used = pack_plan(buf, plan, indptr.astype(np.int64), indices, 64, freq)
    assert used == buf.shape[0] - 5 and buf[0] == plan.num_work
    np.testing.assert_array_equal(buf[4 : header_ints(64)].view(np.float32), freq.reshape(-1))
    items = buf[header_ints(64) : header_ints(64) + ITEM_INTS * plan.num_work].view(WORK_ITEM)
    covered = {b: [] for b in range(len(lengths))}
    for w, item in enumerate(items):
        req, first, count = item["request"], item["merge_begin"], item["merge_count"]
        assert item["kv_len"] == lengths[req] and item["unused"] == 0
        assert first <= w < first + count
        assert all(items["request"][first : first + count] == req)
        for token in range(item["token_begin"], item["token_end"]):
            page = buf[item["page_ids"] + token // page_size]
            assert page == indices[indptr[req] + token // page_size]
        covered[req].append((item["token_begin"], item["token_end"]))
    for b, ranges in covered.items():
        assert ranges[0][0] == 0 and ranges[-1][1] == lengths[b]
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


def test_packed_token_ranges_of_the_longest_request_stay_in_int32():
    """A request of MAX_KV_LEN tokens in large pages, split: every packed item's range is
    inside the request (start + chunk would pass 2^31 in int32 for the last chunks)."""
    from rtcinfer.plan.decode import MAX_KV_LEN

    page_size = 1 << 20
    pages = -(-MAX_KV_LEN // page_size)
    indptr = np.array([0, pages], dtype=np.int64)
    last = np.array([MAX_KV_LEN - (pages - 1) * page_size])
    plan = plan_decode(indptr, last, page_size, 1, fixed_split_size=pages - 1,
                       num_sms=132, ctas_per_sm=2)  # fmt: skip
    assert plan.num_work == 2
    buf = np.zeros(header_ints(64) + ITEM_INTS * plan.num_work + pages, dtype=np.int32)
    pack_plan(buf, plan, indptr, np.arange(pages, dtype=np.int32), 64, None)
    items = buf[header_ints(64) : header_ints(64) + 2 * ITEM_INTS].view(WORK_ITEM)
    chunk = (pages - 1) * page_size
    np.testing.assert_array_equal(items["token_begin"], [0, chunk])
    np.testing.assert_array_equal(items["token_end"], [chunk, MAX_KV_LEN])
    np.testing.assert_array_equal(items["kv_len"], MAX_KV_LEN)


@pytest.mark.parametrize(
    "page_size, lengths, split, expect",
    [
        (64, [4096] * 4, dict(disable_split_kv=True), 1),  # 64 tiles of 64 tokens each
        (64, [4096] * 3 + [4032], dict(disable_split_kv=True), 0),  # one tile short on average
        (32, [8192] * 4, dict(disable_split_kv=True), 0),  # a tile spans two pages
        (128, [8192, 8192, 0], dict(disable_split_kv=True), 1),
        (64, [8192] * 2, dict(num_sms=132, ctas_per_sm=2), 0),  # split into short chunks
        (64, [], dict(disable_split_kv=True), 0),
    ],
)  # fmt: skip
def test_lookahead_rule(page_size, lengths, split, expect):
    """One tile in flight ahead only for pages of at least a tile and long items:
    sum(kv_len) >= LONG_ITEM_TILES * tile * num_work."""
    rng = np.random.default_rng(0)
    indptr, _, last, _ = page_table_for(lengths, page_size, rng)
    plan = plan_decode(indptr, last, page_size, 8, **{"num_sms": 132, "ctas_per_sm": 2, **split})
    assert LONG_ITEM_TILES == 64
    assert _lookahead(plan, 64) == expect
