"""The decode plan built on the device (attention/decode_device_plan.py) without a GPU: the rule
it is given is the host plan's, its one launch reads only the call's arrays (so XLA launches
it itself), the parameter block matches its C declaration, and bad arguments are refused by
name before anything launches."""

from __future__ import annotations

import numpy as np
import pytest

from rtcinfer import jit
from rtcinfer.attention import decode_device_plan as ddp
from rtcinfer.attention.decode_plan import WORK_ITEM
from rtcinfer.errors import BadIndex, BadIndexError
from rtcinfer.interop import xla_launch
from rtcinfer.interop.call import ArrayInfo, dense_strides
from rtcinfer.plan import decode as pd
from rtcinfer.plan.decode import MIN_CHUNK_TOKENS

from .fakes import FakeRecords
from .test_decode_array import MAX_BATCH, MAX_PAGES, _plan, graph_wrapper  # noqa: F401


@pytest.fixture(autouse=True)
def records(monkeypatch):
    """The devices' records of bad entries, in host memory."""
    return FakeRecords(monkeypatch)


def _info(shape, dtype="int32"):
    return ArrayInfo(tuple(shape), dense_strides(shape), dtype, 0)


def _table(batch: int, indices: int = MAX_PAGES):
    return [_info((batch + 1,)), _info((indices,)), _info((batch,))]


def test_the_rule_is_the_latest_plans(graph_wrapper):  # noqa: F811
    w = graph_wrapper
    pages = np.arange(MAX_PAGES, dtype=np.int32)
    _plan(w, [100, 7, 300], pages)
    rule = w._plan_rule()
    cfg, cap = w._launch.cfg, w._ws.capacity
    assert (rule.page_size, rule.kv_blocks, rule.num_sms, rule.slots) == (16, cfg.kv_blocks,
                                                                          132, 264)  # fmt: skip
    assert rule.min_chunk == MIN_CHUNK_TOKENS // 16 and rule.split == ddp.PlanSplit.AUTO
    assert (rule.max_batch, rule.max_work, rule.max_pages, rule.plan_ints) == (
        cap.max_batch, cap.max_work, cap.max_pages, cap.plan_ints)  # fmt: skip
    assert rule.header_ints == 4 + 128 and rule.freq == b""
    assert w._plan_rule() is rule  # kept while the plan's rule stays
    w.plan([0, 7], pages, [4], 32, 8, 128, 16, q_data_type="bfloat16", fixed_split_size=3)
    fixed = w._plan_rule()
    assert (fixed.split, fixed.fixed_chunk) == (ddp.PlanSplit.FIXED, 3)
    w.plan([0, 7], pages, [4], 32, 8, 128, 16, q_data_type="bfloat16", disable_split_kv=True)
    assert w._plan_rule().split == ddp.PlanSplit.WHOLE
    w.plan([0, 7], pages, [4], 32, 8, 64, 16, q_data_type="bfloat16",
           pos_encoding_mode="ROPE_LLAMA")  # fmt: skip
    rope = w._plan_rule()
    freq = np.frombuffer(rope.freq, np.int32)
    assert rope.header_ints == 4 + 64 and freq.shape == (64,) and freq.any()


def test_one_launch_that_xla_can_launch_itself(graph_wrapper, monkeypatch):  # noqa: F811
    """The planning CTA and the page copy's in one launch, addressing only the three table
    slots and the plan output; the record's addresses are constants (one GPU)."""
    monkeypatch.setattr(xla_launch, "resident", lambda ptr: True)  # the record (host memory)
    w = graph_wrapper
    _plan(w, [100, 7, 300], np.arange(MAX_PAGES, dtype=np.int32))
    rule = w._plan_rule()
    prep = ddp._prepare(_table(3), 16, (rule, 50))
    (out,) = prep.outs
    assert out.shape == (rule.plan_ints,) and out.dtype == "int32"
    present = [True, True, True]
    (step,) = xla_launch.record(prep, present, (), 0)
    assert step.kernel.name == "decode_plan_kernel"
    assert step.grid == (1 + -(-MAX_PAGES // ddp.PLAN_THREADS), 1, 1)
    (native,) = xla_launch.plan(prep, present, [step], constants=True)
    assert native.operands == (0, 1, 2) and native.results == (3,)
    p = step.kernel.params_type.from_buffer_copy(step.params)
    # the host planner's constants, not copies of them
    assert (p.straggler_skew, p.straggler_share) == (pd.STRAGGLER_SKEW, pd.STRAGGLER_SHARE)
    prelude = ddp.SPEC.prelude()
    assert f"STRAGGLER_CUTS = {pd.STRAGGLER_CUTS};" in prelude
    assert f"MAX_KV_LEN = {pd.MAX_KV_LEN};" in prelude
    assert (p.batch, p.num_indices, p.num_pages, p.max_work, p.slots) == (
        3, MAX_PAGES, 50, rule.max_work, 264)  # fmt: skip


def test_the_kernels_share_the_work_item_with_decode():
    layout = jit.struct_layout(ddp.SPEC, "DecodeWorkItem")
    assert [f.name for f in layout.fields] == list(WORK_ITEM.names)
    assert layout.size == WORK_ITEM.itemsize == 32


def test_bad_arguments_are_refused_by_name(graph_wrapper):  # noqa: F811
    w = graph_wrapper
    _plan(w, [100, 7, 300], np.arange(MAX_PAGES, dtype=np.int32))
    rule = w._plan_rule()
    wide = [_info((4,), "int64"), _info((MAX_PAGES,)), _info((3,))]
    with pytest.raises(TypeError, match="indptr: expected a one-dimensional int32 array, got i"):
        ddp._prepare(wide, 16, (rule, 50))
    with pytest.raises(ValueError, match=r"indptr must have shape \(4,\)"):
        ddp._prepare([_info((5,)), _info((MAX_PAGES,)), _info((3,))], 16, (rule, 50))
    with pytest.raises(ValueError, match="a batch of 9 requests exceeds the wrapper's capacity"):
        ddp._prepare(_table(MAX_BATCH + 1), 16, (rule, 50))
    with pytest.raises(ValueError, match="num_pages must be"):
        w.device_plan_array(None, None, None, 0)
    with pytest.raises(ValueError, match=r"num_pages \(2147483648\) exceeds"):
        w.device_plan_array(None, None, None, 2**31)


def test_device_plans_and_plan_array_runs_agree_on_the_cache(graph_wrapper):  # noqa: F811
    """A device plan may name any page below its num_pages: a run(plan_array=...) over a
    smaller cache is refused, and a device plan past a cache a run was prepared with."""
    w = graph_wrapper
    _plan(w, [100, 7], np.arange(MAX_PAGES, dtype=np.int32))
    st = w._launch
    static = (st.cfg, w._kernel[0], w._ws.capacity, False)
    q, plan = _info((2, 32, 128), "bfloat16"), _info((w.plan_array_size,))
    w._device_pages = 40  # as a device_plan_array(..., num_pages=40) leaves it
    small = _info((30, 2, 16, 8, 128), "bfloat16")
    with pytest.raises(ValueError, match="num_pages=40, but the cache has 30 pages"):
        w._prepare_array_run([q, small, None, None, None, plan], 16, static)
    w._prepare_array_run([q, _info((40, 2, 16, 8, 128), "bfloat16"), None, None, None, plan],
                         16, static)  # fmt: skip
    with pytest.raises(ValueError, match="was prepared with a cache of 40 pages"):
        w.device_plan_array(None, None, None, 41)


def test_a_call_raises_what_the_device_reported(graph_wrapper, records):  # noqa: F811
    w = graph_wrapper
    _plan(w, [100, 7, 300], np.arange(MAX_PAGES, dtype=np.int32))
    prep = ddp._prepare(_table(3), 16, (w._plan_rule(), 50))
    records.report(0, BadIndex.PLAN_LAST_PAGE_LEN, 2, 0, 19)
    with pytest.raises(BadIndexError, match=r"device_plan_array: kv_last_page_len\[2\] = 0 is out "
                       "of range for a request of 19 pages.*the plan holds no work"):  # fmt: skip
        prep.run(9, 0, [1, 2, 3, 4], ())
    assert records.host_row(0)["count"] == 0 and records.log == [("clear", 0, 9)]
