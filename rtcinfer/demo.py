"""`rtcinfer demo`: one step's small ops on the GPU, checked against float64 references."""

from __future__ import annotations

import time

import numpy as np

from . import activation, jit, norm, rope


def _cases(rng):
    """(name, run, reference) for a Llama-3-8B-sized batch of 512 tokens in bf16."""
    import cupy

    import rtcinfer
    from rtcinfer.tests import reference as ref

    from .interop.dtypes import numpy_dtype

    bf16 = numpy_dtype("bfloat16")

    def rand(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(bf16)

    tokens = 512
    x, r, w = rand(tokens, 4096), rand(tokens, 4096, scale=30), rand(4096)
    xd2, rd2 = cupy.asarray(x), cupy.asarray(r)  # updated in place by fused_add_rmsnorm
    g = rand(tokens, 2 * 14336)
    q, k = rand(tokens, 32, 128), rand(tokens, 8, 128)
    pos = rng.integers(0, 8192, tokens).astype(np.int32)
    xd, wd, gd, qd, kd, pd = (cupy.asarray(a) for a in (x, w, g, q, k, pos))
    inv = ref.llama31_inv_freq(128)
    return [
        ("rmsnorm 512x4096", lambda: rtcinfer.rmsnorm(xd, wd), ref.rmsnorm_ref(x, w)),
        (
            "fused_add_rmsnorm 512x4096",
            lambda: rtcinfer.fused_add_rmsnorm(xd2, rd2, wd)[0],
            ref.fused_add_rmsnorm_ref(x, r, w, dtype="bfloat16")[0],
        ),
        ("silu_and_mul 512x2x14336", lambda: rtcinfer.silu_and_mul(gd), ref.silu_and_mul_ref(g)),
        (
            "llama3.1 rope 512x(32+8)x128",
            lambda: rtcinfer.apply_llama31_rope_pos_ids(qd, kd, pd)[0],
            ref.rope_ref(q, pos, 128, False, inv),
        ),
    ]


def demo_specs() -> list:
    """The kernels of the demo's ops (Llama-3-8B shapes, bf16)."""
    vec = rope.rope_vec("bfloat16", 128, 128, False)
    llama31 = rope.RopeSpec("bfloat16", "int32", 128, 128, False, "llama31", "pos_ids", False,
                            vec)  # fmt: skip
    return [*norm.specs_for(4096, ("bfloat16",)), *activation.specs_for(14336, ("bfloat16",)),
            llama31]  # fmt: skip


def _median_us(fn, repeat=50) -> float:
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def run_demo(arch: str | None) -> int:
    if arch is None:
        print("compiling the demo's kernels (llama3-8b shapes) for sm_90a instead")
        start = time.perf_counter()
        specs = demo_specs()
        for spec in specs:
            jit.compile_spec(spec, "sm_90a")
        print(f"{len(specs)} modules ready in {time.perf_counter() - start:.2f} s")
        return 0
    print(f"rtcinfer demo on {arch}: bf16, checked against float64 NumPy")
    ok = True
    for name, fn, expected in _cases(np.random.default_rng(0)):
        t = time.perf_counter()
        result = fn()
        first_ms = (time.perf_counter() - t) * 1e3
        got = result.get().astype(np.float64)
        err = float(np.max(np.abs(got - expected)) / (np.max(np.abs(expected)) + 1e-30))
        good = err < 2e-2
        ok &= good
        us = _median_us(fn)
        status = "ok" if good else "FAILED"
        first = f"first call {first_ms:.0f} ms"
        print(f"{name:<30} err {err:.1e} {status:6} {us:8.1f} us per call ({first})")
    return 0 if ok else 1
