"""Cold start: a never-seen kernel compiled by NVRTC, and a new process on a warm disk cache.

Each measurement runs in a fresh Python process with its own cache folder, after CUDA context
creation (which any GPU program pays), timing `jit.get_function` (spec -> loaded kernel) and the
first `rtcinfer.rmsnorm` call end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from bench.common import Table

_CHILD = r"""
import json, time
t0 = time.perf_counter()
import cupy, rtcinfer
from rtcinfer import jit
from rtcinfer.norm import norm_spec
from rtcinfer.rope import RopeSpec, rope_vec
import_ms = (time.perf_counter() - t0) * 1e3
cupy.cuda.Device(0).use(); cupy.zeros(1).sum()  # the CUDA context every GPU program creates
specs = {
    "rmsnorm bf16 8192": (norm_spec("rmsnorm", "bfloat16", "bfloat16", 8192), "norm_kernel"),
    "rope llama31 bf16 128": (RopeSpec("bfloat16", "int32", 128, 128, False, "llama31", "indptr",
                               True, rope_vec("bfloat16", 128, 128, False)), "rope_kernel"),
}
out = {"import_ms": import_ms}
for name, (spec, fn) in specs.items():
    t = time.perf_counter(); jit.get_function(spec, fn); out[name] = (time.perf_counter() - t) * 1e3
x = cupy.ones((4096, 8192), dtype="float32")
w = cupy.ones(8192, dtype="float32")
t = time.perf_counter(); rtcinfer.rmsnorm(x, w); cupy.cuda.runtime.deviceSynchronize()
out["first rmsnorm call (fp32 spec, cold)"] = (time.perf_counter() - t) * 1e3
print(json.dumps(out))
"""


def child(cache: str) -> dict:
    env = {**os.environ, "RTCINFER_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> Table:
    table = Table("cold start (new process each)", ["what", "empty cache ms", "warm cache ms"])
    with tempfile.TemporaryDirectory() as cache:
        cold = child(cache)
        warm = child(cache)
    for key in cold:
        table.add(key, cold[key], warm[key])
    return table


if __name__ == "__main__":
    print(main().markdown())
