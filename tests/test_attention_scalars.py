"""sm_scale, logits_soft_cap, rope_scale and rope_theta: defaults, and the ValueError naming a
value no kernel can use, from every attention entry point (plan() of the decode and prefill
wrappers, single decode) before any GPU work."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import rtcinfer
from rtcinfer.attention.scalars import attention_scalars

from .fakes import fake_gpu

BAD = [
    (dict(sm_scale=float("nan")), r"sm_scale must be None or finite, got nan"),
    (dict(sm_scale=float("inf")), r"sm_scale must be None or finite, got inf"),
    (dict(rope_scale=float("nan")), r"rope_scale must be None or > 0 and finite, got nan"),
    (dict(rope_scale=-float("inf")), r"rope_scale must be None or > 0 and finite, got -inf"),
    (dict(rope_scale=0.0), r"rope_scale must be None or > 0 and finite, got 0\.0"),
    (dict(rope_theta=0), r"rope_theta must be None or > 0 and finite, got 0\.0"),
    (dict(rope_theta=-1e4), r"rope_theta must be None or > 0 and finite, got -10000\.0"),
    (dict(rope_theta=float("inf")), r"rope_theta must be None or > 0 and finite, got inf"),
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be None or >= 0 and finite, got -1\.0"),
    (dict(logits_soft_cap=np.float32("nan")), r"logits_soft_cap must be None or >= 0 .* nan"),
]


def test_defaults_and_values():
    assert attention_scalars(128, None, None, None, None) == (1 / math.sqrt(128), 0.0, 1.0, 1e4)
    got = attention_scalars(64, np.float32(0.5), 30, 8, np.int64(500000))
    assert got == (0.5, 30.0, 8.0, 5e5) and all(type(x) is float for x in got)


def test_what_is_not_a_number_is_a_type_error():
    with pytest.raises(TypeError, match=r"rope_theta must be None or a number, got 'big'"):
        attention_scalars(128, None, None, None, "big")
    with pytest.raises(TypeError, match="sm_scale must be None or a number"):
        attention_scalars(128, np.array([1.0, 2.0]), None, None, None)


@pytest.mark.parametrize("bad, message", BAD)
def test_decode_plan_refuses(monkeypatch, bad, message):
    fake_gpu(monkeypatch)
    wrapper = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match=message):
        wrapper.plan([0, 1], [0], [3], 8, 2, 128, 16, pos_encoding_mode="ROPE_LLAMA", **bad)


@pytest.mark.parametrize("bad, message", BAD)
def test_prefill_plans_refuse(monkeypatch, bad, message):
    fake_gpu(monkeypatch)
    ragged = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    with pytest.raises(ValueError, match=message):
        ragged.plan([0, 4], [0, 9], 8, 2, 128, causal=True, **bad)
    paged = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match=message):
        paged.plan([0, 4], [0, 1], [0], [9], 8, 2, 128, 16, causal=True, **bad)


@pytest.mark.parametrize("bad, message", BAD)
def test_single_decode_refuses(monkeypatch, bad, message):
    """PyTorch CPU tensors stand in for CUDA ones (the op is refused before any launch)."""
    torch = pytest.importorskip("torch")
    call = importlib.import_module("rtcinfer.interop.call")

    def as_cuda(x, name):
        return None if x is None else call.ArrayInfo(tuple(x.shape), x.stride(), "bfloat16", 0)

    monkeypatch.setattr(call, "_torch_info", as_cuda)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    fake_gpu(monkeypatch)
    q, k = torch.zeros(8, 128), torch.zeros(40, 2, 128)
    with pytest.raises(ValueError, match=message):
        rtcinfer.single_decode_with_kv_cache(q, k, k, pos_encoding_mode="ROPE_LLAMA", **bad)
