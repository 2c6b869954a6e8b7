"""The public functions' CuPy shortcut (interop/shortcut.py) without a GPU: a repeated call on
CuPy arrays launches what the function's own path launches (the recorded launches: kernel,
geometry and parameter block, the fresh outputs' addresses aside), returns CuPy arrays of the
same shapes and dtypes (the given ones where the call writes in place), and is not taken where
call() would do something else. The arrays lie at made-up addresses (tests/fakes.py)."""

from __future__ import annotations

import importlib
import struct
from types import SimpleNamespace

import numpy as np
import pytest

import rtcinfer
from rtcinfer import launch
from rtcinfer.interop import shortcut

from .fakes import (
    FakeRecords,
    cupy_without_a_gpu,
    fake_gpu,
    issued_launches,
    noted,
    pointed,
    shortcut_entries,
)

cupy = pytest.importorskip("cupy")

_SAMPLING = importlib.import_module("rtcinfer.sampling.samplers")
_SOFTMAX = importlib.import_module("rtcinfer.sampling.softmax")
_RENORM = importlib.import_module("rtcinfer.sampling.renorm")
_OPS = (rtcinfer.norm._PLAIN, rtcinfer.norm._FUSED, rtcinfer.norm._QUANT,
        rtcinfer.activation._OP, rtcinfer.rope._POS_IDS, rtcinfer.rope._RAGGED,
        rtcinfer.attention.cascade._MERGE, rtcinfer.attention.cascade._STATES,
        _SAMPLING._OP, _SOFTMAX._OP, *_RENORM._OPS.values(),
        importlib.import_module("rtcinfer.sampling.speculative")._OP)  # fmt: skip


@pytest.fixture
def empty(monkeypatch):
    """empty(shape, dtype): a CuPy array of device 0 at a made-up address (one GPU)."""
    fake_gpu(monkeypatch)
    monkeypatch.setattr(rtcinfer.jit, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch.Kernel, "occupancy", lambda self, device, threads: 4)
    monkeypatch.setattr(rtcinfer.jit, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(_SAMPLING, "compute_capability", lambda device: 90)
    monkeypatch.setattr(_SOFTMAX, "compute_capability", lambda device: 90)
    for op in _OPS:
        monkeypatch.setattr(op, "cache", {})
    with cupy_without_a_gpu(monkeypatch) as ndarray:
        yield ndarray


def _calls(empty):
    f16, i32 = np.float16, np.int32
    x, r = empty((3, 256), f16), empty((3, 256), f16)
    w = empty((256,), f16)
    fp8, scale = empty((3, 256), np.uint8), empty((1,), np.float32)
    e5m2 = {"out_dtype": "e5m2"}
    gate = empty((2, 512), f16)
    q, k, pos = empty((4, 8, 128), f16), empty((4, 2, 128), f16), empty((4,), i32)
    indptr, offsets = empty((3,), i32), empty((2,), i32)
    va, sa = empty((2, 4, 128), f16), empty((2, 4), np.float32)
    v, s = empty((2, 3, 4, 128), f16), empty((2, 3, 4), np.float32)
    probs, logits = empty((300, 1000), np.float32), empty((3, 1000), f16)
    return [
        ("rmsnorm", rtcinfer.rmsnorm, (x, w), {"eps": 1e-5}),
        ("rmsnorm, out given", rtcinfer.rmsnorm, (x, w), {"out": empty((3, 256), f16)}),
        ("gemma_rmsnorm", rtcinfer.gemma_rmsnorm, (x, w), {}),
        ("fused_add_rmsnorm", rtcinfer.fused_add_rmsnorm, (x, r, w), {}),
        ("rmsnorm_quant", rtcinfer.rmsnorm_quant, (fp8, x, w, scale), {"out_dtype": "e4m3"}),
        ("fused_add_rmsnorm_quant", rtcinfer.fused_add_rmsnorm_quant, (fp8, x, r, w, scale), e5m2),
        ("silu_and_mul", rtcinfer.silu_and_mul, (gate,), {}),
        ("silu_and_mul, out given", rtcinfer.silu_and_mul, (gate, empty((2, 256), f16)), {}),
        ("rope", rtcinfer.apply_rope_pos_ids_inplace, (q, k, pos), {"rope_theta": 5e5}),
        ("llama31_rope", rtcinfer.apply_llama31_rope_pos_ids_inplace, (q, k, pos), {}),
        ("ragged_rope", rtcinfer.apply_rope_inplace, (q, k, indptr, offsets), {}),
        ("merge_state", rtcinfer.merge_state, (va, sa, va, sa), {}),
        ("merge_states", rtcinfer.merge_states, (v, s), {}),
        # calls whose scalars are drawn per call (a fresh generator each): the issues test only
        ("top_k_top_p_sampling", rtcinfer.top_k_top_p_sampling_from_probs, (probs, 7, 0.5),
         {"generator": rtcinfer.Generator(seed=5)}),
        ("sampling, out given", rtcinfer.sampling_from_probs, (probs,),
         {"generator": rtcinfer.Generator(seed=5), "out": empty((300,), i32)}),
        ("softmax", rtcinfer.softmax, (logits, 0.5), {}),
        ("top_k_mask_logits", rtcinfer.top_k_mask_logits, (logits, 9), {}),
        ("chain_speculative_sampling", rtcinfer.chain_speculative_sampling,
         (empty((2, 4, 1000), np.float32), empty((2, 4), i32), empty((2, 5, 1000), np.float32)),
         {"generator": rtcinfer.Generator(seed=5)}),
    ]  # fmt: skip


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _blanked(record, results) -> tuple:
    """A recorded launch with the addresses of the call's new outputs zeroed."""
    blob = record.params
    for a in results:
        blob = blob.replace(struct.pack("<Q", a.data.ptr), bytes(8))
    return record.kernel.name, record.grid, record.block, blob


@pytest.mark.parametrize("case", range(13))
def test_a_repeated_cupy_call_launches_what_the_function_launches(empty, case):
    name, public, args, kwargs = _calls(empty)[case]
    op_caches = [dict(op.cache) for op in _OPS]
    with launch.recording() as steps:
        public(*args, **kwargs)  # the function's path: the signature noted
        first = _as_tuple(public(*args, **kwargs))  # the function's path, then learnt
        learnt = list(_shortcuts())
        second = _as_tuple(public(*args, **kwargs))  # the shortcut
        third = _as_tuple(public.__wrapped__(*args, **kwargs))  # the function itself
    assert op_caches == [{}] * len(_OPS)
    assert len(learnt) == 1 and callable(_shortcuts()[learnt[0]]), name
    assert len(steps) == 4, name
    steps = steps[1:]
    for r in (first, second, third):
        assert all(type(a) is cupy.ndarray for a in r), name
    shapes = [[(a.shape, a.dtype, a.strides) for a in r] for r in (first, second, third)]
    assert shapes[0] == shapes[1] == shapes[2], name
    given = [a.data.ptr for a in (*args, *kwargs.values()) if isinstance(a, cupy.ndarray)]
    for a, b in zip(second, third, strict=True):
        assert (a.data.ptr in given) == (b.data.ptr in given), name
    assert len({a.data.ptr for a in (*first, *second)} - set(given)) == 2 * len(
        [a for a in first if a.data.ptr not in given]
    ), name  # new outputs are new arrays at each call
    records = [_blanked(s, r) for s, r in zip(steps, (first, second, third), strict=True)]
    assert records[1] == records[2] == records[0], name


@pytest.mark.parametrize("case", range(18))
def test_a_repeated_cupy_call_issues_what_the_function_issues(empty, monkeypatch, case):
    """Outside a recording the CuPy shortcut fills the launch's parameters and issues it
    itself: each issued block (its fields at issue time, a pointer as the argument or result
    it points to) is the one the function's path issues."""
    issued = issued_launches(monkeypatch)
    records = []
    for n in range(5):  # seen, learnt, the shortcut twice, the function itself: fresh arrays
        name, public, args, kwargs = _calls(empty)[case]
        results = _as_tuple((public.__wrapped__ if n == 4 else public)(*args, **kwargs))
        arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, cupy.ndarray)]
        records.append(pointed(issued[n], (*arrays, *results), lambda a: a.data.ptr))
    assert len(issued) == 5, name
    assert records[1] == records[2] == records[3] == records[4] == records[0], name
    (made,) = _shortcuts().values()  # the launcher its first issue made, with the issuer
    assert "snapshot_issuer" in made.__globals__["_issue"].__qualname__, name


def _shortcuts() -> dict:
    return shortcut_entries(_OPS, shortcut.CUPY_TAG)


def test_the_cupy_shortcut_is_learnt_once_and_not_taken_for_other_calls(empty):
    path = importlib.import_module("rtcinfer.interop.call")
    x, w = empty((3, 256), np.float16), empty((256,), np.float16)
    with launch.recording() as steps:
        rtcinfer.rmsnorm(x, w)
        assert _shortcuts() == {} and noted(rtcinfer.norm._PLAIN)  # seen once: noted, by hash
        rtcinfer.rmsnorm(x, w)
        assert len(_shortcuts()) == 1 and callable(*_shortcuts().values())  # then learnt
        out = empty((3, 256), np.float16)
        assert rtcinfer.rmsnorm(x, w, 1e-6, out) is out  # a given output: another signature
        assert rtcinfer.rmsnorm(x, w, 1e-6, out) is out  # ... learnt
        strided = empty((3, 512), np.float16)[:, :256]
        assert rtcinfer.rmsnorm(x, w, 1e-6, strided) is strided  # its strides: another
        rtcinfer.rmsnorm(x[:, :128], w[:128])  # another signature, strided input: learnt too
        rtcinfer.rmsnorm(x[:, :128], w[:128])
        with path.launching_on(5):  # another stream: the function's path (which refuses)
            with pytest.raises(RuntimeError, match="must be given its outputs"):
                rtcinfer.rmsnorm(x, w)
        with pytest.raises(ValueError):  # a given output of another shape: call() refuses
            rtcinfer.rmsnorm(x, w, 1e-6, empty((3, 128), np.float16))
        with pytest.raises(ValueError):
            rtcinfer.rmsnorm(x, w, 1e-6, empty((3, 128), np.float16))  # and again
    assert len(steps) == 7
    assert steps[3].params != steps[4].params  # the strided output's row stride
    assert [callable(v) for v in _shortcuts().values()] == [True, True, True]  # (strided: noted)
    assert [s.grid for s in steps[5:7]] == [steps[5].grid] * 2


def test_a_cupy_call_with_a_dense_copy_keeps_to_the_function(empty, monkeypatch):
    """A signature whose prepared call copies an input dense is learnt as no shortcut (False),
    and its later calls take the function's path (which makes the copy)."""
    x, w = empty((3, 256), np.float16), empty((256,), np.float16)
    path = importlib.import_module("rtcinfer.interop.call")
    prepare = path._prepare

    def densifying(*args, **kwargs):
        prep = prepare(*args, **kwargs)
        prep.dense = (1,)
        return prep

    monkeypatch.setattr(path, "_prepare", densifying)
    copied = []
    monkeypatch.setattr(path, "_densify_cupy", lambda op, prep, arrays, ptrs, stream:
                        (copied.append(1), (arrays, ptrs))[1])  # fmt: skip
    with launch.recording() as steps:
        for _ in range(3):
            rtcinfer.rmsnorm(x, w)
    assert len(steps) == 3 and len(copied) == 3
    assert list(_shortcuts().values()) == [False]


def test_a_repeated_cupy_append_issues_what_the_function_issues(empty, monkeypatch):
    """append_paged_kv_cache's CuPy shortcut (its kernel checks indices: the record's fields
    and the check before the launch come with it): the function's block, the cache returned."""
    page = importlib.import_module("rtcinfer.attention.page")
    monkeypatch.setattr(page._APPEND, "cache", {})
    FakeRecords(monkeypatch)
    issued = issued_launches(monkeypatch)
    blocks = []
    for n in range(5):
        args = (empty((3, 2, 64), np.float16), empty((3, 2, 64), np.float16),
                empty((3,), np.int32), empty((3,), np.int32), empty((4, 2, 16, 2, 64), np.float16),
                empty((3,), np.int32), empty((3,), np.int32), empty((2,), np.int32))  # fmt: skip
        public = rtcinfer.append_paged_kv_cache
        assert (public.__wrapped__ if n == 4 else public)(*args) is args[4]
        kernel, grid, block, fields = pointed(issued[n], args, lambda a: a.data.ptr)
        fields["v_cache"] -= args[4].data.ptr  # V's byte offset in the 5-D cache
        blocks.append((kernel, grid, block, fields))
    assert blocks[1] == blocks[2] == blocks[3] == blocks[4] == blocks[0]
    made = list(shortcut_entries(page._APPEND, shortcut.CUPY_TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__


def test_a_process_with_two_gpus_keeps_to_the_function(empty, monkeypatch):
    """Several GPUs: the first call learns no shortcut and turns the branches off, so later
    calls cost one test before call()'s path (which picks the device)."""
    fake_gpu(monkeypatch, devices=2)
    x, w = empty((3, 256), np.float16), empty((256,), np.float16)
    with launch.recording() as steps:  # (conftest.py turns them on again after the test)
        for _ in range(3):
            rtcinfer.rmsnorm(x, w)
    assert len(steps) == 3 and shortcut.ENABLED == [False]
    assert list(_shortcuts().values()) == [False]


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_repeated_cupy_single_decode_issues_what_the_function_issues(empty, monkeypatch,
                                                                         return_lse):  # fmt: skip
    """single_decode_with_kv_cache's shortcut (an unsplit plan: one launch, its scale a
    product Fill writes): the function's block, o (and lse) new each call."""
    sd = importlib.import_module("rtcinfer.attention.single_decode")
    monkeypatch.setattr(sd, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(sd, "ctas_per_sm", lambda spec, device: 2)
    monkeypatch.setattr(sd, "device_copy", lambda host, device, what: SimpleNamespace(ptr=4096))
    monkeypatch.setattr(sd._OP, "cache", {})
    issued = issued_launches(monkeypatch)
    blocks = []
    for n in range(5):
        q, k, v = empty((32, 128), np.float16), *(empty((64, 8, 128), np.float16),) * 2
        public = rtcinfer.single_decode_with_kv_cache
        kwargs = {"sm_scale": 0.1, "k_scale": 0.5, "return_lse": return_lse}
        result = _as_tuple((public.__wrapped__ if n == 4 else public)(q, k, v, **kwargs))
        assert [a.shape for a in result] == [(32, 128), (32,)][: 1 + return_lse]
        blocks.append(pointed(issued[n], (q, k, *result), lambda a: a.data.ptr))
    assert blocks[1] == blocks[2] == blocks[3] == blocks[4] == blocks[0]
    assert blocks[0][3]["qk_scale"] == pytest.approx(0.05, rel=1e-6)  # sm_scale x k_scale
    assert blocks[0][3]["lse"] == ("array 3" if return_lse else None)  # (None: a NULL pointer)
    made = list(shortcut_entries(sd._OP, shortcut.CUPY_TAG).values())
    assert len(made) == 1 and "snapshot_issuer" in made[0].__globals__["_issue"].__qualname__


def test_an_op_keeps_a_bounded_number_of_signatures(empty, monkeypatch):
    """Past MAX_SIGNATURES prepared calls (and shortcuts) an op's cache starts over: a server's
    ever new token counts hold a bounded number of launches; each call still launches its
    own rows."""
    path = importlib.import_module("rtcinfer.interop.call")
    monkeypatch.setattr(path, "MAX_SIGNATURES", 4)
    w = empty((256,), np.float16)
    sizes = []
    with launch.recording() as steps:
        for rows in (1, 2, 3, 4, 5, 6, 7, 2, 2, 2):
            rtcinfer.rmsnorm(empty((rows, 256), np.float16), w)
            sizes.append(len(rtcinfer.norm._PLAIN.cache))
    assert max(sizes) <= 4 + 1  # (a shortcut noted after its call's prepare)
    assert [s.grid[0] for s in steps] == [1, 2, 3, 4, 5, 6, 7, 2, 2, 2]
