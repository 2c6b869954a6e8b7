"""FlashInfer's POD-Attention wrappers: the prefill and the decode of one serving step in one
call. PODWithPagedKVCacheWrapper takes one request's prefill chunk (q_p over its own k_p, v_p)
beside a batch of decode requests over the paged cache; BatchPODWithPagedKVCacheWrapper a
batch of prefill requests and a batch of decode requests, both over paged caches.

FlashInfer fuses the two into one launch whose CTAs take either kind of work. Here they are
two launches side by side (side_stream.py): the prefill on the caller's stream, launched
first, and the decode on a second stream forked from it and joined back, so that the
memory-bound decode runs beside the compute-bound prefill as POD intends (JAX arrays, and
calls while torch.compile traces, run them one after the other). Each side computes what its
own API does:

    prefill:  single_prefill_with_kv_cache (POD) / BatchPrefillWithPagedKVCacheWrapper (batch)
    decode:   BatchDecodeWithPagedKVCacheWrapper (POD) / the paged prefill wrapper over
              qo_indptr_d, not causal (batch: FlashInfer's decode side)

with the plan's position encoding, window, sm_scale and RoPE on the decode side (both sides
for the batch wrapper), as FlashInfer takes them. FlashInfer accepts run() options for the
decode side that it then ignores; here one that differs from the plan raises.
"""

from __future__ import annotations

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .run_options import refuse
from .side_stream import empty_like_in, side_by_side
from .single_prefill import single_prefill_with_kv_cache


def _rows(x) -> int:
    shape = getattr(x, "shape", ())
    return int(shape[0]) if len(shape) else 0


def _half(buffer, which: int):
    """Half `which` (0 or 1) of a 1-D byte workspace, cut at a 256-byte boundary (FlashInfer
    gives each side of the batch wrapper half of it); None stays None."""
    if buffer is None:
        return None
    cut = int(buffer.shape[0]) // 2 // 256 * 256
    return buffer[:cut] if which == 0 else buffer[cut:]


def _check_decode_options(cfg, kv_layout: str, options: dict) -> None:
    """run()'s decode-side options (FlashInfer's defaults, or the plan's own values) against
    the plan's Config `cfg`."""
    given = {
        "kv_layout_d": (options["kv_layout_d"], "NHD", kv_layout),
        "pos_encoding_mode_d": (options["pos_encoding_mode_d"], "NONE", cfg.pos_encoding_mode),
        "window_left_d": (options["window_left_d"], -1, cfg.window_left),
        "sm_scale_d": (options["sm_scale_d"], None, cfg.sm_scale),
        "rope_scale_d": (options["rope_scale_d"], None, cfg.rope_scale),
        "rope_theta_d": (options["rope_theta_d"], None, cfg.rope_theta),
    }
    for name, (value, default, planned) in given.items():
        if value != default and value != planned:
            raise ValueError(
                f"run({name}={value!r}) differs from the plan's ({planned!r}): the decode side "
                "runs as planned; plan() with it"
            )
    refuse("a decode-side custom mask (a decode query sees every key of its request)",
           custom_mask_d=options["custom_mask_d"],
           packed_custom_mask_d=options["packed_custom_mask_d"])  # fmt: skip


class PODWithPagedKVCacheWrapper:
    """FlashInfer's PODWithPagedKVCacheWrapper: plan() the decode batch (as batch decode's
    plan(), without the soft cap), then run(q_p, k_p, v_p, q_d, paged_kv_cache_d, ...) ->
    (out_p, out_d): out_p [qo_len, Hq, D] of single_prefill_with_kv_cache(q_p, k_p, v_p) with
    run()'s prefill options, out_d [B, Hq, D] of the planned decode. As FlashInfer's, the
    LSEs are not returned (return_lse_p / return_lse_d are accepted)."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, jit_args=None):  # fmt: skip
        refuse("custom attention variants", jit_args=jit_args)
        self._kv_layout = kv_layout
        self._decode = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, use_cuda_graph,
            paged_kv_indptr_buffer=paged_kv_indptr_buffer,
            paged_kv_indices_buffer=paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
        )  # fmt: skip

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._decode.is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """The decode side is planned into `float_workspace_buffer` from now on (plan() again
        before run())."""
        self._decode.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
             rope_theta=None, non_blocking=True) -> None:  # fmt: skip
        """The decode batch's plan (BatchDecodeWithPagedKVCacheWrapper.plan)."""
        self._decode.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                          page_size, pos_encoding_mode=pos_encoding_mode,
                          window_left=window_left, q_data_type=q_data_type,
                          kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale,
                          rope_scale=rope_scale, rope_theta=rope_theta,
                          non_blocking=non_blocking)  # fmt: skip

    begin_forward = plan

    def run(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p=None,
            packed_custom_mask_p=None, causal_p=False, kv_layout_p="NHD",
            pos_encoding_mode_p="NONE", sm_scale_p=None, window_left_p=-1, rope_scale_p=None,
            rope_theta_p=None, return_lse_p=False, custom_mask_d=None,
            packed_custom_mask_d=None, causal_d=False, kv_layout_d="NHD",
            pos_encoding_mode_d="NONE", sm_scale_d=None, window_left_d=-1, rope_scale_d=None,
            rope_theta_d=None, q_scale=None, k_scale=None, v_scale=None, return_lse_d=False,
            use_fp16_qk_reduction=False, enable_pdl=None, *args) -> tuple:  # fmt: skip
        """(out_p, out_d) (module docstring). q_scale, k_scale, v_scale: the decode side's fp8
        calibration scales; causal_d changes nothing (a decode query is its request's last);
        use_fp16_qk_reduction: QK sums stay fp32."""
        if args:
            raise TypeError(f"run() takes no arguments past enable_pdl, got {len(args)} more")
        if self._decode._config is None:
            raise RuntimeError("plan() must be called before run()")
        _check_decode_options(self._decode._config, self._kv_layout, {
            "kv_layout_d": kv_layout_d, "pos_encoding_mode_d": pos_encoding_mode_d,
            "window_left_d": window_left_d, "sm_scale_d": sm_scale_d,
            "rope_scale_d": rope_scale_d, "rope_theta_d": rope_theta_d,
            "custom_mask_d": custom_mask_d, "packed_custom_mask_d": packed_custom_mask_d,
        })  # fmt: skip
        together = _rows(q_p) > 0 and _rows(q_d) > 0
        out_d = None
        if together:  # the side stream's decode writes an array made before the fork
            out_d = empty_like_in(q_d, tuple(q_d.shape), self._decode._plan_o_dtype())
        return side_by_side(
            q_p,
            lambda: single_prefill_with_kv_cache(
                q_p, k_p, v_p, custom_mask=custom_mask_p, packed_custom_mask=packed_custom_mask_p,
                causal=causal_p, kv_layout=kv_layout_p, pos_encoding_mode=pos_encoding_mode_p,
                sm_scale=sm_scale_p, window_left=window_left_p, rope_scale=rope_scale_p,
                rope_theta=rope_theta_p,
            ),
            lambda: self._decode.run(q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale,
                                     v_scale=v_scale, out=out_d),
            together=together,
        )  # fmt: skip


class BatchPODWithPagedKVCacheWrapper:
    """FlashInfer's BatchPODWithPagedKVCacheWrapper: plan() a prefill batch (qo_indptr_p over
    its page table) and a decode batch (qo_indptr_d over its own), with one set of heads,
    head_dim, position encoding, window and scales; run(q_p, paged_kv_cache_p, q_d,
    paged_kv_cache_d, causal_p=..., ...) -> (out_p, out_d), or ((out_p, lse_p), (out_d, lse_d))
    with return_lse. The prefill side's mask (causal_p, a custom mask) is given to run(), as
    FlashInfer takes it: plan() plans it for the latest run()'s causal_p (FlashInfer's default,
    False, before any), and a run() with another mask plans it again (a custom mask: at each
    run() that gives one). The decode
    side attends without a causal mask (FlashInfer's): each decode query sees every key of
    its request. Each side has half of float_workspace_buffer, as in FlashInfer."""

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD"):
        self._kv_layout = kv_layout
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(_half(float_workspace_buffer, 0),
                                                             kv_layout)  # fmt: skip
        self._decode = BatchPrefillWithPagedKVCacheWrapper(_half(float_workspace_buffer, 1),
                                                           kv_layout)  # fmt: skip
        self._tables_p = None  # the prefill batch's plan() arguments
        self._options: dict = {}
        self._mask_p = None  # the prefill side's planned mask: causal (a bool), None for custom
        self._causal_p = False  # the latest run()'s causal_p

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, qo_indptr_d,
             kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
             rope_theta=None, non_blocking=True) -> None:  # fmt: skip
        """Both batches' plans, the prefill side's for the latest run()'s causal_p."""
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        self._options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                             q_data_type=q_data_type, kv_data_type=kv_data_type,
                             sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                             non_blocking=non_blocking)  # fmt: skip
        self._tables_p = (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p,
                          num_qo_heads, num_kv_heads, head_dim, page_size)  # fmt: skip
        self._decode.plan(qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d,
                          num_qo_heads, num_kv_heads, head_dim, page_size, causal=False,
                          **self._options)  # fmt: skip
        self._mask_p = None
        self._plan_prefill(self._causal_p, None, None)

    begin_forward = plan

    def _plan_prefill(self, causal: bool, custom_mask, packed_custom_mask) -> None:
        masked = custom_mask is not None or packed_custom_mask is not None
        key = None if masked else bool(causal)
        if key is not None and key == self._mask_p:
            return
        self._prefill.plan(*self._tables_p, custom_mask=custom_mask,
                           packed_custom_mask=packed_custom_mask, causal=bool(causal),
                           **self._options)  # fmt: skip
        self._mask_p = key

    def run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p=None,
            packed_custom_mask_p=None, causal_p=False, q_scale=None, k_scale=None,
            v_scale=None, return_lse=False, use_fp16_qk_reduction=False,
            enable_pdl=None) -> tuple:  # fmt: skip
        """(out_p, out_d), or ((out_p, lse_p), (out_d, lse_d)) when return_lse; q_scale,
        k_scale, v_scale apply to the decode side (FlashInfer's); use_fp16_qk_reduction: QK
        sums stay fp32."""
        if self._tables_p is None:
            raise RuntimeError("plan() must be called before run()")
        self._plan_prefill(causal_p, custom_mask_p, packed_custom_mask_p)
        self._causal_p = bool(causal_p)
        together = _rows(q_p) > 0 and _rows(q_d) > 0
        out_d = lse_d = None
        if together:  # the side stream's decode writes arrays made before the fork
            out_d = empty_like_in(q_d, tuple(q_d.shape), self._decode._plan_o_dtype())
            if return_lse:
                lse_d = empty_like_in(q_d, tuple(q_d.shape[:2]), "float32")
        return side_by_side(
            q_p,
            lambda: self._prefill.run(q_p, paged_kv_cache_p, return_lse=return_lse),
            lambda: self._decode.run(q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale,
                                     v_scale=v_scale, out=out_d, lse=lse_d,
                                     return_lse=return_lse),
            together=together,
        )  # fmt: skip


__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]
