"""Which prefill kernel plan() takes, without a GPU: the warpgroup-MMA one on sm_90a for 64- and
128-row tiles of 16-bit KV without in-kernel RoPE (a 2-stage ring; over a paged cache the
128-row kernel's registers capped for two CTAs a SM; 128-row tiles at head_dim 256 too), the
mma.sync one elsewhere and under RTCINFER_PREFILL_WGMMA=0."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer.attention.prefill_kernel import prefill_spec, use_wgmma

from .fakes import fake_gpu, packing_upload, planning_without_a_gpu


@pytest.mark.parametrize(
    "arch,rows,mode,kv,env,expect",
    [
        ("sm_90a", 128, "NONE", "bfloat16", None, True),
        ("sm_90a", 64, "ALIBI", "bfloat16", None, True),
        ("sm_90a", 16, "NONE", "bfloat16", None, False),  # decode-like tiles: mma.sync
        ("sm_90a", 128, "ROPE_LLAMA", "bfloat16", None, False),
        ("sm_90a", 128, "NONE", "float8_e4m3fn", None, False),
        ("sm_90a", 128, "NONE", "bfloat16", "0", False),
        ("sm_80", 128, "NONE", "bfloat16", None, False),
        ("sm_100", 128, "NONE", "bfloat16", None, False),
    ],
)
def test_use_wgmma(monkeypatch, arch, rows, mode, kv, env, expect):
    if env is None:
        monkeypatch.delenv("RTCINFER_PREFILL_WGMMA", raising=False)
    else:
        monkeypatch.setenv("RTCINFER_PREFILL_WGMMA", env)
    assert use_wgmma(arch, rows, mode, "bfloat16", kv) is expect


def test_wgmma_spec_shapes():
    ragged = prefill_spec("bfloat16", "bfloat16", 128, 128, True, ragged=True, wgmma=True)
    paged = prefill_spec("bfloat16", "bfloat16", 128, 128, True, wgmma=True)
    wide = prefill_spec("float16", "float16", 256, 128, True, wgmma=True)
    assert (ragged.wgmma, ragged.warp_rows, ragged.kv_tile, ragged.stages) == (True, 16, 64, 2)
    # over a paged cache: registers capped for two CTAs a SM, beside a 2-stage ring each
    assert (paged.stages, paged.min_ctas, paged.threads, paged.min_sm) == (2, 2, 256, 90)
    masked = prefill_spec("bfloat16", "bfloat16", 128, 128, False, custom_mask=True, wgmma=True)
    assert (masked.stages, masked.min_ctas, ragged.min_ctas) == (3, 0, 0)
    table = 2 * 2 * 64 * 8  # a paged cache's row offsets: two tiles of K and V, int64
    assert (wide.stages, wide.smem_bytes) == (2, 128 * 512 + 2 * 2 * 64 * 512 + table + 16)
    # an explicit warp shape asks for the mma.sync kernel
    assert not prefill_spec("bfloat16", "bfloat16", 128, 128, True, warp_rows=32, wgmma=True).wgmma
    with pytest.raises(ValueError, match="wgmma"):
        prefill_spec("bfloat16", "bfloat16", 128, 16, True, wgmma=True)


def test_wgmma_spec_with_fewer_value_dims():
    """192 / 128: the wgmma kernel with K rows of three 64-dim column blocks and V's of two;
    the 128-row tile alone on its SM (3 stages, no register cap), the 64-row one in 2 stages
    (two fit an SM); 16-row tiles refused by name."""
    big = prefill_spec("bfloat16", "bfloat16", 192, 128, True, wgmma=True, head_dim_vo=128)
    small = prefill_spec("bfloat16", "bfloat16", 192, 64, True, ragged=True, wgmma=True,
                         head_dim_vo=128)  # fmt: skip
    assert (big.wgmma, big.stages, big.min_ctas, big.kv_tile, big.dim_vo) == (True, 3, 0, 64, 128)
    table = 2 * 2 * 64 * 8
    assert big.smem_bytes == 128 * 384 + 3 * 64 * (384 + 256) + table + 16
    assert (small.wgmma, small.stages, small.smem_bytes) == (True, 2, 64 * 384 + 2 * 64 * 640 + 16)
    assert 2 * small.smem_bytes <= 228 * 1024
    assert "constexpr int HEAD_DIM_VO = 128;" in big.prelude()
    with pytest.raises(ValueError, match="wgmma with 16-row tiles: 64 or 128 rows"):
        prefill_spec("bfloat16", "bfloat16", 192, 16, True, wgmma=True, head_dim_vo=128)


@pytest.mark.parametrize("cc,expect", [((9, 0), True), ((8, 0), False), ((12, 0), False)])
@pytest.mark.parametrize("head_dim", [128, 256, (192, 128)])
def test_plan_takes_the_devices_kernel(monkeypatch, cc, expect, head_dim):
    import rtcinfer
    from rtcinfer.attention import prefill_wrapper
    from rtcinfer.launch import Kernel

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, packing_upload)
    fake_gpu(monkeypatch, compute_capability=cc)
    monkeypatch.delenv("RTCINFER_PREFILL_WGMMA", raising=False)
    monkeypatch.setattr(prefill_wrapper, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 1)
    qo = np.array([0, 512, 1024], dtype=np.int32)  # long prompts: 128-row tiles where they fit
    head_dim, head_dim_vo = head_dim if isinstance(head_dim, tuple) else (head_dim, None)
    wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
    wrapper.plan(qo, qo, 32, 8, head_dim, head_dim_vo, causal=True, q_data_type="bfloat16")
    spec = wrapper._launch.launch.kernel.spec
    assert spec.wgmma is expect and spec.dim_vo == (head_dim_vo or head_dim)
    assert spec.tile_rows == (64 if head_dim == 256 and not expect else 128)


def test_min_ctas_caps_the_registers():
    """min_ctas reaches the launch bounds: the paged 128-row wgmma kernel (137 registers
    uncapped with NVRTC 13.5) fits two CTAs of 256 threads per SM, 128 registers a thread; 0
    asks for nothing."""
    from dataclasses import replace

    from rtcinfer import jit

    capped_spec = prefill_spec("bfloat16", "bfloat16", 128, 128, True, wgmma=True)
    spec = replace(capped_spec, min_ctas=0)
    assert (capped_spec.stages, capped_spec.ragged, capped_spec.min_ctas) == (2, False, 2)
    assert "constexpr int MIN_CTAS = 0;" in spec.prelude()
    assert "constexpr int MIN_CTAS = 2;" in capped_spec.prelude()
    uncapped = jit.compile_spec(spec, "sm_90a")
    capped = jit.compile_spec(capped_spec, "sm_90a")
    assert capped.meta["resources"]["prefill_kernel"]["registers"] <= 128
    assert capped.cubin != uncapped.cubin


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_128_row_wgmma_tiles_fit_two_ctas_a_sm(head_dim, dtype, ragged, causal):
    """The 128-row warpgroup-MMA prefill kernel was measured fastest with two CTAs of 256
    threads on each SM (bench/RESULTS.md: one CTA a SM loses 20-40%): its registers (at most
    128 a thread) and shared memory leave room for two. Over a ragged cache nothing caps the
    registers (126-127 with NVRTC 13.5, by the compiler's choice): a change anywhere in the
    kernel can push them past 128 and halve the CTAs a SM without any other sign, so this
    test says so at once."""
    from rtcinfer import jit

    spec = prefill_spec(dtype, dtype, head_dim, 128, causal, ragged=ragged, wgmma=True)
    assert spec.threads == 256
    usage = jit.compile_spec(spec, "sm_90a").meta["resources"]["prefill_kernel"]
    assert usage["registers"] <= 65536 // (2 * spec.threads), usage
    assert 2 * (spec.smem_bytes + 1024) <= 228 * 1024  # 1 KB a CTA reserved by the driver


@pytest.mark.parametrize("form", ["ragged", "paged"])
@pytest.mark.parametrize("prompt,expect", [(8, 64), (128, 128), (512, 128), (1024, 128)])
def test_wgmma_tiles_over_a_paged_cache(monkeypatch, form, prompt, expect):
    """The wgmma kernel's tiles follow the packed prompt length alike over ragged K/V and a
    paged cache (GQA group 4: 32 packed rows take 64-row tiles, 512 and more 128)."""
    import rtcinfer
    from rtcinfer.attention import prefill_wrapper
    from rtcinfer.launch import Kernel

    regions = dict.fromkeys(("plan", "counters", "lse", "o", "end"), 0)
    planning_without_a_gpu(monkeypatch, regions, packing_upload)
    monkeypatch.delenv("RTCINFER_PREFILL_WGMMA", raising=False)
    monkeypatch.setattr(prefill_wrapper, "device_limits", lambda device: (132, 227 * 1024))
    monkeypatch.setattr(Kernel, "occupancy", lambda self, device, threads: 1)
    qo = np.arange(5, dtype=np.int32) * prompt  # four requests of `prompt` tokens
    if form == "ragged":
        wrapper = rtcinfer.BatchPrefillWithRaggedKVCacheWrapper()
        wrapper.plan(qo, qo, 32, 8, 128, causal=True, q_data_type="bfloat16")
    else:
        pages = -(-prompt // 16)
        indptr = np.arange(5, dtype=np.int32) * pages
        wrapper = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()
        wrapper.plan(qo, indptr, np.arange(4 * pages, dtype=np.int32),
                     np.full(4, prompt - 16 * (pages - 1), np.int32), 32, 8, 128, 16, causal=True,
                     q_data_type="bfloat16")  # fmt: skip
    spec = wrapper._launch.launch.kernel.spec
    assert (spec.wgmma, spec.tile_rows) == (True, expect)
