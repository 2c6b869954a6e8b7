"""Sorting-free sampling: FlashInfer's `flashinfer.sampling`, names, arguments and defaults.

The samplers (samplers.py, and cluster.py for small batches on sm_90+), `softmax`, the
renormalization ops (`top_k_renorm_probs`, `top_p_renorm_probs`, `top_k_mask_logits`),
`chain_speculative_sampling`, and `Generator` with the Philox seed and offset rules.
"""

from .philox import Generator
from .renorm import top_k_mask_logits, top_k_renorm_probs, top_p_renorm_probs
from .samplers import (
    SampleOp,
    SampleSpec,
    min_p_sampling_from_probs,
    sample_spec,
    sampling_from_logits,
    sampling_from_probs,
    top_k_renorm_prob,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_prob,
    top_p_sampling_from_probs,
)
from .softmax import softmax
from .speculative import chain_speculative_sampling
from .topk import top_k

__all__ = [
    "Generator",
    "SampleOp",
    "SampleSpec",
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sample_spec",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k",
    "top_k_mask_logits",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
