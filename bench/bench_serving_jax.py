"""The JAX serving loop's decode step at batch 64 with mixed contexts: serve_jax.py's model (2
layers, hidden 4096, GQA 32/8, head_dim 128) over 64 requests of 256-4096 cached tokens, each
step appending one token a request and decoding it in one jax.jit step, with three attention
back ends (everything else, norms, RoPE, activation and greedy sampling, is rtcinfer's):

    rtcinfer  append_paged_kv_cache into the paged cache [pages, 2, 16, Hkv, D], then the batch
              decode wrapper over it, its plan made by plan() on the host and passed as an
              array with the step's tables
    rtcinfer, device plan
              the same, the plan built inside the step from its page table
              (device_plan_array: serve_jax.py's step); no plan() in the loop
    pallas    JAX's Pallas GPU paged_attention over a paged cache in its layout (k and v
              [Hkv, pages, 16, D], each request's page table padded to a multiple of 128
              pages, as its 16 splits of 8-page blocks need; q scaled before the call, as it
              takes no scale), the new token scattered in by XLA
    cudnn     jax.nn.dot_product_attention(implementation="cudnn") over a dense cache padded
              to the longest request (k and v [B, L, Hkv, D], L rounded up to 128) with each
              request's length, the new token scattered in by XLA

Three times per step (a step's sampled tokens are the next step's input, on the device):
    device    the jitted step back to back on the same device tables (the host's dispatch hides
              behind the GPU): the step's GPU time
    loop      a decode step as an engine pipelines it: plan() (rtcinfer), the step's host tables
              to the device in one transfer (a JAX transfer costs ~50-100 us of host time, so
              not one per table), the step's dispatch; no wait (wall time of 30 steps / 30)
    resident  the loop as an engine that keeps its tables on the device runs it: each step
              takes the last step's tokens and positions (both on the device) and the block
              table (each request's pages in order, the pages of its next STEPS tokens
              reserved ahead; the host uploads it every PAGE steps, as an engine would after
              reserving more), builds the step's tables on the device (serving.decode_tables)
              and returns the next positions; no plan(), no other transfer. Back ends with a
              device plan only (not rtcinfer with plan() on the host). The contexts grow by a
              token a step (by 30 at most, from 141,739 tokens)
    fetching  the loop with each step's tokens fetched to the host before the next step
    stubbed   `device` for the step with its matmuls stubbed (serve_jax.stub_matmul): the
              attention, norms, RoPE, activation and sampling on the step's shapes, and small
              XLA fusions; device minus stubbed is mostly the matmuls

Each time is the least of ROUNDS rounds, in which every back end is timed in turn (the host's
speed drifts between runs and within one). Every back end reads the same cached keys and
values (random, written into each layout); its greedy tokens and logits are compared with
the first back end's; the speedups are rtcinfer's with the device plan over each.

    python -m bench.bench_serving_jax [rtcinfer] [device] [pallas] [cudnn]   (default: all)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.bench_serving import BATCH, CONTEXTS, decode_batch
from bench.common import Table, Tables, header

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the caches are large
STEPS = 30
ROUNDS = 5  # each timing: the least of ROUNDS, the back ends in turn within a round
BACKENDS = ("rtcinfer", "device", "pallas", "cudnn")
LABELS = {"device": "rtcinfer, device plan"}


def _examples():
    """serving and serve_jax (examples/)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import serve_jax
    import serving

    return serving, serve_jax


class Batch:
    """The step's host tables (decode_batch) and where each cached token lives: request
    `owner[t]`, position `position[t]`, page `page[t]`, slot `slot[t]` of token t; the block
    table [BATCH, width] with each request's pages and the pages it takes in the resident
    loop's STEPS steps (new ones, after the batch's `pages`: `pool` pages in all)."""

    def __init__(self, serving, rng):
        self.step, self.pages, self.tokens = decode_batch(serving, rng)
        st, page = self.step, serving.PAGE
        self.lengths = ((np.diff(st.indptr) - 1) * page + st.last).astype(np.int32)
        self.owner = np.repeat(np.arange(BATCH), self.lengths)
        self.position = np.concatenate([np.arange(n) for n in self.lengths])
        self.page = st.padded[st.indptr[self.owner] + self.position // page]
        self.slot = self.position % page
        held = np.diff(st.indptr)
        grown = -(-(self.lengths + STEPS) // page)  # pages after STEPS more tokens
        self.pool = self.pages + int((grown - held).sum())
        self.blocks = np.zeros((BATCH, int(grown.max())), np.int32)
        new = iter(range(self.pages, self.pool))
        for b in range(BATCH):
            pages = st.padded[st.indptr[b] : st.indptr[b + 1]].tolist()
            pages += [next(new) for _ in range(grown[b] - held[b])]
            self.blocks[b, : len(pages)] = pages
        self.table_pages = -(-self.blocks.shape[1] // 128) * 128
        self.dense_len = -(-int(self.lengths.max() + STEPS) // 128) * 128

    def inputs(self):
        """The step's arrays, in serve_jax.forward's order after the caches."""
        st = self.step
        return (st.tokens, st.positions, st.batch_indices, st.padded, st.indptr, st.last,
                st.ends)  # fmt: skip


def _attention(name: str, sj, batch: Batch, wrapper):
    """(attend(plan) -> the attention function of a step given its plan array, caches from
    the token-major kv [layers][T, 2, Hkv, D]) of back end `name`."""
    import jax
    import jax.numpy as jnp

    page, hkv, d = sj.PAGE, sj.HKV, sj.D
    where = {k: jnp.asarray(getattr(batch, k)) for k in ("owner", "position", "page", "slot")}

    def lengths(indptr, last):
        return ((indptr[1:] - indptr[:-1] - 1) * page + last).astype(jnp.int32)

    if name in ("rtcinfer", "device"):

        def fill(kv):
            cache = jnp.zeros((batch.pool, 2, page, hkv, d), kv.dtype)
            return cache.at[where["page"], :, where["slot"]].set(kv)

        return lambda plan: sj.paged(wrapper, plan), fill
    if name == "pallas":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        def fill(kv):
            pages = jnp.zeros((hkv, batch.pool, page, d), kv.dtype)
            at = (slice(None), where["page"], where["slot"])
            return tuple(pages.at[at].set(kv[:, i].transpose(1, 0, 2)) for i in (0, 1))

        def attend(q, k, v, cache, pos, bidx, indices, indptr, last):
            at = (slice(None), indices[indptr[bidx] + pos // page], pos % page)
            kp, vp = (
                c.at[at].set(x.transpose(1, 0, 2)) for c, x in zip(cache, (k, v), strict=True)
            )
            rows = indptr[:-1, None] + jnp.arange(batch.table_pages)
            table = indices[jnp.minimum(rows, indices.shape[0] - 1)]
            scaled = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
            return paged_attention(scaled, kp, vp, table, lengths(indptr, last)), (kp, vp)

        return lambda plan: attend, fill

    def fill(kv):
        dense = jnp.zeros((BATCH, batch.dense_len, hkv, d), kv.dtype)
        at = (where["owner"], where["position"])
        return tuple(dense.at[at].set(kv[:, i]) for i in (0, 1))

    def attend(q, k, v, cache, pos, bidx, indices, indptr, last):  # one query per request
        kd, vd = (c.at[bidx, pos].set(x) for c, x in zip(cache, (k, v), strict=True))
        o = jax.nn.dot_product_attention(q[:, None], kd, vd, scale=d**-0.5,
                                         key_value_seq_lengths=lengths(indptr, last),
                                         implementation="cudnn")  # fmt: skip
        return o[:, 0], (kd, vd)

    return lambda plan: attend, fill


class Backend:
    """One back end's jitted step, its caches and the four timings (us), each timed by a call:
    main() calls each back end's in turn, round after round (the host's speed drifts by tens
    of percent between runs and within one: back ends timed one after the other would
    compare hosts, not loops), and keeps each one's least."""

    def __init__(self, name: str, sj, batch: Batch, model, kv):
        import functools

        import jax
        import jax.numpy as jnp

        self.name, self.sj, self.model, self.jax = name, sj, model, jax
        ours = name in ("rtcinfer", "device")
        wrapper = sj.decode_wrapper(BATCH, batch.pool) if ours else None
        attend, fill = _attention(name, sj, batch, wrapper)
        self.caches = [fill(layer) for layer in kv]
        host = batch.inputs()
        st = batch.step
        if name == "device":  # the configuration: plans are built inside the step
            wrapper.plan(st.indptr, st.padded, st.last, sj.HQ, sj.HKV, sj.D, sj.PAGE,
                         q_data_type=sj.bf16)  # fmt: skip

        @functools.partial(jax.jit, donate_argnums=1, static_argnums=(4, 5))
        def step(model, caches, tokens, tables, sizes, stubbed=False):
            *tables, plan = sj.unpack(tables, sizes)  # the plan array last (rtcinfer's)
            if name == "device":  # from the padded indices, indptr and last page lengths
                plan = wrapper.device_plan_array(tables[3], tables[2], tables[4], batch.pages)
            mm = sj.stub_matmul if stubbed else jnp.matmul
            return sj.forward(model, caches, tokens, *tables, attend(plan), mm=mm)

        none = np.zeros(4, np.int32)

        def plan():
            """plan() and the step's tables, the plan array last (other back ends: zeros)."""
            if name != "rtcinfer":
                return host[1:] + (none,)
            wrapper.plan(st.indptr, st.padded, st.last, sj.HQ, sj.HKV, sj.D, sj.PAGE,
                         q_data_type=sj.bf16)  # fmt: skip
            return host[1:] + (wrapper.plan_array(),)

        @functools.partial(jax.jit, donate_argnums=(1, 3))
        def resident(model, caches, tokens, positions, blocks):
            """The step from the tokens, positions and block table on the device; also returns
            the next step's positions."""
            tables = sj.serving.decode_tables(jnp, tokens, positions, blocks, batch.pool)
            plan = None
            if name == "device":
                plan = wrapper.device_plan_array(tables[4], tables[3], tables[5], batch.pool)
            caches, out, _ = sj.forward(model, caches, *tables, attend(plan))
            return caches, out, positions + 1

        self.step, self.plan, self.resident_step = step, plan, resident
        self.batch = batch
        self.on_device, self.sizes = sj.pack(plan())  # one transfer a step
        began = time.perf_counter()
        self.caches, self.out, logits = step(model, self.caches, jnp.asarray(host[0]),
                                             self.on_device, self.sizes)  # fmt: skip
        self.tokens, self.logits = np.asarray(self.out), np.asarray(logits)
        print(f"# {name}: first step {time.perf_counter() - began:.1f} s", flush=True)
        for stubbed in (False, True):  # compiled before any timing
            self._steps(3, stubbed=stubbed)
        if name != "rtcinfer":
            self.resident(steps=3)
        self.parts = np.zeros(3)

    def _steps(self, n: int, tables=None, stubbed: bool = False) -> float:
        """n steps back to back (us a step)."""
        self.jax.block_until_ready(self.out)
        start = time.perf_counter()
        for _ in range(n):
            self.caches, self.out, _ = self.step(
                self.model, self.caches, self.out, tables or self.on_device, self.sizes, stubbed
            )
        self.jax.block_until_ready((self.caches, self.out))
        return (time.perf_counter() - start) / n * 1e6

    def device(self) -> float:
        """The step back to back on the same device tables: its GPU time."""
        return self._steps(STEPS)

    def stubbed(self) -> float:
        return self._steps(STEPS, stubbed=True)

    def loop(self) -> float:
        """plan(), the tables in one transfer, the dispatch; no wait (keeps the host parts of
        its fastest round in self.parts)."""
        parts = np.zeros(3)  # plan, the tables to the device, the step's dispatch (host time)
        self.jax.block_until_ready(self.out)
        start = time.perf_counter()
        for _ in range(STEPS):
            t0 = time.perf_counter()
            tables = self.plan()
            t1 = time.perf_counter()
            on_device, _ = self.sj.pack(tables)
            t2 = time.perf_counter()
            self.caches, self.out, _ = self.step(self.model, self.caches, self.out, on_device,
                                                 self.sizes)  # fmt: skip
            parts += np.diff([t0, t1, t2, time.perf_counter()])
        self.jax.block_until_ready((self.caches, self.out))
        loop = (time.perf_counter() - start) / STEPS * 1e6
        parts *= 1e6 / STEPS
        if not self.parts.any() or parts.sum() < self.parts.sum():
            self.parts = parts
        return loop

    def resident(self, steps: int = STEPS) -> float | None:
        """The loop with the tables kept on the device (see the module's docstring); the
        positions start from the batch's each time."""
        if self.name == "rtcinfer":  # plan() on the host needs the host's tables
            return None
        jax, page = self.jax, self.sj.PAGE
        positions = jax.device_put(self.batch.step.positions)
        jax.block_until_ready((self.out, positions))
        start = time.perf_counter()
        for i in range(steps):
            if i % page == 0:  # the block table with the next PAGE tokens' pages reserved
                blocks = jax.device_put(self.batch.blocks)
            self.caches, self.out, positions = self.resident_step(
                self.model, self.caches, self.out, positions, blocks
            )
        jax.block_until_ready((self.caches, self.out))
        return (time.perf_counter() - start) / steps * 1e6

    def fetching(self) -> float:
        """The loop with each step's tokens fetched to the host before the next step."""
        start = time.perf_counter()
        for _ in range(STEPS):
            self.caches, self.out, _ = self.step(
                self.model, self.caches, self.out, self.sj.pack(self.plan())[0], self.sizes
            )
            np.asarray(self.out)
        return (time.perf_counter() - start) / STEPS * 1e6


def main() -> Tables:
    table = Table(
        f"JAX decode step, batch {BATCH}, contexts {CONTEXTS[0]}-{CONTEXTS[1]} "
        "(serve_jax's model, one jax.jit step)",
        ["attention", "device us", "loop us", "resident loop us", "fetching loop us",
         "stubbed us", "resident tokens/s", "rtcinfer's loop speedup",
         "rtcinfer's resident speedup", "same tokens", "max logit diff"],
    )  # fmt: skip
    tables = Tables()
    tables.append(table)
    try:
        import jax
    except ImportError:
        print("# bench_serving_jax needs JAX with a CUDA GPU")
        return tables
    if jax.default_backend() != "gpu":
        print("# bench_serving_jax needs JAX with a CUDA GPU")
        return tables
    print(header())
    serving, sj = _examples()
    batch = Batch(serving, np.random.default_rng(0))
    print(f"# {BATCH} requests, {batch.tokens} tokens in the cache after the step, "
          f"{batch.pages} pages; Pallas tables of {batch.table_pages} pages; dense cache "
          f"{batch.dense_len} tokens")  # fmt: skip
    model = sj.weights(jax.random.PRNGKey(0))
    keys = jax.random.split(jax.random.PRNGKey(1), serving.LAYERS)
    kv = [jax.random.normal(k, (batch.tokens, 2, sj.HKV, sj.D), sj.bf16) for k in keys]
    names = [n for n in BACKENDS if n in (sys.argv[1:] or BACKENDS)]
    backends = {}
    for name in names:
        try:
            backends[name] = Backend(name, sj, batch, model, kv)
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the bench
            if name in ("rtcinfer", "device"):
                raise
            print(f"# {name} failed: {type(e).__name__}: {str(e)[:300]}")
    timings = ("device", "loop", "resident", "fetching", "stubbed")
    best = {name: dict.fromkeys(timings, float("inf")) for name in backends}
    for _ in range(ROUNDS):
        for what in timings:
            for name, b in backends.items():
                us = getattr(b, what)()
                best[name][what] = None if us is None else min(best[name][what], us)
    for name, b in backends.items():
        plan_us, tables_us, dispatch_us = b.parts
        print(f"# {name}: a loop step's host parts (its fastest round): plan {plan_us:.1f} us, "
              f"tables to the device {tables_us:.1f}, dispatch {dispatch_us:.1f}",
              flush=True)  # fmt: skip
    first = next(iter(backends.values()))  # tokens and logits compared with its
    ours = best.get("device")  # rtcinfer with the plan on the device: the speedups' base

    def ratio(us, what):
        return None if ours is None or us is None else f"{us / ours[what]:.2f}"

    for name, b in backends.items():
        t = best[name]
        tokens = None if t["resident"] is None else BATCH / t["resident"] * 1e6
        same = f"{int((b.tokens == first.tokens).sum())}/{BATCH}"
        diff = float(np.abs(b.logits - first.logits).max())
        speedups = ratio(t["loop"], "loop"), ratio(t["resident"], "resident")
        table.add(LABELS.get(name, name), *(t[w] for w in timings), tokens, *speedups, same, diff)
    return tables


if __name__ == "__main__":
    print(main().markdown())
