"""Why a small kernel's loop view (bench/common.py: 50 calls back to back) can exceed both its
host time and its graph view: per call, the wall time of 1,000 calls (the host's pace when the
GPU keeps up), the time to enqueue 50 (the host alone), the loop view with and without the L2
flush before it, and the graph view; for rtcinfer with dependent launches on and off, and
FlashInfer, on small and large norm rows (bf16, `out=` given, PyTorch tensors).

`python -m bench.loop_gap --no-trigger` compiles rtcinfer's kernels from a copy of cuda_src/
whose kernels do not let their dependents launch at their start (common.cuh's
wait_for_previous_grid): they launch when the grid exits, as FlashInfer's trigger at the end
of its kernels."""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

import rtcinfer
from bench.common import Table, Tables, callers, cupy, flush_l2, header, loop_us, peer
from bench.common import torch_graph_time_us as graph_us
from rtcinfer import dependent_launch, jit
from rtcinfer.interop.dtypes import numpy_dtype

SHAPES = [(1, 4096), (128, 4096), (128, 8192), (4096, 8192)]
_TRIGGER = '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'


def without_early_trigger() -> None:
    """Compile from a copy of the kernel sources without the early launch_dependents."""
    copy = pathlib.Path(tempfile.mkdtemp(prefix="rtcinfer_no_trigger_")) / "cuda_src"
    shutil.copytree(pathlib.Path(str(jit.source_root())), copy)
    common = copy / "common.cuh"
    text = common.read_text()
    if _TRIGGER not in text:
        raise SystemExit("common.cuh has no early launch_dependents to remove")
    common.write_text(text.replace(_TRIGGER, ""))
    jit.source_root = lambda: copy


def wall_us(fn, torch, n: int = 1000) -> float:
    """Least of 5 rounds of (wall time of n calls, synchronized) / n."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def enqueue_us(fn, torch, n: int = 50) -> float:
    """Least of 10 rounds of (host time to enqueue n calls behind an L2 flush) / n."""
    best = float("inf")
    for _ in range(10):
        flush_l2()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> Tables:
    if "--no-trigger" in sys.argv[1:]:
        without_early_trigger()
    fi, torch = peer("flashinfer"), peer("torch")
    if torch is None:
        raise SystemExit("bench.loop_gap needs PyTorch")
    print(header())
    cp, bf16 = cupy(), numpy_dtype("bfloat16")
    rng = np.random.default_rng(0)
    table = Table(
        "per call, us (bf16 rows, out= given)",
        ["op", "rows x hidden", "caller", "wall", "enqueue", "loop", "loop, no flush", "graph"],
    )
    for rows, hidden in SHAPES:
        x, r, o = (cp.asarray(rng.standard_normal((rows, hidden)).astype(bf16)) for _ in range(3))
        w = cp.asarray(rng.standard_normal(hidden).astype(bf16))
        (tx, tr, to, tw), _ = callers(x, r, o, w)
        calls = {
            "rmsnorm": (lambda: rtcinfer.rmsnorm(tx, tw, out=to),
                        fi and (lambda: fi.norm.rmsnorm(tx, tw, out=to))),
            "fused_add_rmsnorm": (lambda: rtcinfer.fused_add_rmsnorm(tx, tr, tw),
                                  fi and (lambda: fi.norm.fused_add_rmsnorm(tx, tr, tw))),
        }  # fmt: skip
        device = tx.get_device()
        supported = dependent_launch.enabled(device)  # sm_90+ unless RTCINFER_PDL=0
        for op, (ours, theirs) in calls.items():
            cases = [("rtcinfer, dependent", ours, True)] if supported else []
            cases += [("rtcinfer, plain", ours, False)]
            cases += [("FlashInfer", theirs, None)] if theirs else []
            for caller, fn, dependent in cases:
                if dependent is not None:  # the launches' setting switches at the next call
                    dependent_launch.DEVICES[device] = dependent
                fn()
                table.add(op, f"{rows} x {hidden}", caller, wall_us(fn, torch),
                          enqueue_us(fn, torch), loop_us(fn), loop_us(fn, flush=False),
                          graph_us(fn))  # fmt: skip
    return Tables([table])


if __name__ == "__main__":
    print(main().markdown())
