"""The decode examples: their NumPy references agree with the suite's (CPU), and each example
runs to its OK on the GPU (PyTorch, and JAX inside jax.jit)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from . import reference_attention as aref

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("paged_cache", ROOT / "examples" / "paged_cache.py")
paged_cache = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(paged_cache)

PAGE, PAGES, HQ, HKV, D = 16, 64, 8, 2, 32


def _grown_table(rng):
    table = paged_cache.PageTable([37, 16, 1, 100], PAGE, PAGES, rng)
    table.grow()
    table.grow()
    return table


def test_the_page_table_grows_by_a_page_at_each_boundary():
    table = paged_cache.PageTable([15, 16, 1], PAGE, PAGES, np.random.default_rng(0))
    before = [list(p) for p in table.pages]
    table.grow()
    assert table.lengths == [16, 17, 2]
    assert [len(p) for p in table.pages] == [1, 2, 1] and table.pages[0] == before[0]
    indptr, indices, last = table.arrays()
    np.testing.assert_array_equal(indptr, [0, 1, 3, 4])
    np.testing.assert_array_equal(last, [16, 1, 2])
    assert len(set(indices.tolist())) == 4 and indices.dtype == np.int32
    assert table.last_tokens() == [(table.pages[0][0], 15), (table.pages[1][1], 0),
                                   (table.pages[2][0], 1)]  # fmt: skip


def test_the_examples_references_agree_with_the_suites():
    """The examples' append and attention against tests/reference.py on the same table."""
    rng = np.random.default_rng(0)
    table = _grown_table(rng)
    indptr, indices, last = table.arrays()
    cache = rng.standard_normal((PAGES, 2, PAGE, HKV, D))
    k, v = rng.standard_normal((2, 4, HKV, D))
    positions = np.array(table.lengths) - 1
    expected = aref.append_paged_kv_cache_ref(k, v, np.arange(4), positions, cache, indices,
                                             indptr, last)  # fmt: skip
    paged_cache.append(cache, table, k, v)
    np.testing.assert_array_equal(cache, expected)
    q = rng.standard_normal((4, HQ, D))
    np.testing.assert_allclose(paged_cache.attention(q, cache, table),
                               aref.batch_decode_paged_ref(q, cache, indptr, indices, last),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_check_step_says_ok_only_when_everything_holds(capsys):
    rng = np.random.default_rng(1)
    table = _grown_table(rng)
    cache = rng.standard_normal((PAGES, 2, PAGE, HKV, D))
    q = rng.standard_normal((4, HQ, D))
    o = paged_cache.attention(q, cache, table)
    logits = rng.standard_normal((4, 1000))
    best = np.argmax(logits, axis=1)
    assert paged_cache.check_step(0, table, cache, q, o, cache.copy(), logits, best, 50)
    assert capsys.readouterr().out.endswith(": OK\n")
    worst = np.argmin(logits, axis=1)
    assert not paged_cache.check_step(1, table, cache, q, o, cache, logits, worst, 50)
    assert "NOT in the top 50: FAIL" in capsys.readouterr().out
    assert not paged_cache.check_step(2, table, cache, q, o * 1.1, cache, logits, best, 50)
    changed = cache.copy()
    changed[table.pages[0][0], 0, 0, 0, 0] += 1
    assert not paged_cache.check_step(3, table, cache, q, o, changed, logits, best, 50)
    assert "cache WRONG" in capsys.readouterr().out


def _example_lines(example: str) -> list[str]:
    """The output lines of examples/`example` run in a new process, which must exit 0 with OK."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    return lines


def _run(example: str):
    assert sum(line.endswith(": OK") for line in _example_lines(example)) == 3


@pytest.mark.gpu
def test_the_pytorch_decode_example_runs():
    pytest.importorskip("torch")
    _run("decode_step.py")


@pytest.mark.gpu
def test_the_jax_decode_example_runs():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    _run("decode_step_jax.py")


def _serve(example: str):
    lines = _example_lines(example)
    assert sum(line.startswith("request ") for line in lines) >= 8
    assert any("tokens/s" in line for line in lines)


@pytest.mark.gpu
def test_the_pytorch_serving_loop_matches_its_dense_reference():
    """examples/serve_torch.py: continuous batching with paged prefill and batch decode; the
    example itself checks every token's logits against a dense PyTorch model."""
    pytest.importorskip("torch")
    _serve("serve_torch.py")


@pytest.mark.gpu
def test_the_tensor_parallel_jax_loop_matches_the_one_device_loop():
    """examples/serve_jax_tp.py over every GPU JAX sees (the heads split over the mesh with
    shard_map; on one GPU a mesh of one): its tokens checked against the dense reference and
    the one-device loop's, no retrace on a second pass, the all-reduce's share printed."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    lines = _example_lines("serve_jax_tp.py")
    assert sum(line.startswith("request ") for line in lines) >= 8
    assert any("in the all-reduce" in line for line in lines)
    assert any(line.startswith("tokens: the same") for line in lines) or len(jax.devices()) > 1


@pytest.mark.gpu
def test_the_tensor_parallel_pytorch_loop_matches_the_one_gpu_loop():
    """examples/serve_torch_tp.py under torchrun, a process per GPU (on one GPU one process;
    NCCL's all-reduce over one rank): every token checked against the dense reference and the
    one-GPU loop's, eager and with its decode steps captured in CUDA graphs, the all-reduce's
    share printed."""
    torch = pytest.importorskip("torch")
    n = torch.cuda.device_count()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                           str(ROOT / "examples" / "serve_torch_tp.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    assert sum(line.startswith("request ") for line in lines) >= 16  # eager and graphs
    assert any("in the all-reduce" in line for line in lines)
    assert sum("tokens the same as" in line for line in lines) == 2 or n > 1


@pytest.mark.gpu
def test_the_jax_serving_loop_matches_its_dense_reference_without_retracing():
    """examples/serve_jax.py: the same loop inside jax.jit, checked against a dense JAX model;
    a second pass with other page tables traces nothing new."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    _serve("serve_jax.py")


def _serving():
    spec = importlib.util.spec_from_file_location("serving", ROOT / "examples" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_serving_check_takes_near_ties_and_refuses_errors_and_nan(capsys):
    """The serving loops' check: a token equal to the reference's argmax or within twice the
    logits' error of it passes; a non-finite row, a wrong token or a large error fails."""
    serving = _serving()
    want = np.array([0.0, 3.0, 2.995, -1.0])
    reference = lambda tokens: want  # noqa: E731

    def done(token, row):
        r = serving.Request(0, [5, 6], 1)
        r.emitted.append((2, token, np.asarray(row), "decode of 1"))
        r.tokens.append(token)
        return [r]

    assert serving.check(done(1, want + 0.001), reference)
    assert serving.check(done(2, want + [0, -0.004, 0.004, 0]), reference)  # a near tie
    assert not serving.check(done(0, want), reference)  # not the argmax, no tie
    assert not serving.check(done(1, want + 0.5), reference)  # error over 3e-2 of max |logit|
    nan = want.copy()
    nan[3] = np.nan
    assert not serving.check(done(1, nan), reference, lambda row: 0)
    out = capsys.readouterr().out
    assert "non-finite logits 1, sampled again 0: MISMATCH" in out
    assert "request 0 at context 2 (decode of 1): token 0, argmax 1" in out


def test_a_serving_step_grows_pages_and_lays_out_the_tables():
    """serving.Step: new pages from the free list as a request's tokens cross a page, the
    page table FlashInfer's way, and each new token's position and request."""
    serving = _serving()
    a, b = serving.Request(0, list(range(20)), 1), serving.Request(1, [7, 8], 1)
    free = [9, 8, 7, 6, 5]
    step = serving.Step([a, b], [20, 2], free)  # prefill: 20 tokens (2 pages) and 2 (1 page)
    assert (a.pages, b.pages, free) == ([5, 6], [7], [9, 8])
    assert step.indptr.tolist() == [0, 2, 3] and step.indices.tolist() == [5, 6, 7]
    assert step.last.tolist() == [20 - serving.PAGE, 2] and step.padded[:3].tolist() == [5, 6, 7]
    assert step.qo_indptr.tolist() == [0, 20, 22] and step.ends.tolist() == [19, 21]
    assert step.positions.tolist() == [*range(20), 0, 1]
    assert step.batch_indices.tolist() == [0] * 20 + [1, 1]
    assert step.tokens.tolist() == [*range(20), 7, 8]
    a.tokens.append(3)
    step = serving.Step([a], [1], free)  # decode: the 21st token stays in page 6
    assert step.positions.tolist() == [20] and step.tokens.tolist() == [3] and a.pages == [5, 6]


@pytest.mark.parametrize("xp_name", ["numpy", "jax.numpy"])
def test_decode_tables_from_the_block_table_are_the_steps(xp_name):
    """serving.decode_tables (what serve_jax's decode step builds on the device from tokens,
    positions and the block table) gives serving.Step's tables for a decode step: requests
    that cross into a new page, fill one exactly, or hold one token, pages reserved ahead in
    the block table, and indices padded to the pool."""
    xp = pytest.importorskip(xp_name)
    serving = _serving()
    rng = np.random.default_rng(3)
    free = [int(p) for p in rng.permutation(serving.PAGES)]
    lengths = [16, 15, 0, 33, 100, 31]  # cached before the step: 16 and 0 take a new page
    requests = [serving.Request(i, list(range(n)), 1) for i, n in enumerate(lengths)]
    serving.Step(requests, lengths, free)  # the prompts
    for r in requests:
        r.tokens.append(7 + r.rid)
    step = serving.Step(requests, [1] * len(requests), free)
    blocks = serving.block_table(requests, 12)
    blocks[:, -2:] = rng.integers(0, serving.PAGES, (len(requests), 2))  # reserved ahead
    assert all(len(r.pages) <= 10 for r in requests)
    got = serving.decode_tables(xp, xp.asarray(step.tokens), xp.asarray(step.positions),
                                xp.asarray(blocks), serving.PAGES)  # fmt: skip
    want = (step.tokens, step.positions, step.batch_indices, step.padded, step.indptr,
            step.last, step.ends)  # fmt: skip
    for name, g, w in zip(("tokens", "positions", "batch indices", "indices", "indptr", "last",
                           "ends"), got, want, strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


def test_shard_columns_give_each_shard_its_share_of_every_part():
    """serving.shard_columns: qkv of 4 q, 2 k and 2 v columns over 2 shards gives shard 0 q
    columns 0-1, k column 4 and v column 6, and shard 1 the rest; one shard keeps the order."""
    serving = _serving()
    assert serving.shard_columns([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert serving.shard_columns([3, 3], 1).tolist() == list(range(6))
    order = serving.shard_columns([serving.HQ * 2, serving.HKV * 2, serving.HKV * 2], 4)
    assert sorted(order.tolist()) == list(range((serving.HQ + 2 * serving.HKV) * 2))
