"""run_options.py's host side on CPU tensors: the LSE forms FlashInfer returns, the refusals,
the forward check; and the samplers' valid flags (samplers._valid_rows)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rtcinfer.attention import run_options as ro
from rtcinfer.attention.decode_kernel import make_config

torch = pytest.importorskip("torch")


def test_lse_forms_of_the_kernels_base_2_tokens_by_heads():
    base2 = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # [tokens, heads]
    ln = ro.finish_lse(base2.clone(), "ln", "NH")
    assert torch.allclose(ln, base2 * math.log(2.0))
    hn = ro.finish_lse(base2.clone(), "log2", "HN")
    assert hn.shape == (3, 4) and hn.is_contiguous() and torch.equal(hn, base2.T)
    given = torch.empty(3, 4)
    kept = given
    out = ro.finish_lse(base2.clone(), "ln", "HN", given)
    assert out is kept and torch.allclose(given, base2.T * math.log(2.0))
    in_place = base2.clone()
    assert ro.finish_lse(in_place, "ln", "NH") is in_place  # the caller's buffer, rescaled


def test_the_kernel_writes_its_own_form_and_given_hn_buffers_are_checked():
    q_shape = (4, 3, 64)
    given = torch.empty(3, 4)
    assert ro.kernel_lse(given, "ln", "HN", q_shape) is None  # filled afterwards
    nh = torch.empty(4, 3)
    assert ro.kernel_lse(nh, "ln", "NH", q_shape) is nh
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\) and float32, got \(4, 3\)"):
        ro.kernel_lse(nh, "log2", "HN", q_shape)
    with pytest.raises(ValueError, match="must be contiguous"):
        ro.kernel_lse(torch.empty(4, 3).T, "log2", "HN", q_shape)
    with pytest.raises(ValueError, match="lse_base must be one of"):
        ro.kernel_lse(None, "e", "NH", q_shape)
    with pytest.raises(ValueError, match="lse_layout must be one of"):
        ro.kernel_lse(None, "ln", "TN", q_shape)


def test_refusals_scales_and_the_forward_check():
    ro.refuse(sinks=None, kv_cache_sf=None)
    with pytest.raises(ValueError, match="options not supported: sinks, kv_cache_sf$"):
        ro.refuse(sinks=1, o_scale=None, kv_cache_sf=2)
    assert ro.logit_scale(None, 3.0) == 3.0 and ro.logit_scale(None, None) is None
    assert ro.logit_scale(0.5, None) == 0.5 and ro.logit_scale(0.5, 4.0) == 2.0
    plan = make_config(8, 2, 128, 16, "NONE", -1, 30.0, "bfloat16", None, None, None, None,
                       None)  # fmt: skip
    ro.check_forward(make_config(8, 2, 128, 16, "NONE", -1, 30.0, "bfloat16", None, None,
                                 1 / math.sqrt(128), None, None), plan)  # fmt: skip
    asked = make_config(8, 2, 128, 16, "NONE", 7, None, "bfloat16", None, None, None, None, None)
    with pytest.raises(ValueError, match=r"window_left 7 \(the plan's -1\), logits_soft_cap 0.0 "
                                         r"\(the plan's 30.0\)"):  # fmt: skip
        ro.check_forward(asked, plan)


def test_sampler_valid_flags_follow_the_rows_drawn():
    from rtcinfer.sampling.samplers import _valid_rows

    probs = torch.tensor([[0.0, 0.2], [0.0, 0.0], [float("nan"), -1.0], [-1.0, 1e-30]])
    assert _valid_rows(probs, None).tolist() == [True, False, False, True]
    indices = torch.tensor([1, 3, 3, 0], dtype=torch.int32)
    assert _valid_rows(probs, indices).tolist() == [False, True, True, True]
    assert np.asarray(_valid_rows(probs, indices)).dtype == np.bool_
