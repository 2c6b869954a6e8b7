"""`rtcinfer warmup --model M` compiles what a serving loop of M launches: on a fake device the
kernels a scripted step asks for (tests/model_step.py) are exactly the specs warmup compiles;
on the GPU the step runs from a warmed cache with compiling forbidden."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtcinfer import catalog, cli

from . import model_step
from .fakes import FakeDevice, MetaArrays

pytest.importorskip("torch")  # meta tensors stand in for device arrays

# (compute capability, SMs, opt-in shared memory per block): an H200 and an A100
GPUS = {"sm_90a": ((9, 0), 132, 227 * 1024), "sm_80": ((8, 0), 108, 163 * 1024)}


def _step_specs(monkeypatch, model, dtype, kv_dtype, arch):
    cc, sms, max_smem = GPUS[arch]
    device = FakeDevice(monkeypatch, cc=cc, sms=sms, max_smem=max_smem)
    model_step.run(model, dtype, kv_dtype, MetaArrays())
    return device.specs


@pytest.mark.parametrize("arch", list(GPUS))
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("model", list(catalog.MODELS))
def test_warmup_compiles_what_a_step_launches(monkeypatch, model, kv_dtype, arch):
    """Every kernel of the step is warmed up, and warmup compiles nothing the step does not
    launch (the catalog's shared memory for the arch is the GPU's). An MLA model's latent
    cache is of q's dtype: an fp8 one is refused by name."""
    if catalog.MODELS[model].kv_lora_rank and kv_dtype is not None:
        with pytest.raises(ValueError, match="MLA's latent cache is of q's dtype"):
            catalog.model_specs(model, "bfloat16", kv_dtype, catalog.target(arch))
        return
    launched = set(_step_specs(monkeypatch, model, "bfloat16", kv_dtype, arch))
    warmed = catalog.model_specs(model, "bfloat16", kv_dtype, catalog.target(arch))
    assert len(warmed) == len(set(warmed))
    missing = sorted(map(repr, launched - set(warmed)))
    assert not missing, f"launched but not warmed up: {missing}"
    assert sorted(map(repr, set(warmed) - launched)) == []


def test_a_float16_step_and_the_gpus_own_shared_memory(monkeypatch):
    """float16 activations and logits; a GPU whose shared memory the caller gives (as warmup
    does for the GPU it runs on) sizes decode and prefill as that GPU will."""
    launched = set(_step_specs(monkeypatch, "llama3-8b", "float16", None, "sm_90a"))
    assert launched == set(catalog.model_specs("llama3-8b", "float16"))
    small = catalog.target("sm_90a", 99 * 1024)
    assert {s.stages for s in catalog.model_specs("llama3-8b", on=small) if hasattr(s, "stages")}
    assert set(catalog.model_specs("llama3-8b", on=small)) != set(catalog.model_specs("llama3-8b"))


def test_targets_of_known_and_unknown_archs():
    assert catalog.target("sm_90a") == catalog.Target("sm_90a", 227 * 1024)
    assert catalog.target("sm_86").max_smem == 99 * 1024
    assert catalog.target("sm_80", 1000).max_smem == 1000  # the GPU's own value wins
    assert catalog.target("sm_75").max_smem == 99 * 1024  # not in the table: the least
    assert catalog.target("sm_90a").compute_capability == 90


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_a_warmed_cache_serves_a_step_without_compiling(tmp_path, monkeypatch, kv_dtype):
    """`rtcinfer warmup` for this GPU into an empty cache, then the step in a new process with
    RTCINFER_NO_COMPILE=1: a kernel missing from the cache would raise CacheMissError."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RTCINFER_CACHE_DIR", str(cache))
    kv = [] if kv_dtype is None else [kv_dtype]
    assert cli.main(["warmup", "--model", "llama3-8b", *(["--kv-dtype", *kv] if kv else [])]) == 0
    env = {**os.environ, "RTCINFER_CACHE_DIR": str(cache), "RTCINFER_NO_COMPILE": "1"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "tests.model_step", "llama3-8b", "bfloat16", *kv], cwd=root,
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith(
        f"step ok: llama3-8b (bfloat16, KV {kv_dtype or 'bfloat16'})"
    )
