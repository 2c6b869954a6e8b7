"""run_options.py's host side on host arrays (NumPy, and PyTorch CPU tensors where PyTorch is
installed): the LSE forms FlashInfer returns, the refusals, the forward check; and the
samplers' valid flags (samplers._valid_rows)."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from rtcinfer.attention import run_options as ro
from rtcinfer.attention.decode_kernel import kv_scales, make_config

from .checks import to_host

KINDS = ["numpy"] + (["torch"] if importlib.util.find_spec("torch") else [])


def host(kind: str, x: np.ndarray):
    """A copy of x (the LSE forms rescale in place) as a `kind` array."""
    if kind == "torch":
        import torch

        return torch.from_numpy(np.array(x, order="C"))
    return np.array(x, order="C")


def contiguous(x) -> bool:
    return x.is_contiguous() if hasattr(x, "is_contiguous") else x.flags.c_contiguous


@pytest.mark.parametrize("kind", KINDS)
def test_lse_forms_of_the_kernels_base_2_tokens_by_heads(kind):
    base2 = np.arange(12, dtype=np.float32).reshape(4, 3)  # [tokens, heads]
    ln = ro.finish_lse(host(kind, base2), "ln", "NH")
    np.testing.assert_allclose(to_host(ln), base2 * math.log(2.0), rtol=1e-6)
    hn = ro.finish_lse(host(kind, base2), "log2", "HN")
    assert tuple(hn.shape) == (3, 4) and contiguous(hn)
    np.testing.assert_array_equal(to_host(hn), base2.T)
    given = host(kind, np.zeros((3, 4), np.float32))
    assert ro.finish_lse(host(kind, base2), "ln", "HN", given) is given
    np.testing.assert_allclose(to_host(given), base2.T * math.log(2.0), rtol=1e-6)
    in_place = host(kind, base2)
    assert ro.finish_lse(in_place, "ln", "NH") is in_place  # the caller's buffer, rescaled


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_writes_its_own_form_and_given_hn_buffers_are_checked(kind):
    q_shape = (4, 3, 64)
    given = host(kind, np.zeros((3, 4), np.float32))
    assert ro.kernel_lse(given, "ln", "HN", q_shape) is None  # filled afterwards
    nh = host(kind, np.zeros((4, 3), np.float32))
    assert ro.kernel_lse(nh, "ln", "NH", q_shape) is nh
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\) and float32, got \(4, 3\)"):
        ro.kernel_lse(nh, "log2", "HN", q_shape)
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\) and float32, got .*float64"):
        ro.kernel_lse(host(kind, np.zeros((3, 4))), "log2", "HN", q_shape)
    with pytest.raises(ValueError, match="must be contiguous"):
        ro.kernel_lse(host(kind, np.zeros((4, 3), np.float32)).T, "log2", "HN", q_shape)
    with pytest.raises(ValueError, match="lse_base must be one of"):
        ro.kernel_lse(None, "e", "NH", q_shape)
    with pytest.raises(ValueError, match="lse_layout must be one of"):
        ro.kernel_lse(None, "ln", "TN", q_shape)


def test_constructor_options_without_a_counterpart_are_refused_by_name():
    """The prefill wrappers' custom-variant options share run()'s refusal: each option given
    is named, under what it is."""
    from rtcinfer.attention.prefill_args import check_backend

    check_backend("fa3")
    with pytest.raises(ValueError, match="custom attention variants not supported: "
                                         "jit_kwargs, variant_owns_mask$"):  # fmt: skip
        check_backend("auto", None, {"a": 1}, True)


def test_refusals_scales_and_the_forward_check():
    ro.refuse(sinks=None, kv_cache_sf=None)
    with pytest.raises(ValueError, match="options not supported: sinks, kv_cache_sf$"):
        ro.refuse(sinks=1, o_scale=None, kv_cache_sf=2)
    # q_scale folds into the logit factor as k_scale does (decode_kernel.kv_scales, shared)
    assert kv_scales(3.0, None)[0] == 3.0 and kv_scales(None, None) == (1.0, 1.0)
    assert kv_scales(None, None, 0.5)[0] == 0.5 and kv_scales(4.0, 2.0, 0.5) == (2.0, 2.0)
    plan = make_config(8, 2, 128, 16, "NONE", -1, 30.0, "bfloat16", None, None, None, None,
                       None)  # fmt: skip
    ro.check_forward(make_config(8, 2, 128, 16, "NONE", -1, 30.0, "bfloat16", None, None,
                                 1 / math.sqrt(128), None, None), plan)  # fmt: skip
    asked = make_config(8, 2, 128, 16, "NONE", 7, None, "bfloat16", None, None, None, None, None)
    with pytest.raises(ValueError, match=r"window_left 7 \(the plan's -1\), logits_soft_cap 0.0 "
                                         r"\(the plan's 30.0\)"):  # fmt: skip
        ro.check_forward(asked, plan)


@pytest.mark.parametrize("kind", KINDS)
def test_sampler_valid_flags_follow_the_rows_drawn(kind):
    from rtcinfer.sampling.samplers import _valid_rows

    probs = host(kind, np.array([[0.0, 0.2], [0.0, 0.0], [np.nan, -1.0], [-1.0, 1e-30]],
                                np.float32))  # fmt: skip
    assert to_host(_valid_rows(probs, None)).tolist() == [1, 0, 0, 1]
    indices = host(kind, np.array([1, 3, 3, 0], np.int32))
    assert to_host(_valid_rows(probs, indices)).tolist() == [0, 1, 1, 1]
