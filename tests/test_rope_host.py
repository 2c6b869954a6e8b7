"""RoPE without a GPU: the argument checks of each call signature (the public functions'
prepare step, on host arrays taken as device ones) and the launch each signature prepares."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rtcinfer
from rtcinfer import errors, jit, rope
from rtcinfer import rope_table as rope_table_module
from rtcinfer.interop import ArrayInfo
from rtcinfer.interop.dtypes import normalize
from rtcinfer.launch import Kernel
from rtcinfer.rope_table import TABLE_PAIRS, frequency_table, table_writer

from . import reference as ref
from .fakes import FakeRecords, launched

Q = np.zeros((3, 4, 64), np.float16)
K = np.zeros((3, 2, 64), np.float16)
CACHE = np.zeros((16, 64), np.float32)
SMS, OCCUPANCY = 132, 2


def info(x: np.ndarray) -> ArrayInfo:
    """A host array as prepare sees a device array (strides in elements)."""
    return ArrayInfo(x.shape, tuple(s // x.itemsize for s in x.strides), normalize(x.dtype), 0)


@pytest.fixture
def prepare(monkeypatch):
    """The public functions stop at what call() does for a new signature (host arrays seen as
    device ones, slot i's address `offsets[i]` bytes past a 16-byte boundary) and return
    (Prepared, scalars)."""
    offsets = {}

    def prepare_only(op, arrays, static=(), scalars=()):
        infos = [None if x is None else info(x)._replace(offset=offsets.get(i, 0))
                 for i, x in enumerate(arrays)]  # fmt: skip
        align = min((i.align for i in infos if i is not None), default=16)
        return op.prepare(infos, align, static), scalars

    monkeypatch.setattr(rope, "call", prepare_only)
    monkeypatch.setattr(jit, "sm_count", lambda device: SMS)
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: OCCUPANCY)
    return offsets


@pytest.fixture(autouse=True)
def records(monkeypatch):
    """The devices' records of bad entries (read by the cos/sin cache form), in host memory."""
    return FakeRecords(monkeypatch)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(
            np.arange(3), np.zeros((3, 4, 128), np.float16), K, 64, CACHE), ValueError,
         r"must be \[nnz, heads, 64\] or \[nnz, heads \* 64\]"),
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(np.arange(3), Q, K, 0, CACHE), ValueError,
         "head_dim must be at least 1"),
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(np.arange(3), Q, K, 64, CACHE[:, None]),
         TypeError, r"cos_sin_cache: expected float32 \[max_pos, rotary_dim\], got float32 "
         r"\(16, 1, 64\)"),
        (lambda: rtcinfer.apply_rope_with_cos_sin_cache(np.arange(3.0), Q, K, 64, CACHE),
         TypeError, "positions: dtype must be int32 or int64, got float64"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K, np.arange(1)), ValueError,
         r"pos_ids: expected shape \(3,\), got \(1,\)"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K, np.zeros((3, 3), np.int32)), ValueError,
         r"pos_ids: expected shape \(3,\), got \(3, 3\)"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K.astype(np.float32), np.arange(3)), TypeError,
         "q and k must share a float dtype, got float16 and float32"),
        (lambda: rtcinfer.apply_rope_pos_ids_inplace(Q, K, np.arange(3), rotary_dim=66),
         ValueError, r"rotary_dim \(66\) must be even and in \(0, 64\]"),
        (lambda: rtcinfer.apply_rope(Q, K, np.zeros(1, np.int32), np.zeros(0, np.int32)),
         ValueError, "3 tokens need at least one request"),
        (lambda: rtcinfer.apply_rope(Q, K, np.zeros(1, np.int32), np.zeros(4, np.int32)),
         ValueError, r"indptr and offsets must be \[B \+ 1\] and \[B\], got \(1,\) and \(4,\)"),
        (lambda: rtcinfer.apply_llama31_rope_inplace(Q, K, np.zeros(2, np.int32),
                                                     np.zeros(1, np.int64)),
         TypeError, r"indptr \(int32\) and offsets must share a dtype"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q, K, np.arange(3), out=(Q, K[:, :1])), ValueError,
         r"out\[1\]: expected shape \(3, 2, 64\) and dtype float16, got shape \(3, 1, 64\)"),
        (lambda: rtcinfer.apply_rope_pos_ids(Q[:, :, ::2], K[:, :, ::2], np.arange(3)),
         ValueError, r"the head dimension must be contiguous, got strides \(256, 64, 2\)"),
    ],
)  # fmt: skip
def test_arguments_are_checked(prepare, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_zero_heads_launch_nothing(prepare, monkeypatch):
    monkeypatch.setattr(jit, "get_function", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(jit, "sm_count", lambda device: pytest.fail("planned"))
    q, k = np.zeros((3, 0, 64), np.float16), np.zeros((3, 0, 64), np.float16)
    prep, scalars = rtcinfer.apply_rope_pos_ids(q, k, np.arange(3, dtype=np.int32))
    assert [o.shape for o in prep.outs] == [(3, 0, 64), (3, 0, 64)]
    prep.preload(0)
    prep.run(0, 0, [0x100, 0x200, 0x300, 0, 0, 0x400, 0x500], scalars)


def test_pos_ids_in_place(prepare, monkeypatch):
    """In place: the kernel reads and writes the outputs (under JAX, XLA's copies of q and k);
    the persistent grid covers the work items."""
    base = np.zeros((4, 32, 2 * 128), ml_dtypes.bfloat16)
    q, k = base[:, :, :128], np.zeros((4, 8, 128), ml_dtypes.bfloat16)
    prep, scalars = rtcinfer.apply_rope_pos_ids_inplace(q, k, np.arange(4, dtype=np.int32),
                                                        rope_scale=2, rope_theta=5e5)  # fmt: skip
    assert scalars == (2.0, 5e5)
    assert [(o.shape, o.source, o.alias) for o in prep.outs] == [
        ((4, 32, 128), 0, True), ((4, 8, 128), 1, True)
    ]  # fmt: skip
    assert prep.dense == ()  # dense positions: nothing to check per call
    ptrs = [0x1000, 0x2000, 0x3000, 0, 0, 0x6000, 0x7000]
    launch, p = launched(monkeypatch, prep, ptrs, scalars)
    spec = launch.kernel.spec
    assert spec == rope.RopeSpec("bfloat16", "int32", 128, 128, False, "theta", "pos_ids", True, 8)
    assert (p["q"], p["q_out"], p["k"], p["k_out"], p["pos_ids"]) == (
        0x6000, 0x6000, 0x7000, 0x7000, 0x3000
    )  # fmt: skip
    assert (p["rope_scale"], p["rope_theta"]) == (2.0, 5e5)
    assert list(p["freq"])[: 2 * 64] == frequency_table("theta", 128, (2.0, 5e5)).ravel().tolist()
    assert (p["q_tok"], p["q_head"], p["k_tok"], p["k_head"]) == (8192, 256, 1024, 128)
    assert (p["qo_tok"], p["qo_head"], p["ko_tok"], p["ko_head"]) == (8192, 256, 1024, 128)
    assert (p["nnz"], p["num_q_heads"], p["num_k_heads"], p["batch_size"]) == (4, 32, 8, 0)
    # 4 tokens are too few: each token's 40 rows are 40 items of one row; 16 items a CTA.
    assert p["rows_per_item"] == 1 and launch.grid == (10, 1, 1)


def test_ragged_llama31_into_given_outs(prepare, monkeypatch):
    q, k = np.zeros((5000, 8, 128), np.float16), np.zeros((5000, 1, 128), np.float16)
    q_out, k_out = np.zeros_like(q), np.zeros_like(k)
    indptr, offsets = np.array([0, 1000, 5000], np.int64), np.array([7, 9], np.int64)
    prep, scalars = rtcinfer.apply_llama31_rope(q, k, indptr, offsets, rotary_dim=64,
                                                out=(q_out, k_out))  # fmt: skip
    assert scalars == (8.0, 5e5, 1.0, 4.0, 8192.0)
    assert [(o.source, o.alias) for o in prep.outs] == [(4, False), (5, False)]
    assert prep.dense == ()
    ptrs = [1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12, 6 << 12, 5 << 12, 6 << 12]
    launch, p = launched(monkeypatch, prep, ptrs, scalars)
    assert launch.kernel.spec == rope.RopeSpec("float16", "int64", 128, 64, False, "llama31",
                                               "indptr", False, 8)  # fmt: skip
    assert (p["q"], p["k"], p["q_out"], p["k_out"]) == (1 << 12, 2 << 12, 5 << 12, 6 << 12)
    assert (p["indptr"], p["offsets"], p["batch_size"]) == (3 << 12, 4 << 12, 2)
    assert (p["old_context_len"], p["high_freq_factor"]) == (8192.0, 4.0)
    table = frequency_table("llama31", 64, scalars).ravel().tolist()
    assert list(p["freq"])[: 2 * 32] == table
    # Tokens enough to fill the GPU: an item is a whole token (9 rows, in batches of 8), 16 items
    # a CTA, and no more CTAs than fit at once.
    assert p["rows_per_item"] == 16 and launch.grid == (SMS * OCCUPANCY, 1, 1)


def test_cos_sin_cache_on_flattened_heads(prepare, monkeypatch):
    """[nnz, H * head_size] rows; rotary_dim is the table's width; is_neox=False interleaves;
    strided positions and table are made dense before the launch."""
    q, k = np.zeros((5, 4 * 64), np.float32), np.zeros((5, 64), np.float32)
    positions, cache = np.arange(10)[::2], np.zeros((100, 2 * 32), np.float32)[:, :32]
    prep, scalars = rtcinfer.apply_rope_with_cos_sin_cache(positions, q, k, 64, cache,
                                                           is_neox=False)  # fmt: skip
    assert scalars == () and prep.dense == (2, 3)  # strided: made dense first
    ptrs = [0x100, 0x200, 0x300, 0x400, 0, 0, 0x700, 0x800]
    launch, p = launched(monkeypatch, prep, ptrs, scalars)
    assert launch.kernel.spec == rope.RopeSpec("float32", "int64", 64, 32, True, "cos_sin_cache",
                                               "pos_ids", False, 4)  # fmt: skip
    assert (p["pos_ids"], p["cos_sin_cache"], p["q_out"], p["k_out"]) == (0x300, 0x400, 0x700,
                                                                         0x800)  # fmt: skip
    assert (p["q_tok"], p["q_head"], p["k_tok"], p["k_head"]) == (256, 64, 64, 64)
    assert (p["num_q_heads"], p["num_k_heads"]) == (4, 1)
    rec = errors.record(0)
    assert (p["max_pos"], p["bad"], p["bad_host"]) == (100, rec.device_ptr, rec.host_ptr)


def test_a_position_outside_the_cos_sin_cache_is_raised_by_the_next_call(prepare, monkeypatch,
                                                                         records):  # fmt: skip
    """What the kernel reported (faked here) stops the next cos/sin-cache call before it
    launches; the forms that compute their angles read no table and do not look."""
    q, k = np.zeros((5, 4, 64), np.float32), np.zeros((5, 1, 64), np.float32)
    positions = np.arange(5)
    prep, scalars = rtcinfer.apply_rope_with_cos_sin_cache(positions, q, k, 64, CACHE)
    ptrs = [0x100, 0x200, 0x300, 0x400, 0, 0, 0x700, 0x800]
    launched(monkeypatch, prep, ptrs, scalars)
    records.report(0, errors.BadIndex.COS_SIN_POSITIONS, 3, 16, 16)
    theta, theta_scalars = rtcinfer.apply_rope_pos_ids(q, k, positions)
    launched(monkeypatch, theta, [0x100, 0x200, 0x300, 0, 0, 0x700, 0x800], theta_scalars)
    message = (r"^apply_rope_with_cos_sin_cache: positions\[3\] = 16 is not a row of "
               r"cos_sin_cache \(0 <= position < 16\); its token passed through unrotated, no "
               r"row read$")  # fmt: skip
    with pytest.raises(rtcinfer.BadIndexError, match=message):
        prep.run(7, 0, ptrs, scalars)
    assert records.log == [("clear", 0, 7)] and records.host_row(0)["count"] == 0
    launched(monkeypatch, prep, ptrs, scalars)  # cleared
    records.report(0, errors.BadIndex.COS_SIN_POSITIONS, 3, 16, 16)
    with pytest.raises(rtcinfer.BadIndexError, match=message):  # the RoPE kernel keeps no count
        rtcinfer.check_errors()


def test_position_arrays_do_not_narrow_the_vectors(prepare, monkeypatch):
    """A position array aligned to 4 bytes leaves q's and k's vectors alone; q aligned to 8
    bytes narrows them to 4 fp16; q aligned to 4 bytes cannot split a 128-wide row over one
    warp."""
    q, k, pos = (
        np.zeros((64, 8, 128), np.float16),
        np.zeros((64, 2, 128), np.float16),
        np.arange(64),
    )
    prepare[2] = 4
    prep, scalars = rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
    launch, _ = launched(monkeypatch, prep, [0x100, 0x200, 0x304, 0, 0, 0x100, 0x200], scalars)
    assert launch.kernel.spec.vec == 8
    prepare[0] = 8
    prep, scalars = rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)
    launch, _ = launched(monkeypatch, prep, [0x108, 0x200, 0x304, 0, 0, 0x108, 0x200], scalars)
    assert launch.kernel.spec.vec == 4
    prepare[0] = 4
    with pytest.raises(ValueError, match="q and k rows are not aligned to 8 elements"):
        rtcinfer.apply_rope_pos_ids_inplace(q, k, pos)  # 64 lanes of 2


@pytest.mark.parametrize("mode, scalars", [
    ("theta", (1.0, 1e4)), ("theta", (2.5, 5e5)), ("llama31", (8.0, 5e5, 1.0, 4.0, 8192.0)),
    ("llama31", (32.0, 1e6, 2.0, 16.0, 4096.0)),
])  # fmt: skip
@pytest.mark.parametrize("rotary_dim", [64, 128, 512])
def test_frequency_table_is_the_float64_frequency_split_in_two_floats(mode, scalars,
                                                                     rotary_dim):  # fmt: skip
    """hi + lo is the fp64 frequency (in turns per position) of every pair to ~2^-48 relative:
    pos * f keeps its fractional turn for positions below 2^24; heads wider than 256 get the
    first 128 pairs (the kernel computes the others)."""
    table = frequency_table(mode, rotary_dim, scalars)
    pairs = min(rotary_dim // 2, TABLE_PAIRS)
    assert table.shape == (pairs, 2) and table.dtype == np.float32
    f32 = [float(np.float32(s)) for s in scalars]  # the kernel's parameters are fp32
    if mode == "theta":
        inv = ref.rope_inv_freq(rotary_dim, f32[0], f32[1])
    else:
        inv = ref.llama31_inv_freq(rotary_dim, *f32)
    want = inv[:pairs] / (2 * np.pi)
    hi, lo = table[:, 0].astype(np.float64), table[:, 1].astype(np.float64)
    assert np.all(np.abs(hi - want) <= 2.0**-24 * want)  # hi: the float nearest f
    assert np.all(np.abs(hi + lo - want) <= 2.0**-46 * want)


def test_table_writer_writes_only_new_scalars(monkeypatch):
    """The launch's parameter block gets the table of the call's scalars; a call with the
    scalars of the last one writes nothing."""
    spec = rope.RopeSpec("bfloat16", "int32", 128, 128, False, "theta", "pos_ids", True, 8)
    params = Kernel(spec, "rope_kernel", "RopeParams").params_type()
    assert len(params.freq) == 2 * TABLE_PAIRS  # the kernel's table, as rope.cu declares it
    write = table_writer(params, "theta", 128)
    moved = []
    memmove = rope_table_module.ctypes.memmove
    monkeypatch.setattr(rope_table_module.ctypes, "memmove",
                        lambda *a: (moved.append(a[2]), memmove(*a)))  # fmt: skip
    write((1.0, 1e4))
    write((1.0, 1e4))
    assert moved == [64 * 2 * 4]
    assert list(params.freq)[:128] == frequency_table("theta", 128, (1.0, 1e4)).ravel().tolist()
    write((2.0, 1e4))
    assert len(moved) == 2
    assert list(params.freq)[:128] == frequency_table("theta", 128, (2.0, 1e4)).ravel().tolist()
