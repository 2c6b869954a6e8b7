"""The README's examples run as written, on the GPU: the PyTorch, JAX and CuPy quick starts and
the attention example (paged prefill, decode, sampling, MLA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("markers, needs", [
    (("rtcinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos)",), "torch"),
    (("def mlp_in(x, residual, w, gate_up):",), "jax"),
    (("q_rope, k_rope = rtcinfer.apply_rope(",), "cupy"),
    (("prefill = rtcinfer.BatchPrefillWithPagedKVCacheWrapper()",
      "mla = rtcinfer.BatchMLAPagedAttentionWrapper()"), "torch"),
])  # fmt: skip
def test_a_readme_example_runs(markers, needs):
    """The README blocks holding `markers`, executed in order in one fresh namespace (the MLA
    block continues the attention one)."""
    module = pytest.importorskip(needs)
    if needs == "jax" and module.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    namespace: dict = {}
    for marker in markers:
        (block,) = [b for b in python_blocks() if marker in b]
        exec(compile(block, f"README ({marker})", "exec"), namespace)  # noqa: S102
