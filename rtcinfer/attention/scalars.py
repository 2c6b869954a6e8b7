"""The scalar arguments of every attention entry point (plan() of the decode and prefill
wrappers, single decode): FlashInfer's defaults, and an error naming a value no kernel can use
(a NaN or infinite scale, a RoPE base or scale <= 0, a negative soft cap) before it reaches one.
"""

from __future__ import annotations

import math

# (what the message asks for, the test beyond being finite)
_FINITE = ("finite", lambda x: True)
_POSITIVE = ("> 0 and finite", lambda x: x > 0)
_NON_NEGATIVE = (">= 0 and finite", lambda x: x >= 0)


def _checked(name: str, value, default: float, rule) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be None or a number, got {value!r}") from None
    wanted, test = rule
    if not (math.isfinite(number) and test(number)):
        raise ValueError(f"{name} must be None or {wanted}, got {number}")
    return number


def attention_scalars(head_dim: int, sm_scale, logits_soft_cap, rope_scale, rope_theta):
    """(sm_scale, logits_soft_cap, rope_scale, rope_theta) as floats, None giving FlashInfer's
    defaults (1 / sqrt(head_dim), 0: no cap, 1, 1e4). ValueError, with the value received, for
    a non-finite one, a negative soft cap, rope_scale or rope_theta <= 0; TypeError for what is
    not a number."""
    return (
        _checked("sm_scale", sm_scale, 1.0 / math.sqrt(head_dim), _FINITE),
        _checked("logits_soft_cap", logits_soft_cap, 0.0, _NON_NEGATIVE),
        _checked("rope_scale", rope_scale, 1.0, _POSITIVE),
        _checked("rope_theta", rope_theta, 1e4, _POSITIVE),
    )


__all__ = ["attention_scalars"]
