"""The samplers' `indices` read on the device: an entry outside the rows of probs reads no row,
its sample is -1, and it is raised as BadIndexError by the next sampler call, by
check_errors(), or at once under RTCINFER_CHECK=1 (the host logic here on the CPU, the
kernels on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import rtcinfer
from rtcinfer.errors import BadIndex
from rtcinfer.interop import ArrayInfo, dense_strides
from rtcinfer.sampling import samplers

from .checks import to_host
from .fakes import FakeRecords


@pytest.fixture
def records(monkeypatch):
    return FakeRecords(monkeypatch)


def _prepared_sampler(monkeypatch, launches):
    """samplers._prepare of top_p over probs [4, 1000] with indices [3], its launch recorded
    instead of run (the kernel as the device would pick it, without a GPU)."""
    spec = samplers.sample_spec("top_p", "float32", 1000, 3)
    kernel = samplers.Kernel(spec, "sample_kernel", "SampleParams", 0)

    def fake_launch(*args):
        return samplers.Launch(kernel, (3, 1, 1), (spec.threads, 1, 1))

    monkeypatch.setattr(samplers, "_sample_launch", fake_launch)
    monkeypatch.setattr(samplers.Launch, "__call__", lambda self, s, d: launches.append(s))
    probs = ArrayInfo((4, 1000), dense_strides((4, 1000)), "float32", 0)
    indices = ArrayInfo((3,), (1,), "int32", 0)
    infos = [probs, indices, None, None, None, None, None, None]
    return samplers._prepare(infos, 16, ("top_p", False))


def test_the_next_sampler_call_raises_an_index_the_device_reported(monkeypatch, records):
    launches = []
    prep = _prepared_sampler(monkeypatch, launches)
    ptrs = [0x1000 * (i + 1) for i in range(9)]
    prep.run(5, 0, ptrs, (0, 0.9, 0.0, 1, 0))
    records.report(0, BadIndex.SAMPLE_INDICES, 1, 9, 4, count=1)
    with pytest.raises(rtcinfer.BadIndexError, match=r"^a sampler: indices\[1\] = 9 is not a row "
                       r"of probs \(0 <= row < 4\); its sample is -1, no row read$"):  # fmt: skip
        prep.run(7, 0, ptrs, (0, 0.9, 0.0, 1, 0))
    assert launches == [5] and records.log == [("clear", 0, 7)]
    prep.run(5, 0, ptrs, (0, 0.9, 0.0, 1, 0))
    assert launches == [5, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 200])  # 1 and 3: a cluster per row on sm_90
def test_an_index_past_probs_reads_no_row_and_is_raised(batch):
    import cupy

    rng = np.random.default_rng(batch)
    probs = rng.random((5, 32000)).astype(np.float32)
    indices = rng.integers(0, 5, batch).astype(np.int32)
    indices[batch // 2] = 5  # one past the rows
    tokens = to_host(
        rtcinfer.top_p_sampling_from_probs(
            cupy.asarray(probs), 0.9, cupy.asarray(indices), seed=1, offset=0
        )
    )
    bad = batch // 2
    assert tokens[bad] == -1
    good = np.delete(tokens, bad)
    assert ((good >= 0) & (good < 32000)).all()
    with pytest.raises(rtcinfer.BadIndexError, match=rf"indices\[{bad}\] = 5 is not a row of "
                       r"probs \(0 <= row < 5\)"):  # fmt: skip
        rtcinfer.check_errors()
    indices[bad] = -3
    rtcinfer.top_p_sampling_from_probs(cupy.asarray(probs), 0.9, cupy.asarray(indices))
    cupy.cuda.Device().synchronize()
    with pytest.raises(rtcinfer.BadIndexError, match=rf"indices\[{bad}\] = -3 is not a row"):
        rtcinfer.top_p_sampling_from_probs(cupy.asarray(probs), 0.9, cupy.asarray(indices))
    assert rtcinfer.check_errors() is None
