"""BatchMLAPagedAttentionWrapper without a GPU: plan() checks (FlashInfer's dims, the batch, the
keys against the pages, the options it does not take), its configuration (one kv head of all
the heads), and run()'s checks of q_nope, q_pe, the caches and
the outputs (the kernel's flow itself: test_prefill_flow.py)."""

from __future__ import annotations

import numpy as np
import pytest

from .test_prefill_host import info, wrappers  # noqa: F401 - the fixture


@pytest.fixture
def mla(wrappers):  # noqa: F811
    from rtcinfer.attention import mla

    return mla


def planned(mla, heads=16, lens=(5, 40), page=16, **kw):
    lens = np.array(lens, np.int32)
    pages = -(-lens // page)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    wrapper = mla.BatchMLAPagedAttentionWrapper()
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    wrapper.plan(qo, indptr, np.arange(indptr[-1], dtype=np.int32), lens, heads, 512, 64, page,
                 False, 0.1, "bfloat16", "bfloat16", **kw)  # fmt: skip
    return wrapper


def test_the_configuration_is_one_kv_head_of_every_head(mla):
    wrapper = planned(mla, heads=16)
    cfg = wrapper._launch.cfg
    a = cfg.attn
    assert cfg.mla and (a.num_kv_heads, a.group_size, a.head_dim, cfg.dim_vo) == (1, 16, 576, 512)
    assert a.sm_scale == 0.1 and not cfg.causal
    launch = wrapper._launch.launch
    assert (launch.params.group_size, launch.grid[0], launch.block[0]) == (16, 1, 128)


@pytest.mark.parametrize("change, error, match", [
    (dict(head_dim_ckv=256), ValueError, r"head_dim_ckv, head_dim_kpe: expected \(512, 64\)"),
    (dict(kv_data_type="float8_e4m3fn"), TypeError, "kv_data_type must be q's dtype"),
    (dict(use_profiler=True), ValueError, "MLA options not supported: use_profiler"),
    (dict(query_layout="packed"), ValueError, "MLA options not supported: query_layout"),
    (dict(lse_mode="base10"), ValueError, "lse_mode must be"),
    (dict(kv_len_arr=[5, 50]), ValueError, r"request 1: kv_len_arr 50 keys over 3 pages of 16"),
    (dict(kv_len_arr=[5]), ValueError, "must describe the same batch"),
    (dict(kv_indices=[0, 1]), ValueError, r"kv_indices .* at least kv_indptr\[-1\] \(4\)"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])  # fmt: skip
def test_plan_refuses_what_it_does_not_take(mla, change, error, match):
    args = dict(qo_indptr=[0, 1, 2], kv_indptr=[0, 1, 4], kv_indices=[3, 0, 1, 2],
                kv_len_arr=[5, 40], num_heads=16, head_dim_ckv=512, head_dim_kpe=64,
                page_size=16, causal=False, sm_scale=0.1, q_data_type="bfloat16",
                kv_data_type="bfloat16")  # fmt: skip
    args.update(change)
    wrapper = mla.BatchMLAPagedAttentionWrapper()
    with pytest.raises(error, match=match):
        wrapper.plan(**args)
    with pytest.raises(ValueError, match="backend must be one of"):
        mla.BatchMLAPagedAttentionWrapper(backend="cutlass")


def test_run_checks_its_arrays(mla):
    wrapper = planned(mla, heads=8, lens=(5, 40))
    st = wrapper._launch
    static = (st.cfg, 2, True)
    good = [info((2, 8, 512)), info((2, 8, 64)), info((9, 16, 512)), info((9, 16, 64))]
    prepared = wrapper._prepare_run([*good, None, None], None, static)
    assert [s.shape for s in prepared.outs] == [(2, 8, 512), (2, 8)]
    for at, bad, match in ((0, info((2, 8, 576)), r"q_nope: expected shape \(2, 8, 512\)"),
                           (1, info((2, 4, 64)), r"q_pe: expected shape \(2, 8, 64\)"),
                           (2, info((9, 8, 512)), r"ckv_cache: expected shape \('num_pages', 16, "
                                                  r"512\)"),
                           (3, info((9, 16, 64), "float16"), "kpe_cache: .* dtype bfloat16"),
                           (3, info((8, 16, 64)), "one page count")):  # fmt: skip
        arrays = [*good, None, None]
        arrays[at] = bad
        with pytest.raises(ValueError, match=match):
            wrapper._prepare_run(arrays, None, static)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8, 512\)"):
        wrapper._prepare_run([*good, info((2, 8, 128)), None], None, static)


def test_run_refuses_the_options_it_lacks_before_touching_arrays(mla):
    wrapper = planned(mla)
    for option in ("kv_len", "page_table", "sinks", "o_scale", "profiler_buffer"):
        with pytest.raises(ValueError, match=f"MLA run\\(\\) options not supported: {option}"):
            wrapper.run(None, None, None, None, **{option: 1})


def test_strides_reach_the_kernel_as_mla_reads_them(mla):
    """k_* strides are ckv's, v_* kpe's (the row table's second offsets), no head offsets."""
    fields = mla._run_fields(info((3, 8, 512)), info((3, 8, 64)), info((10, 16, 512)),
                             info((10, 16, 64)), None, None, (3, 8, 512))  # fmt: skip
    assert fields["k_page"] == 16 * 512 * 2 and fields["k_token"] == 512 * 2
    assert fields["v_page"] == 16 * 64 * 2 and fields["v_token"] == 64 * 2
    assert (fields["k_head"], fields["v_head"]) == (0, 0)
    assert (fields["q_stride_n"], fields["qpe_stride_n"], fields["o_stride_h"]) == (4096, 512, 512)
