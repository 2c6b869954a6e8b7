"""The public functions' PyTorch shortcut (interop/shortcut.py) without a GPU: a repeated call
launches what the function's own path launches (the recorded launches: kernel, geometry and
parameter block, the freshly allocated outputs' addresses aside), returns the same kind of
results, and is not taken where call() would do something else (PyTorch CPU tensors stand
in for CUDA ones; the stream and device queries are faked)."""

from __future__ import annotations

import importlib
import struct

import numpy as np
import pytest

import rtcinfer
from rtcinfer import launch
from rtcinfer.interop import shortcut

from .fakes import issued_launches, noted, pointed, shortcut_entries, torch_as_cuda

torch = pytest.importorskip("torch")
path = importlib.import_module("rtcinfer.interop.call")


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU tensors taken as CUDA tensors of device 0 (one GPU), their stream 7."""
    torch_as_cuda(monkeypatch)
    for op in (rtcinfer.norm._PLAIN, rtcinfer.norm._FUSED, rtcinfer.activation._OP,
               rtcinfer.rope._POS_IDS, rtcinfer.rope._RAGGED,
               rtcinfer.attention.cascade._MERGE):  # fmt: skip
        monkeypatch.setattr(op, "cache", {})


def _blanked(record, results) -> tuple:
    """A recorded launch with the addresses of the call's new outputs zeroed (they differ
    from call to call)."""
    blob = record.params
    for t in results:
        address = struct.pack("<Q", t.data_ptr())
        blob = blob.replace(address, bytes(8))
    return record.kernel.name, record.grid, record.block, blob


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _calls():
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(256).to(torch.bfloat16), requires_grad=False)
    r = torch.randn(3, 256).to(torch.bfloat16)
    gate = torch.randn(2, 512).to(torch.float16)
    q = torch.randn(4, 8, 128).to(torch.bfloat16)
    k = torch.randn(4, 2, 128).to(torch.bfloat16)
    pos = torch.arange(4, dtype=torch.int32)
    indptr, offsets = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([7, 0]).int()
    va, sa = torch.randn(2, 4, 128).to(torch.float16), torch.randn(2, 4)
    return [
        ("rmsnorm", rtcinfer.rmsnorm, (x, w), {"eps": 1e-5}),
        ("rmsnorm, out given", rtcinfer.rmsnorm, (x, w), {"out": torch.empty_like(x)}),
        ("fused_add_rmsnorm", rtcinfer.fused_add_rmsnorm, (x, r, w), {}),
        ("silu_and_mul", rtcinfer.silu_and_mul, (gate,), {}),
        ("silu_and_mul, out given", rtcinfer.silu_and_mul, (gate, torch.empty(2, 256).half()), {}),
        ("rope", rtcinfer.apply_rope_pos_ids_inplace, (q, k, pos), {"rope_theta": 5e5}),
        ("llama31_rope", rtcinfer.apply_llama31_rope_pos_ids_inplace, (q, k, pos), {}),
        ("ragged_rope", rtcinfer.apply_rope_inplace, (q, k, indptr, offsets), {}),
        ("merge_state", rtcinfer.merge_state, (va, sa, va, sa), {}),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_repeated_call_launches_what_the_function_launches(cuda_like, case):
    name, public, args, kwargs = _calls()[case]
    with launch.recording() as steps:
        public(*args, **kwargs)  # the function's path: the signature noted
        first = _as_tuple(public(*args, **kwargs))  # the function's path, then learnt
        second = _as_tuple(public(*args, **kwargs))  # the shortcut
        third = _as_tuple(public.__wrapped__(*args, **kwargs))  # the function itself
    assert len(steps) == 4, name
    steps = steps[1:]
    shapes = [[(tuple(t.shape), t.dtype) for t in r] for r in (first, second, third)]
    assert shapes[0] == shapes[1] == shapes[2], name
    given = [a.data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    for t, u in zip(second, third, strict=True):
        assert (t.data_ptr() in given) == (u.data_ptr() in given), name
    records = [_blanked(s, r) for s, r in zip(steps, (first, second, third), strict=True)]
    assert records[1] == records[2] == records[0], name


@pytest.mark.parametrize("case", range(9))
def test_a_repeated_call_issues_what_the_function_issues(cuda_like, monkeypatch, case):
    """Outside a recording the shortcut fills the launch's parameters and issues it itself
    (interop/shortcut.py's _launcher): each issued block (taken at issue time, as the driver
    copies it) is the one the function's own path issues."""
    issued = issued_launches(monkeypatch)
    records = []
    for n in range(5):  # seen, learnt, the shortcut twice, the function itself: fresh arrays
        name, public, args, kwargs = _calls()[case]
        results = _as_tuple((public.__wrapped__ if n == 4 else public)(*args, **kwargs))
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        records.append(pointed(issued[n], (*tensors, *results), torch.Tensor.data_ptr))
    assert len(issued) == 5 and {i[4] for i in issued} == {7}, name
    assert records[1] == records[2] == records[3] == records[4] == records[0], name
    # the shortcut issued (its first issue put the launcher made with the issuer in its place)
    made = [fn for fn in _ops_caches() if hasattr(fn, "__code__")]
    assert len(made) == 1, name
    assert "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__, name


def _ops_caches():
    """Every value in the shortcut ops' caches."""
    for op in (rtcinfer.norm._PLAIN, rtcinfer.norm._FUSED, rtcinfer.activation._OP,
               rtcinfer.rope._POS_IDS, rtcinfer.rope._RAGGED,
               rtcinfer.attention.cascade._MERGE):  # fmt: skip
        yield from op.cache.values()


def test_the_shortcut_is_learnt_once_and_not_taken_for_other_calls(cuda_like):
    op = rtcinfer.norm._PLAIN
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = torch.randn(256).to(torch.bfloat16)

    def shortcuts():
        return shortcut_entries(op, shortcut.TAG)

    with launch.recording() as steps:
        rtcinfer.rmsnorm(x, w)
        assert shortcuts() == {} and noted(op)  # seen once: noted by its hash, nothing learnt
        rtcinfer.rmsnorm(x, w)
        assert len(shortcuts()) == 1 and callable(*shortcuts().values())  # the second: learnt
        out = torch.empty_like(x)
        for _ in range(3):  # a given output: another signature (noted, learnt, the shortcut)
            assert rtcinfer.rmsnorm(x, w, 1e-6, out) is out
        strided = torch.empty(3, 512).to(torch.bfloat16)[:, :256]
        assert rtcinfer.rmsnorm(x, w, 1e-6, strided) is strided  # its strides: another
        rtcinfer.rmsnorm(x[:, :128].contiguous(), w[:128])  # another signature: noted too
        with path.launching_on(5):  # another stream: the function's path (which refuses)
            with pytest.raises(RuntimeError, match="must be given its outputs"):
                rtcinfer.rmsnorm(x, w)
        with pytest.raises(ValueError):  # a given output of another shape: call() refuses
            rtcinfer.rmsnorm(x, w, 1e-6, torch.empty(3, 128).to(torch.bfloat16))
    assert len(steps) == 7
    assert steps[4].params != steps[5].params  # the strided output's row stride
    assert [callable(v) for v in shortcuts().values()] == [True, True]  # the others noted
    silu = rtcinfer.activation._OP
    gate = torch.randn(2, 512).to(torch.float16)
    for _ in range(3):
        with launch.recording():
            y = rtcinfer.silu_and_mul(gate)
    assert tuple(y.shape) == (2, 256)
    # the prepared call, its rows model, the shortcut's note (its first call) and the shortcut
    np.testing.assert_equal((len(silu.cache), noted(silu)), (4, 1))
