"""A batch prefill plan's kernel and launch: the tile rows for a batch, the kernel of a
configuration and tile (warpgroup MMAs where the device has them), and plan_launch, which
plans the work and fills every launch field the plan and configuration fix
(attention/prefill_wrapper.py adds the arrays' and the workspace's)."""

from __future__ import annotations

import numpy as np

from ..jit import device_arch
from ..launch import Launch
from ..plan import prefill as planner
from ..plan.prefill import PrefillPlan, TilePlan
from .decode_kernel import fast_div
from .prefill_args import PrefillConfig
from .prefill_kernel import (
    busy_decode_spec,
    kernel,
    mla_spec,
    prefill_spec,
    use_wgmma,
    wide_decode_spec,
)
from .prefill_plan import RAGGED_PAGE

MAX_GRID_Y = 65535


def pick_tile_rows(cfg: PrefillConfig, qo_indptr, wgmma: bool = False) -> int:
    """Packed query rows per CTA: plan/prefill.py's choice for the batch and kernel (wgmma_on);
    MLA (mla_spec): 16 where that would be 8 or 16 (up to 16 packed rows a request), else 32."""
    attn = cfg.attn
    queries, batch = int(qo_indptr[-1]) - int(qo_indptr[0]), len(qo_indptr) - 1
    rows = planner.tile_rows_for(queries, batch, attn.group_size, attn.head_dim, wgmma)
    if cfg.mla:
        return 16 if rows <= 16 else 32
    return rows


def wgmma_on(cfg: PrefillConfig, device: int) -> bool:
    """Whether the device runs the configuration's 64- and 128-row tiles on warpgroup MMAs."""
    a = cfg.attn
    return not cfg.mla and use_wgmma(device_arch(device), 128, a.pos_encoding_mode, a.q_dtype,
                                     a.kv_dtype)  # fmt: skip


def spec_for(cfg: PrefillConfig, tile_rows: int, max_smem: int, wgmma: bool):
    """prefill_spec's kernel of a configuration and tile (warpgroup MMAs for 64- and 128-row
    tiles where wgmma)."""
    attn = cfg.attn
    if cfg.mla:
        return mla_spec(attn.q_dtype, attn.o_dtype, tile_rows, cfg.causal, max_smem)
    return prefill_spec(attn.q_dtype, attn.o_dtype, attn.head_dim, tile_rows, cfg.causal,
                        attn.pos_encoding_mode, attn.logits_soft_cap > 0, max_smem,
                        cfg.custom_mask, attn.kv_dtype, attn.page_size == RAGGED_PAGE,
                        wgmma=wgmma and tile_rows in (64, 128),
                        head_dim_vo=cfg.head_dim_vo)  # fmt: skip


def kernel_for(cfg: PrefillConfig, tile_rows: int, device: int, max_smem: int, wgmma: bool,
               spec=None):  # fmt: skip
    """(the kernel of a configuration and tile, its resident CTAs per SM on the device);
    wgmma: wgmma_on(cfg, device), whose kernel takes 64- and 128-row tiles; spec: a variant of
    the tile's kernel to take instead (decode_tile_spec's), else spec_for's."""
    spec = spec or spec_for(cfg, tile_rows, max_smem, wgmma)
    k = kernel(spec)
    return k, max(1, k.occupancy(device, spec.threads))


def chosen_kernel(kernels: dict, cfg: PrefillConfig, device: int, max_smem: int,
                  tile_rows: int | None = None, spec=None):  # fmt: skip
    """wgmma_on(cfg, device) (tile_rows None) or kernel_for's (kernel, CTAs a SM) of a tile
    (or of its variant `spec`), asked once per configuration: `kernels` is a wrapper's cache,
    emptied when its configuration changes (RTCINFER_PREFILL_WGMMA is read at the
    configuration's first plan)."""
    if None not in kernels:
        kernels[None] = wgmma_on(cfg, device)
    key = (tile_rows, spec) if spec else tile_rows
    if key not in kernels:
        kernels[key] = kernel_for(cfg, tile_rows, device, max_smem, kernels[None], spec)
    return kernels[key]


def leaves_sms_idle(qo_indptr, group_size: int, num_kv_heads: int, num_sms: int,
                    tile_rows: int = 16) -> bool:  # fmt: skip
    """Whether a batch of tile_rows-row tiles gives fewer CTAs than SMs (tiles x kv heads <=
    SMs): a decode batch of up to num_sms / num_kv_heads requests."""
    indptr = np.asarray(qo_indptr, dtype=np.int64)
    qo_len = indptr[1:] - indptr[:-1]
    return int((-(-qo_len * group_size // tile_rows)).sum()) * num_kv_heads <= num_sms


def decode_tile_spec(cfg: PrefillConfig, qo_indptr, tile_rows: int, limits: tuple):
    """The variant kernel of a decode-shaped batch (8- or 16-row tiles): wide_decode_spec's
    128-key K/V tiles where its CTAs leave SMs idle, busy_decode_spec's (fp8's 64-key tiles)
    where they do not; None where the configuration's kernel has no such variant."""
    if tile_rows > 16 or cfg.mla:
        return None
    num_sms, max_smem = limits
    spec = spec_for(cfg, tile_rows, max_smem, False)
    if leaves_sms_idle(qo_indptr, cfg.attn.group_size, cfg.attn.num_kv_heads, num_sms, tile_rows):
        return wide_decode_spec(spec, max_smem)
    return busy_decode_spec(spec)


def plan_launch(
    cfg: PrefillConfig, qo_indptr, kv_len, device: int, limits: tuple, fixed_split_size=None,
    disable_split_kv=False, tile_rows=None, max_work=None, device_items=False, kernels=None,
    keep=None,
) -> tuple[Launch, PrefillPlan | TilePlan]:  # fmt: skip
    """The kernel, the work plan of (qo_indptr, kv_len) and its launch with every field that
    depends only on them and the configuration filled (the plan's regions and the arrays'
    pointers and strides are the caller's). A CUDA-graph capacity fixes tile_rows and the
    grid (max_work items; those past the plan's count exit at once). `device_items`: a plan
    without split KV comes as a TilePlan, its items to be expanded on the device. `kernels`:
    a wrapper's cache of the configuration's choices (chosen_kernel). `keep(kernel, grid)`: a
    launch to keep instead of a new one, or None (PlannedWrapper._kept_launch)."""
    attn = cfg.attn
    num_sms, max_smem = limits
    group = attn.group_size
    kernels = {} if kernels is None else kernels
    wgmma = chosen_kernel(kernels, cfg, device, max_smem)
    if tile_rows is None:
        tile_rows = pick_tile_rows(cfg, qo_indptr, wgmma=wgmma)
    variant = None  # not where a fixed capacity (a CUDA graph, a plan array) fixes the kernel
    if max_work is None:
        variant = decode_tile_spec(cfg, qo_indptr, tile_rows, limits)
    k, ctas = chosen_kernel(kernels, cfg, device, max_smem, tile_rows, variant)
    spec = k.spec
    if fixed_split_size is not None and int(fixed_split_size) == -1:
        fixed_split_size = None
    tiles = plan = None
    if device_items:
        tiles = planner.tile_counts(qo_indptr, kv_len, group, tile_rows)
        if planner.fills_gpu(tiles, attn.num_kv_heads, num_sms=num_sms, ctas_per_sm=ctas,
                     fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                     max_work=max_work, causal=cfg.causal, window_left=attn.window_left,
                     page_size=1 if attn.page_size == RAGGED_PAGE else attn.page_size,
                     kv_tile=spec.kv_tile):  # fmt: skip
            plan = tiles
    plan = plan or planner.plan_prefill(
        qo_indptr, kv_len, group, attn.num_kv_heads, attn.head_dim, num_sms=num_sms,
        ctas_per_sm=ctas, causal=cfg.causal, window_left=attn.window_left,
        page_size=1 if attn.page_size == RAGGED_PAGE else attn.page_size,
        tile_rows=tile_rows, fixed_split_size=fixed_split_size,
        disable_split_kv=disable_split_kv, max_work=max_work, tiles=tiles, kv_tile=spec.kv_tile,
    )  # fmt: skip
    items = plan.num_work if max_work is None else max_work
    if items > MAX_GRID_Y:
        raise ValueError(
            f"{items} work items exceed the grid limit ({MAX_GRID_Y}): plan the batch in parts "
            "or use a larger fixed_split_size"
        )
    grid = (attn.num_kv_heads, items, 1)
    if keep is not None and (kept := keep(k, grid)) is not None:
        return kept, plan
    launch = Launch(k, grid, (spec.threads, 1, 1))
    p = launch.params
    p.num_qo_heads, p.group_size, p.page_size = attn.num_qo_heads, group, attn.page_size
    p.div_magic, p.div_shift = fast_div(attn.page_size)
    p.group_magic, p.group_shift = fast_div(group)
    p.window_left, p.soft_cap = attn.window_left, attn.logits_soft_cap
    return launch, plan


__all__ = [
    "MAX_GRID_Y",
    "chosen_kernel",
    "decode_tile_spec",
    "kernel_for",
    "leaves_sms_idle",
    "pick_tile_rows",
    "plan_launch",
    "spec_for",
    "wgmma_on",
]
