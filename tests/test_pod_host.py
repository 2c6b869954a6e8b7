"""The POD wrappers without a GPU: what plan() plans on each side (the decode wrapper, or two
paged prefill wrappers: the decode side not causal, the prefill side for run()'s mask), what
run() hands each side, the decode-side options FlashInfer ignores refused where they differ
from the plan, and the workspace halves."""

from __future__ import annotations

import numpy as np
import pytest

from .fakes import attention_without_a_gpu


@pytest.fixture
def pod(monkeypatch):
    """rtcinfer.attention.pod with its wrappers planning without a GPU."""
    from rtcinfer.attention import pod

    attention_without_a_gpu(monkeypatch)
    return pod


def table(lens, page=16):
    pages = [-(-n // page) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.arange(indptr[-1], dtype=np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lens, pages, strict=True)], np.int32)
    return indptr, indices, last


def recorder(calls: list, name: str, result):
    def record(*args, **kwargs):
        calls.append((name, args, kwargs))
        return result

    return record


def test_pod_plans_the_decode_batch_and_runs_both_sides(pod, monkeypatch):
    wrapper = pod.PODWithPagedKVCacheWrapper(None, "HND")
    wrapper.plan(*table([40, 3]), 8, 2, 64, 16, pos_encoding_mode="ALIBI", window_left=30,
                 q_data_type="bfloat16", sm_scale=0.2)  # fmt: skip
    cfg = wrapper._decode._config
    assert (cfg.pos_encoding_mode, cfg.window_left, cfg.sm_scale) == ("ALIBI", 30, 0.2)
    assert wrapper._decode._kv_layout == "HND"
    calls = []
    monkeypatch.setattr(pod, "single_prefill_with_kv_cache", recorder(calls, "prefill", "o_p"))
    monkeypatch.setattr(wrapper._decode, "run", recorder(calls, "decode", "o_d"))
    q_p, k_p, v_p = np.zeros((5, 8, 64)), np.zeros((9, 2, 64)), np.zeros((9, 2, 64))
    q_d = np.zeros((2, 8, 64))
    out = wrapper.run(q_p, k_p, v_p, q_d, "cache", causal_p=True, kv_layout_p="HND",
                      window_left_p=4, sm_scale_p=0.5, q_scale=2.0, k_scale=0.5, v_scale=3.0,
                      kv_layout_d="HND", window_left_d=30, sm_scale_d=0.2,
                      pos_encoding_mode_d="ALIBI", causal_d=True)  # fmt: skip
    assert out == ("o_p", "o_d")
    (_, p_args, p_kw), (_, d_args, d_kw) = calls  # the prefill launched first
    assert p_args == (q_p, k_p, v_p)
    assert p_kw == dict(custom_mask=None, packed_custom_mask=None, causal=True, kv_layout="HND",
                        pos_encoding_mode="NONE", sm_scale=0.5, window_left=4, rope_scale=None,
                        rope_theta=None)  # fmt: skip
    assert d_args == (q_d, "cache")
    assert d_kw == dict(q_scale=2.0, k_scale=0.5, v_scale=3.0, out=None)  # NumPy: in order


@pytest.mark.parametrize("option, value, match", [
    ("window_left_d", 5, r"run\(window_left_d=5\) differs from the plan's \(-1\)"),
    ("sm_scale_d", 0.3, r"run\(sm_scale_d=0.3\) differs from the plan's \(0.125\)"),
    ("pos_encoding_mode_d", "ALIBI", r"pos_encoding_mode_d='ALIBI'\) differs from the plan's "
                                     r"\('NONE'\)"),
    ("kv_layout_d", "HND", r"kv_layout_d='HND'\) differs from the plan's \('NHD'\)"),
    ("rope_theta_d", 5e5, r"rope_theta_d=500000.0\) differs from the plan's \(10000.0\)"),
    ("custom_mask_d", np.ones(4, bool), "decode-side custom mask .* not supported: custom_mask_d"),
])  # fmt: skip
def test_pod_refuses_decode_options_other_than_the_plans(pod, monkeypatch, option, value, match):
    wrapper = pod.PODWithPagedKVCacheWrapper()
    wrapper.plan(*table([40, 3]), 8, 2, 64, 16, q_data_type="bfloat16")
    monkeypatch.setattr(wrapper._decode, "run", recorder([], "decode", None))
    q = np.zeros((2, 8, 64))
    with pytest.raises(ValueError, match=match):
        wrapper.run(q, q, q, q, "cache", **{option: value})


def test_pod_needs_a_plan_and_takes_no_extra_arguments(pod):
    wrapper = pod.PODWithPagedKVCacheWrapper()
    q = np.zeros((2, 8, 64))
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(q, q, q, q, "cache")
    wrapper.plan(*table([4]), 8, 2, 64, 16)
    args = [None] * 25  # FlashInfer's 25 run() options after paged_kv_cache_d
    with pytest.raises(TypeError, match="no arguments past enable_pdl, got 1 more"):
        wrapper.run(q, q, q, q, "cache", *args, "extra")
    with pytest.raises(ValueError, match="custom attention variants not supported: jit_args"):
        pod.PODWithPagedKVCacheWrapper(jit_args=[1])


def test_batch_pod_plans_both_sides_and_replans_the_prefill_mask(pod, monkeypatch):
    wrapper = pod.BatchPODWithPagedKVCacheWrapper(None, "NHD")
    assert wrapper._prefill._ws is not wrapper._decode._ws
    qo_p = np.array([0, 30, 100], np.int32)
    qo_d = np.array([0, 1, 2, 4], np.int32)  # the last decode request has two queries
    wrapper.plan(qo_p, *table([50, 70]), qo_d, *table([9, 300, 17]), 8, 2, 64, 16,
                 window_left=20, q_data_type="bfloat16", sm_scale=0.25)  # fmt: skip
    dec, pre = wrapper._decode._launch.cfg, wrapper._prefill._launch.cfg
    assert not dec.causal and not pre.causal  # FlashInfer's run() default: causal_p=False
    assert dec.attn.window_left == pre.attn.window_left == 20
    assert dec.attn.sm_scale == pre.attn.sm_scale == 0.25
    plans = []
    original = wrapper._prefill.plan
    monkeypatch.setattr(wrapper._prefill, "plan",
                        lambda *a, **k: (plans.append(k["causal"]), original(*a, **k)))  # fmt: skip
    calls = []
    monkeypatch.setattr(wrapper._prefill, "run", recorder(calls, "prefill", "p"))
    monkeypatch.setattr(wrapper._decode, "run", recorder(calls, "decode", "d"))
    q_p, q_d = np.zeros((100, 8, 64)), np.zeros((4, 8, 64))
    assert wrapper.run(q_p, "cache_p", q_d, "cache_d", causal_p=True, k_scale=0.5,
                       return_lse=True) == ("p", "d")  # fmt: skip
    assert plans == [True] and wrapper._prefill._launch.cfg.causal
    wrapper.run(q_p, "cache_p", q_d, "cache_d", causal_p=True)
    assert plans == [True]  # the same mask: the plan stays
    (_, p_args, p_kw), (_, d_args, d_kw) = calls[:2]
    assert p_args == (q_p, "cache_p") and p_kw == dict(return_lse=True)
    assert d_args == (q_d, "cache_d")
    assert d_kw == dict(q_scale=None, k_scale=0.5, v_scale=None, out=None, lse=None,
                        return_lse=True)  # fmt: skip
    # the next plan() plans the prefill side for the latest run()'s mask
    wrapper.plan(qo_p, *table([50, 70]), qo_d, *table([9, 300, 17]), 8, 2, 64, 16,
                 q_data_type="bfloat16")  # fmt: skip
    assert plans == [True, True]
    mask = np.ones(30 * 50 + 70 * 70, bool)
    wrapper.run(q_p, "cache_p", q_d, "cache_d", custom_mask_p=mask)
    assert plans == [True, True, False] and wrapper._prefill._launch.cfg.custom_mask
    wrapper.run(q_p, "cache_p", q_d, "cache_d", custom_mask_p=mask)
    assert plans == [True, True, False, False]  # a custom mask: planned with each run()


def test_batch_pod_halves_the_workspace():
    from rtcinfer.attention.pod import _half

    buffer = np.zeros(1000, np.uint8)
    assert _half(buffer, 0).shape == (256,) and _half(buffer, 1).shape == (744,)
    assert _half(None, 1) is None
