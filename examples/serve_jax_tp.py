"""serve_jax.py's serving loop with tensor parallelism: the model's heads split over a mesh of
the GPUs JAX sees (or the first N: `python serve_jax_tp.py N`), each model pass one jax.jit
step around jax.shard_map.

Each device holds HQ/N query heads and HKV/N KV heads: their columns of the qkv projection,
their rows of the output projection and its shard of every KV cache, [PAGES, 2, PAGE, HKV/N, D];
and INTER/N of the MLP (its gate and up columns, its rows of down). Norms, the embedding and the
LM head are replicated. On its shard each device runs rtcinfer's norms, RoPE, append, paged
prefill or batch decode and activation, with plans for its own heads: a prefill plan made on
the host (the same for every device, sent with the step's tables) and a decode plan built on
its device from the block table. XLA all-reduces the partial outputs of the output projection
and of the MLP's down projection (jax.lax.psum over the mesh axis "tp"); every device then
samples the same replicated logits with the same seed, so all draw the same token. One wrapper
of each kind serves the whole mesh: its plans travel as arrays, and the kernels load on every
device JAX sees.

The check: the same request stream as serve_jax.py's one-device loop, run on both; every token
the sharded loop emits is checked against the dense JAX reference (serving.check), the two
loops' tokens are compared (on one device they must be equal; over several, a near tie may
resolve the other way once the partial sums are added in another order), and a second pass
with other page tables must trace nothing new. Prints both loops' decode tokens per second and
the share of a sharded decode step's time spent in the all-reduce (the step timed again with
the psum replaced by the identity). Exit code 1 on a mismatch.
"""

import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import serve_jax as sj  # noqa: E402
import serving  # noqa: E402
from serving import HKV, HQ, INTER, LAYERS, PAGE, PAGES, D  # noqa: E402

import rtcinfer  # noqa: E402

P = jax.sharding.PartitionSpec
CACHE = P(None, None, None, "tp", None)  # [PAGES, 2, PAGE, HKV, D]: split by KV heads
LAYER = dict(ln1=P(), qkv=P(None, "tp"), o=P("tp", None), ln2=P(), gate_up=P(None, "tp"),
             down=P("tp", None))  # fmt: skip
SPECS = dict(embed=P(), layers=[LAYER] * LAYERS, norm=P(), lm_head=P())
traces = {"prefill": 0, "decode": 0}


def shardings(mesh, specs):
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))  # fmt: skip


def shard_weights(model, mesh):
    """serve_jax.weights' model laid out for the mesh: qkv's and gate_up's columns reordered so
    that each device's block holds its share of every part (serving.shard_columns), then every
    weight placed by SPECS."""
    n = mesh.size
    qkv = serving.shard_columns([HQ * D, HKV * D, HKV * D], n)
    gate_up = serving.shard_columns([INTER, INTER], n)
    layers = [dict(layer, qkv=layer["qkv"][:, qkv], gate_up=layer["gate_up"][:, gate_up])
              for layer in model["layers"]]  # fmt: skip
    return jax.device_put(dict(model, layers=layers), shardings(mesh, SPECS))


def engine(mesh, reduce: bool = True) -> sj.Engine:
    """serve_jax's steps over `mesh`: each device computes its heads; reduce=False leaves the
    partial sums unreduced (wrong results, the step's time without its all-reduce)."""
    n = mesh.size
    if HQ % n or HKV % n or INTER % n:
        raise ValueError(f"{HQ} query heads, {HKV} KV heads and {INTER} MLP columns over {n}")
    heads = (HQ // n, HKV // n)
    prefill = sj.prefill_wrapper()
    decode = sj.decode_wrapper(len(serving.REQUESTS), PAGES)
    decode.plan([0, 1], [0], [1], *heads, D, PAGE, q_data_type=sj.bf16)  # the configuration
    psum = (lambda h: jax.lax.psum(h, "tp")) if reduce else None

    def sharded(local):
        return jax.shard_map(local, mesh=mesh, in_specs=(SPECS, CACHE, P()),
                             out_specs=(CACHE, P(), P()), check_vma=False)  # fmt: skip

    @functools.partial(jax.jit, donate_argnums=1, static_argnums=3)
    def prefill_step(model, caches, tables, sizes):
        traces["prefill"] += 1  # runs when JAX traces, not when the compiled step runs

        def local(model, caches, tables):
            *tables, plan = sj.unpack(tables, sizes)  # the plan array last
            attend = sj.paged(prefill, plan)
            return sj.forward(model, caches, *tables, attend, heads=heads, reduce=psum)

        return sharded(local)(model, caches, tables)

    @functools.partial(jax.jit, donate_argnums=1, static_argnums=3)
    def decode_step(model, caches, tables, sizes):
        traces["decode"] += 1

        def local(model, caches, tables):
            t = sj.decode_inputs(tables, sizes)
            plan = decode.device_plan_array(t[4], t[3], t[5], PAGES)  # this device's
            return sj.forward(model, caches, *t, sj.paged(decode, plan), heads=heads,
                              reduce=psum)  # fmt: skip

        return sharded(local)(model, caches, tables)

    def caches():
        return jax.device_put(sj.zeroed_caches(), shardings(mesh, CACHE))

    return sj.Engine(prefill, heads, prefill_step, decode_step, caches)


def tokens_of(done):
    return [[e[1] for e in r.emitted] for r in sorted(done, key=lambda r: r.rid)]


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:count]), ("tp",))
    model = sj.weights(jax.random.PRNGKey(0))
    sharded, tp = shard_weights(model, mesh), engine(mesh)
    rng = np.random.default_rng
    sj.serve(model, rng(1), rng(2))  # warm-up: traces, compiles, loads every kernel
    one, one_s, one_tokens = sj.serve(model, rng(1), rng(3))
    sj.serve(sharded, rng(1), rng(2), tp)
    before = dict(traces)
    done, tp_s, tp_tokens = sj.serve(sharded, rng(1), rng(3), tp)  # other pages, same shapes
    retraced = traces != before
    ok = sj.check(model, done)
    same = tokens_of(done) == tokens_of(one)
    print(f"traces: {before} in the first pass, "
          f"{'new ones' if retraced else 'none'} in the second")  # fmt: skip
    print(f"tokens: {'the same as' if same else 'near ties away from'} the one-device loop's")
    print(
        f"decode over {count} device(s): {tp_tokens} tokens in {tp_s * 1e3:.1f} ms, "
        f"{tp_tokens / tp_s:.0f} tokens/s; one device {one_tokens / one_s:.0f} tokens/s"
    )
    tables, sizes = sj.last_decode
    step_us = sj.gpu_us(tp.decode_step, sharded, tables, sizes, caches=tp.caches)
    unreduced = engine(mesh, reduce=False)
    rest_us = sj.gpu_us(unreduced.decode_step, sharded, tables, sizes, caches=tp.caches)
    share = max(step_us - rest_us, 0.0) / step_us
    print(
        f"a decode step of {sizes[0]} requests back to back: {step_us:.0f} us, {rest_us:.0f} "
        f"us without its all-reduce ({100 * share:.0f}% of the step in the all-reduce)"
    )
    rtcinfer.check_errors()
    ok &= not retraced and (same or count > 1)
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
