"""serve_torch.py's serving loop with tensor parallelism over the processes of torchrun, one GPU
each, NCCL's all-reduce through torch.distributed (NVLink multicast off: NCCL_NVLS_ENABLE=0):

    torchrun --nproc-per-node 2 examples/serve_torch_tp.py      (one GPU: --nproc-per-node 1)

Every rank builds the same model (the same seed) and keeps its shard: HQ/N query heads and
HKV/N KV heads (their columns of the qkv projection, their rows of the output projection, a
cache of its KV heads [PAGES, 2, PAGE, HKV/N, D]) and INTER/N of the MLP (its gate and up
columns, its rows of down); norms, embedding and LM head whole. Each rank plans its own
wrappers for its heads from the same page tables (every rank runs the same request stream and
the same free list) and all-reduces the partial outputs of the output and down projections in
place (torch.distributed.all_reduce, captured with the rest of a decode step in its CUDA
graph). Every rank samples the same summed logits with the same seed, so all emit the same
tokens.

The check (rank 0 prints it): the same stream through serve_torch.py's one-GPU loop on rank
0's GPU; every token of the sharded loop against the dense reference (serving.check), and the
two loops' tokens (equal on one GPU; over several, a near tie may resolve the other way once
the partial sums are added in another order). Prints decode tokens per second (eager and
with each batch size's decode step in a CUDA graph, one GPU and sharded) and the share of an
eager decode step's time spent in the all-reduce (CUDA events around it). Exit code 1 on a
mismatch (every rank returns rank 0's verdict).
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np  # noqa: E402
import serve_torch as st  # noqa: E402
import serving  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from serving import HKV, HQ, INTER, D  # noqa: E402

import rtcinfer  # noqa: E402


def shard(model, rank: int, n: int):
    """This rank's share of serve_torch.weights' model (serving.shard_columns' blocks)."""
    hq, inter = HQ // n, INTER // n
    qkv = torch.as_tensor(serving.shard_columns([HQ * D, HKV * D, HKV * D], n), device=st.dev)
    gate_up = torch.as_tensor(serving.shard_columns([INTER, INTER], n), device=st.dev)
    width = qkv.numel() // n

    def columns(w, order, width):
        return w[:, order[rank * width : (rank + 1) * width]].contiguous()

    layers = [dict(layer, qkv=columns(layer["qkv"], qkv, width),
                   gate_up=columns(layer["gate_up"], gate_up, 2 * inter),
                   o=layer["o"][rank * hq * D : (rank + 1) * hq * D].contiguous(),
                   down=layer["down"][rank * inter : (rank + 1) * inter].contiguous())
              for layer in model["layers"]]  # fmt: skip
    return dict(model, layers=layers)


class TimedReduce:
    """dist.all_reduce in place, with CUDA events around each call while `on` (eager steps)."""

    def __init__(self):
        self.on, self.events, self.ms = False, [], 0.0

    def __call__(self, h):
        if not self.on:
            dist.all_reduce(h)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(h)
        end.record()
        self.events.append((start, end))

    def collect(self):
        torch.cuda.synchronize()
        self.ms += sum(s.elapsed_time(e) for s, e in self.events)
        self.events = []


def run(engine, reduce=None):
    """The stream on `engine` (after a warm-up pass with other pages); returns the finished
    requests and decode tokens per second."""
    st.serve(engine, np.random.default_rng(1))  # warm-up: compiles, loads, captures
    engine.reset(np.random.default_rng(2))  # other pages, the same stream
    if reduce is not None:
        reduce.on, reduce.ms = not engine.graphs, 0.0
    done, decode_s, decode_tokens = st.serve(engine, np.random.default_rng(1))
    if reduce is not None:
        reduce.collect()
        reduce.on = False
        engine.decode_s = decode_s
    return done, decode_tokens / decode_s


def tokens_of(done):
    return [[e[1] for e in r.emitted] for r in sorted(done, key=lambda r: r.rid)]


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL's communicator
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    if HQ % n or HKV % n or INTER % n:
        raise SystemExit(f"{HQ} query heads, {HKV} KV heads, {INTER} MLP columns over {n} ranks")
    model = st.weights(torch.Generator(device=st.dev).manual_seed(0))
    ours, reduce = shard(model, rank, n), TimedReduce()
    lines, ok = [], True
    one = None
    if rank == 0:  # the one-GPU loop, for its tokens and its speed
        one, one_eager = run(st.Engine(model, np.random.default_rng(0)))
        _, one_graphs = run(st.Engine(model, np.random.default_rng(0), graphs=True))
        lines.append(f"one GPU: decode {one_eager:.0f} tokens/s eager, {one_graphs:.0f} with "
                     "CUDA graphs")  # fmt: skip
    heads = (HQ // n, HKV // n)
    for graphs in (False, True):
        engine = st.Engine(ours, np.random.default_rng(0), graphs, heads=heads, reduce=reduce)
        done, speed = run(engine, reduce)
        how = "with CUDA graphs" if graphs else "eager"
        line = f"{n} GPU(s), {how}: decode {speed:.0f} tokens/s"
        if not graphs:
            line += f", {100 * reduce.ms / 1e3 / engine.decode_s:.0f}% of it in the all-reduce"
        lines.append(line)
        if rank == 0:
            good = serving.check(done, lambda t: st.reference_logits(model, t).cpu().numpy())
            same = tokens_of(done) == tokens_of(one)
            lines.append(f"{how}: tokens {'the same as' if same else 'near ties away from'} "
                         "the one-GPU loop's")  # fmt: skip
            ok &= good and (same or n > 1)
    rtcinfer.check_errors()
    verdict = torch.tensor([int(ok)], device=st.dev)
    dist.broadcast(verdict, 0)
    ok = bool(verdict.item())
    if rank == 0:
        print("\n".join(lines))
        print("OK" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
