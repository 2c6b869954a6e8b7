"""bench/trace_decode.py stays in step with decode.cu: its anchors match and the traced kernel
compiles (NVRTC, no GPU needed)."""

from __future__ import annotations

from bench.trace_decode import traced_source
from rtcinfer import jit
from rtcinfer.attention.decode_kernel import decode_spec


def test_the_traced_decode_kernel_compiles(monkeypatch):
    spec = decode_spec("bfloat16", "bfloat16", "bfloat16", 128, 4)
    plain = jit.expand_source
    source = traced_source(plain(spec))
    assert source.count("rtc_mark(") == 7  # the helper and six marks
    monkeypatch.setattr(jit, "expand_source", lambda s: traced_source(plain(s)))
    compiled = jit.compile_spec(spec, "sm_90a")
    assert compiled.meta["resources"]["decode_kernel"]["spill_stores"] == 0
