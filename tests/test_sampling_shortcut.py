"""The samplers' shortcut (interop/shortcut.py, rtcinfer/sampling/samplers.py) without a GPU: a
repeated call from probabilities with number parameters issues the block the function's own
path issues (its seed and offset drawn from the generator once a call, as the function draws
them), and calls the function handles otherwise (per-row arrays, indices, seeds, check_nan,
return_valid) never take it (PyTorch CPU tensors stand in for CUDA ones; the launch is faked)."""

from __future__ import annotations

import importlib

import pytest

import rtcinfer
from rtcinfer.errors import BadIndex
from rtcinfer.interop import shortcut
from rtcinfer.sampling import samplers

from .fakes import FakeRecords, issued_launches, pointed, shortcut_entries, torch_as_cuda

torch = pytest.importorskip("torch")


@pytest.fixture
def issued(monkeypatch):
    """CPU tensors taken as CUDA tensors of device 0 (tests/fakes.py's torch_as_cuda); yields
    the launches issued (issued_launches)."""
    torch_as_cuda(monkeypatch)
    monkeypatch.setattr(samplers._OP, "cache", {})
    FakeRecords(monkeypatch)  # indices are checked on the device: its records in host memory
    yield issued_launches(monkeypatch)


def _calls(batch):
    probs = torch.rand(batch, 1000)
    gen = rtcinfer.Generator(seed=7, offset=3)
    return [
        ("plain", rtcinfer.sampling_from_probs, (probs,), {"generator": gen}),
        ("top_k", rtcinfer.top_k_sampling_from_probs, (probs, 50), {"generator": gen}),
        ("top_p", rtcinfer.top_p_sampling_from_probs, (probs, 0.9), {"generator": gen}),
        ("min_p", rtcinfer.min_p_sampling_from_probs, (probs, 0.05), {"generator": gen}),
        ("top_k_first", rtcinfer.top_k_top_p_sampling_from_probs, (probs, 20, 0.8),
         {"generator": gen}),
        ("joint", rtcinfer.top_k_top_p_sampling_from_probs, (probs, 20, 0.8),
         {"generator": gen, "filter_apply_order": "joint"}),
        ("out given", rtcinfer.top_k_sampling_from_probs, (probs, 5),
         {"generator": gen, "out": torch.empty(batch, dtype=torch.int32)}),
    ]  # fmt: skip


@pytest.mark.parametrize("batch", [1, 300])  # a cluster of CTAs a row; one CTA a row
@pytest.mark.parametrize("case", range(7))
def test_a_repeated_sampler_call_issues_what_the_function_issues(issued, batch, case):
    records = []
    for n in range(5):  # seen, learnt, the shortcut twice, the function itself: fresh arrays
        name, public, args, kwargs = _calls(batch)[case]
        results = (public.__wrapped__ if n == 4 else public)(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        records.append(pointed(issued[n], (*tensors, results), torch.Tensor.data_ptr))
        assert tuple(results.shape) == (batch,) and results.dtype == torch.int32, name
        if "out" in kwargs:
            assert results is kwargs["out"], name
    assert len(issued) == 5, name
    assert records[1] == records[2] == records[3] == records[4] == records[0], name
    assert records[0][3]["seed_val"] == 7 and records[0][3]["offset_val"] == 3, name
    made = list(shortcut_entries(samplers._OP, shortcut.TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__


def test_the_generator_advances_once_a_shortcut_call(issued):
    probs, gen = torch.rand(2, 1000), rtcinfer.Generator(seed=1)
    for _ in range(5):
        rtcinfer.top_p_sampling_from_probs(probs, 0.5, generator=gen)
    assert gen.offset == 5
    assert [r[3]["offset_val"] for r in issued] == [0, 1, 2, 3, 4]
    assert len(shortcut_entries(samplers._OP, shortcut.TAG)) == 1


@pytest.mark.parametrize("kwargs", [
    {"top_k": torch.full((2,), 5, dtype=torch.int32)},  # per-row arrays: call()'s slots
    {"top_k": 5, "indices": torch.tensor([1, 0], dtype=torch.int32)},
    {"top_k": 5, "seed": 11},
    {"top_k": 5, "seed": 11, "offset": 4},
    {"top_k": 5, "return_valid": True},
    {"top_k": True},  # a bool is no count: the function refuses it
])  # fmt: skip
def test_other_calls_take_the_function(issued, kwargs):
    probs = torch.rand(2, 1000)
    for _ in range(3):
        try:
            rtcinfer.top_k_sampling_from_probs(probs, **kwargs)
        except (TypeError, ValueError):
            pass
    assert not shortcut_entries(samplers._OP, shortcut.TAG)


@pytest.mark.parametrize("kwargs", [
    {"top_k": torch.full((2,), 5, dtype=torch.int32)},
    {"top_k": 5, "indices": torch.tensor([1, 0], dtype=torch.int32)},
    {"top_k": 5, "seed": 11},
])  # fmt: skip
def test_a_learnt_signature_is_not_taken_by_calls_the_function_handles_otherwise(issued, kwargs):
    """After the shortcut is learnt for probs of a shape, a call with the same probs but a
    per-row array, indices or a seed issues what the function issues (the output aside)."""
    probs = torch.rand(2, 1000)
    for _ in range(3):
        rtcinfer.top_k_sampling_from_probs(probs, 5, generator=rtcinfer.Generator(seed=1))
    assert shortcut_entries(samplers._OP, shortcut.TAG)
    for public in (rtcinfer.top_k_sampling_from_probs,
                   rtcinfer.top_k_sampling_from_probs.__wrapped__):  # fmt: skip
        extra = {} if "seed" in kwargs else {"generator": rtcinfer.Generator(seed=2)}
        public(probs, **kwargs, **extra)
    shortcut_fields, own_fields = issued[-2][3], issued[-1][3]
    assert {**shortcut_fields, "out": 0} == {**own_fields, "out": 0}
    assert {**shortcut_fields, "out": 0} != {**issued[2][3], "out": 0}


def test_a_repeated_cupy_sampler_call_issues_what_the_function_issues(issued, monkeypatch):
    """The same through the CuPy branch, on CuPy arrays at made-up addresses."""
    cupy = pytest.importorskip("cupy")
    import numpy as np

    from .fakes import cupy_without_a_gpu

    with cupy_without_a_gpu(monkeypatch) as empty:
        records = []
        for n in range(5):
            probs, out = empty((300, 1000), np.float32), empty((300,), np.int32)
            public = rtcinfer.top_k_top_p_sampling_from_probs
            gen = rtcinfer.Generator(seed=5)
            result = (public.__wrapped__ if n == 4 else public)(probs, 7, 0.5, generator=gen,
                                                               out=out)  # fmt: skip
            assert result is out and type(result) is cupy.ndarray
            records.append(pointed(issued[n], (probs, out), lambda a: a.data.ptr))
    assert records[1] == records[2] == records[3] == records[4] == records[0]
    made = list(shortcut_entries(samplers._OP, shortcut.CUPY_TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__


def _one_op_calls():
    probs, logits = torch.rand(300, 1000), torch.randn(3, 1000).to(torch.bfloat16)
    return [
        ("softmax", rtcinfer.softmax, (logits,), {}),
        ("softmax, temperature", rtcinfer.softmax, (logits, 0.7), {}),
        ("top_k_renorm_probs", rtcinfer.top_k_renorm_probs, (probs, 40), {}),
        ("top_p_renorm_probs", rtcinfer.top_p_renorm_probs, (probs, 0.6), {}),
        ("top_k_mask_logits", rtcinfer.top_k_mask_logits, (logits, 9), {}),
    ]


@pytest.mark.parametrize("case", range(5))
def test_softmax_and_the_renorms_issue_what_the_function_issues(issued, monkeypatch, case):
    renorm = importlib.import_module("rtcinfer.sampling.renorm")
    softmax = importlib.import_module("rtcinfer.sampling.softmax")
    ops = [softmax._OP, *renorm._OPS.values()]
    for op in ops:
        monkeypatch.setattr(op, "cache", {})
    records = []
    for n in range(5):
        name, public, args, kwargs = _one_op_calls()[case]
        result = (public.__wrapped__ if n == 4 else public)(*args, **kwargs)
        records.append(pointed(issued[n], (args[0], result), torch.Tensor.data_ptr))
        assert result.shape == args[0].shape, name
    assert records[1] == records[2] == records[3] == records[4] == records[0], name
    made = list(shortcut_entries(ops, shortcut.TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__


def _append_call(records):
    """append_paged_kv_cache's arguments: 3 tokens into a 5-D NHD cache of 4 pages of 16."""
    key, value = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    cache = torch.zeros(4, 2, 16, 2, 64).half()
    batch, pos = torch.tensor([0, 0, 1], dtype=torch.int32), torch.tensor([5, 6, 0]).int()
    indices, indptr = torch.tensor([2, 0, 3], dtype=torch.int32), torch.tensor([0, 2, 3]).int()
    last = torch.tensor([7, 1], dtype=torch.int32)
    return key, value, batch, pos, cache, indices, indptr, last


def test_append_issues_the_functions_block_and_raises_what_was_reported(issued, monkeypatch):
    """append_paged_kv_cache's shortcut (its kernel checks indices on the device): each issued
    block equals the function's own, the cache comes back, and a call after the device
    reported a bad entry raises it, as the function would."""
    page = importlib.import_module("rtcinfer.attention.page")
    monkeypatch.setattr(page._APPEND, "cache", {})
    records = FakeRecords(monkeypatch)
    blocks = []
    for n in range(5):
        args = _append_call(records)
        public = rtcinfer.append_paged_kv_cache
        result = (public.__wrapped__ if n == 4 else public)(*args)
        assert result is args[4]
        kernel, grid, block, fields = pointed(issued[n], args, torch.Tensor.data_ptr)
        fields["v_cache"] -= args[4].data_ptr()  # V's byte offset in the 5-D cache
        blocks.append((kernel, grid, block, fields))
    assert blocks[1] == blocks[2] == blocks[3] == blocks[4] == blocks[0]
    assert blocks[0][3]["v_cache"] == 16 * 2 * 64 * 2  # one page's K, fp16
    assert blocks[0][3]["bad"] == records.buffers[0][0].ctypes.data
    made = list(shortcut_entries(page._APPEND, shortcut.TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__
    records.report(0, BadIndex.KV_INDICES, 1, 9, 4)
    with pytest.raises(rtcinfer.BadIndexError, match="kv_indices"):
        rtcinfer.append_paged_kv_cache(*_append_call(records))
    assert len(issued) == 5  # nothing launched by the call that raised
    rtcinfer.append_paged_kv_cache(*_append_call(records))  # the record is clear again
    assert len(issued) == 6


def test_speculative_sampling_with_counters_takes_the_function(issued, monkeypatch):
    """chain_speculative_sampling's shortcut is for new counters: given ones (updated in
    place) take the function's path, and what it issues names them."""
    spec = importlib.import_module("rtcinfer.sampling.speculative")
    monkeypatch.setattr(spec._OP, "cache", {})
    draft, target = torch.rand(2, 4, 1000), torch.rand(2, 5, 1000)
    ids = torch.randint(0, 1000, (2, 4), dtype=torch.int32)
    for _ in range(3):
        rtcinfer.chain_speculative_sampling(draft, ids, target, generator=rtcinfer.Generator())
    assert shortcut_entries(spec._OP, shortcut.TAG)
    accepted, emitted = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    _, got_accepted, got_emitted = rtcinfer.chain_speculative_sampling(
        draft, ids, target, accepted, emitted, generator=rtcinfer.Generator()
    )
    assert got_accepted is accepted and got_emitted is emitted
    fields = issued[-1][3]
    assert fields["accepted"] == accepted.data_ptr() and fields["emitted"] == emitted.data_ptr()
    assert fields["accumulate"] == 1
