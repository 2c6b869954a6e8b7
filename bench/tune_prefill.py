"""The prefill kernel's configurations timed on this GPU (graph view, CuPy arrays): query tile
rows x rows a warp (mma.sync) or warpgroup MMAs (wgmma, sm_90a, also with registers capped for
two CTAs per SM) x KV tile keys x ring stages, for a few prompt shapes over ragged K/V and (the
wgmma configurations) a paged cache, with the registers, spilled bytes, shared memory and
resident CTAs per SM of each. The defaults (rtcinfer/attention/prefill_kernel.py,
plan/prefill.py) come from these numbers.

    python -m bench.tune_prefill            # ragged and paged
    python -m bench.tune_prefill paged      # one KV form
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

import rtcinfer
from bench.bench_decode import random_cache
from bench.bench_prefill import (
    FORMS,
    MIXED,
    PAGE,
    kv_arrays,
    plan_tables,
    run_arguments,
    visible_pairs,
)
from bench.common import Table, Tables, cupy, graph_time_us, header
from rtcinfer import jit
from rtcinfer.attention import prefill_launch
from rtcinfer.attention.prefill_kernel import PrefillSpec
from rtcinfer.gpu import arch_of
from rtcinfer.interop.dtypes import numpy_dtype

# label, qo_len of each request, Hq, Hkv, head_dim (or (q's, v's)), causal
SHAPES = [
    ("4 x 4096", (4096,) * 4, 32, 8, 128, True),
    ("4 x 4096, non-causal", (4096,) * 4, 32, 8, 128, False),
    ("16 x 1024", (1024,) * 16, 32, 8, 128, True),
    ("32 x 512", (512,) * 32, 32, 8, 128, True),
    ("4 x 4096, head_dim 256", (4096,) * 4, 32, 8, 256, True),
    ("64 x 16-240 (mixed)", MIXED, 32, 8, 128, True),
    ("4 x 4096, head_dim 192 / 128", (4096,) * 4, 16, 16, (192, 128), True),
    ("16 x 1024, head_dim 192 / 128", (1024,) * 16, 16, 16, (192, 128), True),
]
# (query tile rows, rows per warp, wgmma, min CTAs per SM): mma.sync with 16 rows a warp, or 32
# (two MMA row blocks) in 128-row tiles; warpgroup MMAs (sm_90a) over 64-row warpgroups, 64-key
# tiles, also with registers capped for two CTAs per SM (the paged 128-row kernel's need)
TILES = ((64, 16, False, 0), (128, 16, False, 0), (128, 32, False, 0), (64, 16, True, 0),
         (128, 16, True, 0), (128, 16, True, 2))  # fmt: skip
# the paged cache (page 16, permuted pages) for these shapes, wgmma configurations only
PAGED = ("4 x 4096", "16 x 1024", "32 x 512", "64 x 16-240 (mixed)",
         "4 x 4096, head_dim 192 / 128")  # fmt: skip
KV_TILES = (32, 64)
STAGES = (2, 3)


def forced(tile_rows: int, warp_rows: int, kv_tile: int, stages: int, wgmma: bool = False,
           min_ctas: int = 0):  # fmt: skip
    """prefill_launch's prefill_spec and pick_tile_rows (what plan() asks) replaced by one
    fixed configuration."""

    def spec(q_dtype, o_dtype, head_dim, rows, causal=False, pos_encoding_mode="NONE",
             soft_cap=False, max_smem=0, custom_mask=False, kv_dtype=None,
             ragged=False, head_dim_vo=None, **_):  # fmt: skip
        return PrefillSpec(q_dtype, o_dtype, head_dim, rows, kv_tile, stages, bool(causal),
                           bool(custom_mask), pos_encoding_mode, bool(soft_cap),
                           kv_dtype or q_dtype, bool(ragged), warp_rows, wgmma, min_ctas,
                           False, None if head_dim_vo == head_dim else head_dim_vo)  # fmt: skip

    prefill_launch.prefill_spec = spec
    prefill_launch.pick_tile_rows = lambda cfg, qo_indptr, **_: tile_rows


def main(forms: tuple[str, ...] = ("ragged", "paged")) -> Tables:
    cp = cupy()
    bf16 = numpy_dtype("bfloat16")
    _, max_smem = jit.device_limits(cp.cuda.Device().id)
    arch = arch_of(cp.cuda.Device().compute_capability)
    print(header())
    table = Table("prefill kernel configurations (bf16, graph view)",
                  ["case", "KV", "tile rows", "warp rows", "wgmma", "min CTAs", "KV tile",
                   "stages", "regs", "spill B", "smem KiB", "CTAs/SM", "us",
                   "TFLOP/s"])  # fmt: skip
    rng = np.random.default_rng(0)
    cases = [(form, shape) for form in forms for shape in SHAPES
             if form == "ragged" or shape[0] in PAGED]  # fmt: skip
    for form, (label, qo_lens, hq, hkv, head_dims, causal) in cases:
        head_dim, head_dim_vo = head_dims if isinstance(head_dims, tuple) else (head_dims,) * 2
        qo_len = np.array(qo_lens, dtype=np.int32)
        tables = plan_tables(form, qo_len, qo_len, rng)
        kv = run_arguments(form, list(kv_arrays(form, tables, hkv, head_dim, head_dim_vo)),
                           head_dim, head_dim_vo)  # fmt: skip
        dims = (hq, hkv, head_dim) + ((PAGE,) if form == "paged" else ())
        q = random_cache((int(qo_len.sum()), hq, head_dim), "bfloat16")
        out = cp.empty((q.shape[0], hq, head_dim_vo), dtype=bf16)
        flops = 2 * (head_dim + head_dim_vo) * hq * visible_pairs(qo_len, qo_len, causal)
        for (rows, warp_rows, wgmma, min_ctas), kv_tile, stages in itertools.product(
                TILES, KV_TILES, STAGES):  # fmt: skip
            if warp_rows == 32 and (kv_tile == 64 or head_dim_vo != head_dim):
                continue  # S of 32 rows x 64 keys would not fit in registers beside O
            if wgmma and (kv_tile != 64 or arch != "sm_90a"):
                continue  # 64-key tiles; sm_90a only
            if (head_dim == 256 and not wgmma and rows == 128) or (form == "paged" and not wgmma):
                continue
            if min_ctas and (stages != 2 or head_dim > 128):
                continue  # two CTAs need the 2-stage ring's shared memory
            forced(rows, warp_rows, kv_tile, stages, wgmma, min_ctas)
            spec = prefill_launch.prefill_spec("bfloat16", "bfloat16", head_dim, rows, causal,
                                               ragged=form == "ragged",
                                               head_dim_vo=head_dim_vo)  # fmt: skip
            if spec.smem_bytes > max_smem:
                continue
            wrapper = getattr(rtcinfer, FORMS[form])()
            try:
                wrapper.plan(*tables, *dims, head_dim_vo=head_dim_vo, causal=causal,
                             q_data_type="bfloat16")  # fmt: skip
                us = graph_time_us(lambda w=wrapper: w.run(q, *kv, out=out))  # noqa: B023
            except Exception as e:  # noqa: BLE001 - a configuration that fails is reported
                print(f"# {label} {form} {rows}/{warp_rows}/{kv_tile}/{stages}: "
                      f"{type(e).__name__}: {e}"[:300])  # fmt: skip
                continue
            usage = jit.compile_spec(spec, arch).meta["resources"].get("prefill_kernel", {})
            ctas = wrapper._launch.launch.kernel.occupancy(cp.cuda.Device().id, spec.threads)
            spill = usage.get("spill_stores", 0) + usage.get("spill_loads", 0)
            table.add(label, form, rows, warp_rows, wgmma, min_ctas, kv_tile, stages,
                      usage.get("registers"), spill, spec.smem_bytes / 1024, ctas, us,
                      flops / us / 1e6)  # fmt: skip
    tables = Tables()
    tables.append(table)
    return tables


if __name__ == "__main__":
    print(main(tuple(sys.argv[1:]) or ("ragged", "paged")).markdown())
