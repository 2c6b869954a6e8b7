"""FlashInfer's deprecated forward() and forward_return_lse() of the attention wrappers: run()
with the plan parameters given again, which must be the latest plan()'s
(run_options.check_forward: each difference is named). FlashInfer lets them override the
plan's, running a schedule made for others; here the plan's stand, so `plan()` (or
`begin_forward()`) with the new ones, then `run()`. Mixins of the wrappers; the signatures are
FlashInfer 0.7.2's."""

from __future__ import annotations

from .decode_kernel import make_config
from .prefill_args import make_prefill_config
from .run_options import check_forward


class _PrefillForward:
    """The prefill wrappers' check of forward()'s plan parameters."""

    def _check_forward(self, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta) -> None:  # fmt: skip
        """forward()'s plan parameters against the latest plan()'s."""
        if self._launch is None:
            raise RuntimeError("plan() must be called before forward()")
        cfg = self._launch.cfg
        a = cfg.attn
        asked = make_prefill_config(a.num_qo_heads, a.num_kv_heads, a.head_dim, a.page_size,
                                    causal, pos_encoding_mode, window_left, logits_soft_cap,
                                    a.q_dtype, a.kv_dtype, a.o_dtype, sm_scale, rope_scale,
                                    rope_theta, cfg.custom_mask, cfg.head_dim_vo)  # fmt: skip
        check_forward(asked, cfg)


class RaggedForward(_PrefillForward):
    """BatchPrefillWithRaggedKVCacheWrapper's forward forms."""

    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None,
                rope_scale=None, rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated form of run(): the plan parameters must be the latest
        plan()'s (run_options.check_forward)."""
        self._check_forward(causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, k, v)

    def forward_return_lse(self, q, k, v, causal=False, pos_encoding_mode="NONE",
                           use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None,
                           sm_scale=None, rope_scale=None, rope_theta=None):  # fmt: skip
        """forward() returning (o, lse)."""
        self._check_forward(causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, k, v, return_lse=True)


class PagedForward(_PrefillForward):
    """BatchPrefillWithPagedKVCacheWrapper's forward forms."""

    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, k_scale=None, v_scale=None, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated form of run(): the plan parameters must be the latest
        plan()'s (run_options.check_forward)."""
        self._check_forward(causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                           use_fp16_qk_reduction=False, k_scale=None, v_scale=None,
                           window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None):  # fmt: skip
        """forward() returning (o, lse)."""
        self._check_forward(causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class DecodeForward:
    """BatchDecodeWithPagedKVCacheWrapper's forward forms (use_tensor_cores=True: the plan
    of its prefill wrapper)."""

    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None,
                v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None,
                rope_scale=None, rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated form of run(): the plan parameters must be the latest
        plan()'s (run_options.check_forward)."""
        self._check_forward(pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None,
                           k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                           sm_scale=None, rope_scale=None, rope_theta=None):  # fmt: skip
        """forward() returning (o, lse)."""
        self._check_forward(pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                            rope_scale, rope_theta)  # fmt: skip
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                        return_lse=True)  # fmt: skip

    def _check_forward(self, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta) -> None:  # fmt: skip
        """forward()'s plan parameters against the latest plan()'s."""
        st = self._launch if self._tc is None else self._tc._launch
        if st is None:
            raise RuntimeError("plan() must be called before forward()")
        cfg = st.cfg if self._tc is None else st.cfg.attn
        asked = make_config(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size,
                            pos_encoding_mode, window_left, logits_soft_cap, cfg.q_dtype,
                            cfg.kv_dtype, cfg.o_dtype, sm_scale, rope_scale,
                            rope_theta)  # fmt: skip
        check_forward(asked, cfg)


__all__ = ["DecodeForward", "PagedForward", "RaggedForward"]
