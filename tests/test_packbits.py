"""packbits / segment_packbits: the NumPy path on the CPU, the kernel on the GPU, both against
NumPy's own np.packbits of each segment."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer

from .checks import to_host


def expected(bits, indptr, bitorder):
    parts = [np.packbits(bits[a:b], bitorder=bitorder) for a, b in zip(indptr[:-1], indptr[1:],
                                                                     strict=True)]  # fmt: skip
    new = np.concatenate([[0], np.cumsum([p.shape[0] for p in parts])])
    return np.concatenate(parts or [np.zeros(0, np.uint8)]), new


SEGMENTS = [[0], [0, 0], [0, 9], [0, 1, 1, 8, 30, 31, 100], [0, 64, 64, 200]]


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("indptr", SEGMENTS)
def test_numpy_path(bitorder, indptr):
    rng = np.random.default_rng(len(indptr))
    bits = rng.random(indptr[-1] + 5) < 0.5  # trailing bits past indptr[-1] are ignored
    packed, new = rtcinfer.segment_packbits(bits, np.array(indptr, np.int32), bitorder)
    want, want_new = expected(bits, indptr, bitorder)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(new, want_new)
    assert new.dtype == np.int32
    np.testing.assert_array_equal(rtcinfer.packbits(bits, bitorder),
                                  np.packbits(bits, bitorder=bitorder))  # fmt: skip


def test_bad_arguments():
    bits = np.ones(10, bool)
    with pytest.raises(ValueError, match="bitorder must be one of"):
        rtcinfer.packbits(bits, "middle")
    with pytest.raises(ValueError, match=r"indptr\[-1\] \(11\) is past the end of x \(10"):
        rtcinfer.segment_packbits(bits, [0, 11])
    with pytest.raises(ValueError, match="indptr"):
        rtcinfer.segment_packbits(bits, [0, 5, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("indptr", SEGMENTS)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_gpu_matches_numpy(bitorder, indptr, index_dtype):
    import cupy

    rng = np.random.default_rng(len(indptr) + (index_dtype == np.int64))
    bits = rng.random(indptr[-1] + 3) < 0.3
    want, want_new = expected(bits, indptr, bitorder)
    x = cupy.asarray(bits)
    for ind in (np.array(indptr, index_dtype), cupy.asarray(np.array(indptr, index_dtype))):
        packed, new = rtcinfer.segment_packbits(x, ind, bitorder)
        assert isinstance(packed, cupy.ndarray) and new.dtype == index_dtype
        np.testing.assert_array_equal(to_host(packed), want)
        np.testing.assert_array_equal(to_host(new), want_new)
    np.testing.assert_array_equal(to_host(rtcinfer.packbits(x, bitorder)),
                                  np.packbits(bits, bitorder=bitorder))  # fmt: skip


@pytest.mark.gpu
def test_gpu_many_segments_and_frameworks():
    """Thousands of segments (CTAs stride over them, each sums the bytes before it) from
    PyTorch and JAX."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 40, 5000)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    bits = rng.random(int(indptr[-1])) < 0.5
    want, want_new = expected(bits, indptr, "little")
    torch = pytest.importorskip("torch")
    packed, new = rtcinfer.segment_packbits(torch.from_numpy(bits).cuda(),
                                            torch.from_numpy(indptr).cuda(), "little")  # fmt: skip
    assert isinstance(packed, torch.Tensor)
    np.testing.assert_array_equal(packed.cpu().numpy(), want)
    np.testing.assert_array_equal(new.cpu().numpy(), want_new)
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "gpu":
        packed, new = rtcinfer.segment_packbits(jax.numpy.asarray(bits), indptr, "little")
        np.testing.assert_array_equal(np.asarray(packed), want)
        np.testing.assert_array_equal(np.asarray(new), want_new)
