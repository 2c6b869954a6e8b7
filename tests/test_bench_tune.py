"""bench/tune_prefill.py stays in step with the wrappers: the configuration it forces is the
one plan() launches (planned without a GPU), for equal head dims and for 192 / 128."""

from __future__ import annotations

import numpy as np
import pytest

from .test_prefill_host import wrappers  # noqa: F401 - the fixture


@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_the_forced_configuration_is_the_one_planned(wrappers, monkeypatch, dims):  # noqa: F811
    from bench import tune_prefill
    from rtcinfer.attention import prefill_launch

    prefill, _ = wrappers
    for name in ("prefill_spec", "pick_tile_rows"):  # forced() replaces them: undone after
        monkeypatch.setattr(prefill_launch, name, getattr(prefill_launch, name))
    tune_prefill.forced(64, 16, 32, 2)
    qo = np.array([0, 300, 700], np.int32)
    wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo, qo, 16, 16, dims[0], dims[1], causal=True, q_data_type="bfloat16")
    spec = wrapper._launch.launch.kernel.spec
    assert (spec.tile_rows, spec.warp_rows, spec.kv_tile, spec.stages) == (64, 16, 32, 2)
    assert (spec.head_dim, spec.dim_vo) == dims


@pytest.mark.parametrize("kv_dtype, batch", [(None, 4), ("float8_e4m3fn", 40)])
def test_tune_decode_split_forces_the_tensor_core_decode_tiles(
    wrappers,  # noqa: F811
    monkeypatch,
    kv_dtype,
    batch,
):
    """bench/tune_decode_split.py's forced() reaches the tensor-core decode's 8-row tiles, on a
    small batch (no wide tiles) and on one that fills the GPU (no fp8 64-key ones)."""
    from bench import tune_decode_split
    from rtcinfer.attention import prefill_launch
    from rtcinfer.attention.decode import BatchDecodeWithPagedKVCacheWrapper

    for name in ("prefill_spec", "wide_decode_spec", "busy_decode_spec"):  # undone after
        monkeypatch.setattr(prefill_launch, name, getattr(prefill_launch, name))
    tune_decode_split.forced(128, 2, kv_dtype is not None)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
    wrapper.plan(np.arange(batch + 1), np.arange(batch), np.full(batch, 5), 32, 8, 128, 16,
                 q_data_type="float16", kv_data_type=kv_dtype)  # fmt: skip
    spec = wrapper._tc._launch.launch.kernel.spec
    assert (spec.tile_rows, spec.kv_tile, spec.stages) == (8, 128, 2)
    assert spec.fp8_direct == (kv_dtype is not None)
