"""Host-side composition of the samplers (no GPU): the one-call logits samplers."""

from __future__ import annotations

from rtcinfer.interop import ArrayInfo, OutSlot, Prepared
from rtcinfer.sampling import samplers


def test_logits_samplers_route_the_probs_scratch(monkeypatch):
    """softmax writes the scratch output (the last one) and the sampler reads it as its probs,
    with the other slots, its own outputs and the scalars passed through in order."""
    seen = []
    soft = Prepared((OutSlot((3, 50), "float32"),),
                    lambda stream, device, ptrs, scalars: seen.append(("softmax", tuple(ptrs),
                                                                       scalars)))  # fmt: skip
    monkeypatch.setattr(samplers, "prepare_softmax", lambda infos, align, static: soft)
    probs_seen = []

    def sample_prepare(infos, align, static):
        probs_seen.append((infos[0], infos[1:], static))
        outs = (OutSlot((2,), "int64", 7), OutSlot((1,), "int32"))
        return Prepared(outs, lambda stream, device, ptrs, scalars: seen.append(
            ("sample", list(ptrs), scalars)), dense=(1,))  # fmt: skip

    monkeypatch.setattr(samplers, "_prepare", sample_prepare)
    logits = ArrayInfo((3, 50), (64, 1), "bfloat16", 0)
    indices = ArrayInfo((2,), (1,), "int64", 0)
    out = ArrayInfo((2,), (1,), "int64", 0)
    infos = (logits, indices, None, None, None, None, None, out)
    prep = samplers._prepare_from_logits(infos, 16, ("top_k", True))
    assert probs_seen == [(ArrayInfo((3, 50), (50, 1), "float32", 0), infos[1:], ("top_k", True))]
    assert [(o.shape, o.dtype, o.source) for o in prep.outs] == [
        ((2,), "int64", 7), ((1,), "int32", None), ((3, 50), "float32", None)]  # fmt: skip
    assert prep.dense == (1,)
    ptrs = [100, 101, 0, 0, 0, 0, 0, 107, 200, 201, 300]  # 8 slots, the sampler's 2 outs, scratch
    prep.run(5, 0, ptrs, (1, 2.0, 3.0, 4, 5))
    assert seen == [
        ("softmax", (100, 0, 300), (1.0,)),
        ("sample", [300, 101, 0, 0, 0, 0, 0, 107, 200, 201], (1, 2.0, 3.0, 4, 5)),
    ]
