"""The persistent (streaming) decode kernel against the float64 references (GPU).

Batches of at least 3/4 of the GPU's CTA slots (requests x kv heads) get a streamed plan:
gridDim.y persistent CTAs per kv head pull pieces of the requests from a queue, with the K/V
pipeline running across piece boundaries. Lengths mix 1, page_size +- 1, 513 and long ones.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import rtcinfer
from rtcinfer.interop.dtypes import FP8_DTYPES

from .checks import to_host
from .gpu_decode import check_attention, make_batch, run_batch

pytestmark = pytest.mark.gpu


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def stream_lengths(batch: int, page_size: int, rng) -> list[int]:
    awkward = [1, page_size - 1 or 1, page_size, page_size + 1, 513, 37, 3000, 1200]
    return [int(x) for x in rng.permutation((awkward * batch)[:batch])]


def run_streamed(batch, **kwargs):
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout=batch.layout)
    features = {k: v for k, v in kwargs.items() if k not in ("k_scale", "v_scale")}
    o, lse = run_batch(batch, wrapper, kwargs.get("k_scale"), kwargs.get("v_scale"), **features)
    assert wrapper._stream is not None and wrapper._launch.fn is wrapper._stream[0]
    return wrapper, o, lse


CASES = {
    "group4": dict(num_kv_heads=16, group_size=4),
    "group1": dict(num_kv_heads=32, group_size=1, q_dtype="float16"),
    "group8_d64": dict(num_kv_heads=16, group_size=8, head_dim=64),
    "group16": dict(num_kv_heads=16, group_size=16),
    "d256": dict(num_kv_heads=16, group_size=2, head_dim=256, q_dtype="float16"),
    "page1": dict(num_kv_heads=16, group_size=4, page_size=1),
    "page64_hnd": dict(num_kv_heads=16, group_size=4, page_size=64, layout="HND"),
    "strided_tuple": dict(num_kv_heads=16, group_size=5, form="strided_tuple"),
}
FEATURES = {
    None: {},
    "window": dict(window_left=100),
    "rope_cap": dict(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=3.0),
    "alibi_window": dict(pos_encoding_mode="ALIBI", window_left=600, sm_scale=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_batch(case):
    rng = seeded("stream", case)
    kwargs = {"page_size": 16, **CASES[case]}
    batch = make_batch(rng, stream_lengths(16, kwargs["page_size"], rng), **kwargs)
    wrapper, o, lse = run_streamed(batch)
    check_attention(o, lse, *batch.reference(), batch.q_dtype)
    # the queue and merge counters were reset: a second run is bitwise the same
    o2, lse2 = wrapper.run(batch.q_dev, batch.cache_dev, return_lse=True)
    assert np.array_equal(to_host(o), to_host(o2)) and np.array_equal(to_host(lse), to_host(lse2))


@pytest.mark.parametrize("feature", [f for f in FEATURES if f])
@pytest.mark.parametrize("kv_dtype", [None, *FP8_DTYPES])
def test_streamed_features(feature, kv_dtype):
    rng = seeded("stream", feature, kv_dtype)
    batch = make_batch(rng, stream_lengths(16, 16, rng), num_kv_heads=16, group_size=4,
                       kv_dtype=kv_dtype)  # fmt: skip
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype else {}
    _, o, lse = run_streamed(batch, **FEATURES[feature], **scales)
    check_attention(o, lse, *batch.reference(**FEATURES[feature], **scales), batch.q_dtype)


def test_streamed_then_classic_plans_share_a_wrapper():
    """A wrapper moves between streamed and per-item plans (and back) with correct results."""
    rng = seeded("stream", "switch")
    big = make_batch(rng, stream_lengths(16, 16, rng), num_kv_heads=16, group_size=4)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    for lengths in ([3000, 1, 0, 513], None, [40, 5000]):
        batch = big if lengths is None else big.with_table(lengths + [1] * (16 - len(lengths)),
                                                           rng)  # fmt: skip
        o, lse = run_batch(batch, wrapper)
        check_attention(o, lse, *batch.reference(), batch.q_dtype)
