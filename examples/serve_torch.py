"""A small serving loop on PyTorch tensors (needs a CUDA GPU): a Llama-style decoder (random
weights, GQA 32/8, head_dim 128, RMSNorm, RoPE, SiLU-and-mul) serves a stream of requests with
continuous batching. Each step prefills the prompts that arrived (paged prefill, causal, their
keys appended to the paged cache first) and decodes one token for every running request (batch
decode); a request that has its tokens leaves and frees its pages. Tokens are greedy
(top_k_top_p_sampling_from_logits with top_k 1). The loop runs twice: eagerly, then with each
batch size's decode step captured in a CUDA graph (a use_cuda_graph decode wrapper whose plan is
built inside the graph from the step's page table: device_plan_array; FlashInfer's wrapper is
re-planned on the host before every replay).

The check: a dense PyTorch version of the same model (float32 attention over each request's
whole sequence, no cache) recomputes every emitted token's logits from the same token history:
they agree within bf16 tolerance, and every token is the reference's argmax (or within the
logits' error of it). Prints decode throughput and the share of the decode step spent in
rtcinfer's kernels; exit code 1 on a mismatch. With FlashInfer installed, the same loop runs
again with FlashInfer's functions and wrappers swapped in (the same names and arguments: the
drop-in case; the sampler stays rtcinfer's), for its throughput beside ours."""

import sys
import time

import numpy as np
import serving
import torch
from serving import EPS, HIDDEN, HKV, HQ, INTER, LAYERS, PAGE, PAGES, THETA, VOCAB, D

import rtcinfer

bf16, dev = torch.bfloat16, "cuda"
WORKSPACE = 128 << 20  # bytes, a FlashInfer wrapper's workspace


def flashinfer_or_none():
    """FlashInfer when it imports (the comparison runs), else None."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - a missing or broken peer only skips the comparison
        print(f"(no FlashInfer comparison: {type(e).__name__}: {e})"[:200])
        return None
    return flashinfer


def workspace(lib) -> tuple:
    """A wrapper's leading arguments: none for rtcinfer (it sizes its own workspace), a
    workspace buffer and the layout for FlashInfer."""
    if lib is rtcinfer:
        return ()
    return (torch.empty(WORKSPACE, dtype=torch.uint8, device=dev), "NHD")


def host(lib, a: np.ndarray):
    """plan()'s index arrays: NumPy for rtcinfer, CPU tensors for FlashInfer."""
    return a if lib is rtcinfer else torch.from_numpy(a)


def weights(gen):
    def w(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) / shape[0] ** 0.5).to(bf16)

    def norm():
        return (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=gen)).to(bf16)

    layers = [dict(ln1=norm(), qkv=w(HIDDEN, (HQ + 2 * HKV) * D), o=w(HQ * D, HIDDEN),
                   ln2=norm(), gate_up=w(HIDDEN, 2 * INTER), down=w(INTER, HIDDEN))
              for _ in range(LAYERS)]  # fmt: skip
    embed = torch.randn(VOCAB, HIDDEN, device=dev, generator=gen).to(bf16)
    return dict(embed=embed, layers=layers, norm=norm(), lm_head=w(HIDDEN, VOCAB))


class Inputs:
    """A step's (serving.Step) device inputs: the new tokens, their positions and requests,
    the page table (indices padded to the pool size) and each request's last new row."""

    def __init__(self, step):
        def to_dev(a, dtype=torch.int32):
            return torch.from_numpy(a).to(dev, dtype)

        self.tokens, self.ends = to_dev(step.tokens, torch.int64), to_dev(step.ends, torch.int64)
        self.pos, self.bidx = to_dev(step.positions), to_dev(step.batch_indices)
        self.table = [to_dev(step.padded), to_dev(step.indptr), to_dev(step.last)]

    def tensors(self):
        return [self.tokens, self.pos, self.bidx, *self.table, self.ends]

    def copy_to(self, other):
        for a, b in zip(self.tensors(), other.tensors(), strict=True):
            b.copy_(a)


class DecodeGraph:
    """The decode forward of one batch size captured in a CUDA graph: a use_cuda_graph decode
    wrapper, static inputs the step copies its own into, and the static logits the replay
    writes. rtcinfer's graph plans each replay itself, on the device, from the static page
    table (`device_plan`: plan() ran once, for the configuration); FlashInfer's wrapper keeps
    its plan in a fixed workspace layout, re-planned on the host before every replay."""

    def __init__(self, engine, inputs, plan_args):
        batch = len(plan_args[0]) - 1
        ints = lambda n: torch.empty(n, dtype=torch.int32, device=dev)  # noqa: E731
        lib = engine.lib
        self.wrapper = lib.BatchDecodeWithPagedKVCacheWrapper(
            *workspace(lib), use_cuda_graph=True, paged_kv_indptr_buffer=ints(batch + 1),
            paged_kv_indices_buffer=ints(PAGES), paged_kv_last_page_len_buffer=ints(batch),
        )  # fmt: skip
        self.wrapper.plan(*plan_args, *engine.heads, D, PAGE, q_data_type=bf16)
        self.inputs = inputs
        self.device_plan = lib is rtcinfer

        def forward():
            plan = None
            if self.device_plan:
                indices, indptr, last = inputs.table
                plan = self.wrapper.device_plan_array(indptr, indices, last, PAGES)
            return engine.forward(inputs, self.wrapper, plan)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels loaded, plan uploaded
            forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = forward()


class Engine:
    """The paged cache (one [pages, 2, PAGE, HKV, D] array per layer), the page free list, a
    prefill and a decode wrapper re-planned every step, and with `graphs` one captured decode
    step per batch size (the appends of a warm-up and a replay write the same values). `lib`:
    rtcinfer, or flashinfer for the comparison (the ops are called by the same names). A
    tensor-parallel shard (serve_torch_tp.py) computes `heads` (its query and KV heads: its
    weights hold their columns of qkv and gate_up and their rows of o and down, its cache their
    KV heads) and sums the partial outputs of o and down in place with `reduce` (an
    all-reduce)."""

    def __init__(self, model, rng, graphs=False, lib=rtcinfer, heads=(HQ, HKV), reduce=None):
        self.model, self.lib, self.heads = model, lib, heads
        self.reduce = reduce or (lambda h: None)
        self.cache = [torch.zeros(PAGES, 2, PAGE, heads[1], D, device=dev, dtype=bf16)
                      for _ in range(LAYERS)]  # fmt: skip
        self.reset(rng)
        self.prefill = lib.BatchPrefillWithPagedKVCacheWrapper(*workspace(lib))
        self.decode = lib.BatchDecodeWithPagedKVCacheWrapper(*workspace(lib))
        self.graphs = {} if graphs else None
        self._events = None

    def reset(self, rng):
        """A fresh free list for the next stream (the captured graphs and wrappers stay)."""
        self.free = [int(p) for p in rng.permutation(PAGES)]
        self.kernel_ms = 0.0  # rtcinfer kernels' time in decode steps (events, when timed)

    def step(self, requests, new_tokens, wrapper):
        """Append `new_tokens[b]` of each request to the cache and run the model over them;
        returns the logits of each request's last new token [B, VOCAB] float32."""
        step = serving.Step(requests, new_tokens, self.free)
        indptr, indices, last = (host(self.lib, a) for a in (step.indptr, step.indices, step.last))
        inputs = Inputs(step)
        if wrapper is self.prefill:
            wrapper.plan(host(self.lib, step.qo_indptr), indptr, indices, last, *self.heads, D,
                         PAGE, causal=True, q_data_type=bf16)  # fmt: skip
        elif self.graphs is not None:  # a captured decode step of this batch size
            graph = self.graphs.get(len(requests))
            if graph is None:
                graph = self.graphs[len(requests)] = DecodeGraph(
                    self, inputs, (indptr, indices, last)
                )
            if not graph.device_plan:
                graph.wrapper.plan(indptr, indices, last, *self.heads, D, PAGE,
                                   q_data_type=bf16)  # fmt: skip
            inputs.copy_to(graph.inputs)
            graph.graph.replay()
            return graph.logits.clone()  # the next replay rewrites the static logits
        else:
            wrapper.plan(indptr, indices, last, *self.heads, D, PAGE, q_data_type=bf16)
        return self.forward(inputs, wrapper)

    def forward(self, inputs, wrapper, plan=None):
        """The model over the inputs' tokens with `wrapper`'s current plan, or the plan array
        `plan` (capturable)."""
        tokens, pos, bidx, indices, indptr, last, ends = inputs.tensors()
        table = (indices, indptr, last)
        lib, (hq, hkv) = self.lib, self.heads
        x = self.model["embed"][tokens]
        h = self._op(lib.rmsnorm, x, self.model["layers"][0]["ln1"], EPS)
        residual = x.clone()
        n = x.shape[0]
        for i, layer in enumerate(self.model["layers"]):
            if i:
                self._op(lib.fused_add_rmsnorm, h, residual, layer["ln1"], EPS)
            qkv = h @ layer["qkv"]
            q = qkv[:, : hq * D].reshape(n, hq, D).contiguous()
            k = qkv[:, hq * D : (hq + hkv) * D].reshape(n, hkv, D).contiguous()
            v = qkv[:, (hq + hkv) * D :].reshape(n, hkv, D).contiguous()
            self._op(lib.apply_rope_pos_ids_inplace, q, k, pos, rope_theta=THETA)
            self._op(lib.append_paged_kv_cache, k, v, bidx, pos, self.cache[i], *table)
            o = self._op(
                wrapper.run, q, self.cache[i], **({} if plan is None else {"plan_array": plan})
            )
            h = o.reshape(n, hq * D) @ layer["o"]
            self.reduce(h)
            self._op(lib.fused_add_rmsnorm, h, residual, layer["ln2"], EPS)
            h = self._op(lib.silu_and_mul, h @ layer["gate_up"]) @ layer["down"]
            self.reduce(h)
        self._op(lib.fused_add_rmsnorm, h, residual, self.model["norm"], EPS)
        return (h[ends] @ self.model["lm_head"]).float()

    def _op(self, fn, *args, **kwargs):
        if self._events is None:
            return fn(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        self._events.append((start, end))
        return result

    def time_kernels(self, on: bool):
        if self.graphs is not None:  # a replay is timed as a whole
            return
        if on:
            self._events = []
            return
        torch.cuda.synchronize()
        self.kernel_ms += sum(s.elapsed_time(e) for s, e in self._events)
        self._events = None

    def release(self, r):
        self.free.extend(r.pages)
        r.pages = []


def rope(x, positions):
    half = D // 2
    inv = THETA ** (-torch.arange(half, device=dev, dtype=torch.float64) * 2 / D)
    angle = positions.double()[:, None] * inv[None, :]
    cos, sin = angle.cos()[:, None, :].float(), angle.sin()[:, None, :].float()
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(bf16)


def rms(x, w):
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(bf16)


def reference_logits(model, tokens):
    """Dense forward over one request's tokens; the last position's logits, float32."""
    n = len(tokens)
    x = model["embed"][torch.tensor(tokens, device=dev)]
    residual, h = x, rms(x, model["layers"][0]["ln1"])
    pos = torch.arange(n, device=dev)
    causal = torch.ones(n, n, device=dev, dtype=torch.bool).tril()
    for i, layer in enumerate(model["layers"]):
        if i:
            residual = (residual.float() + h.float()).to(bf16)
            h = rms(residual, layer["ln1"])
        qkv = h @ layer["qkv"]
        q = rope(qkv[:, : HQ * D].reshape(n, HQ, D), pos).float()
        k = rope(qkv[:, HQ * D : (HQ + HKV) * D].reshape(n, HKV, D), pos).float()
        v = qkv[:, (HQ + HKV) * D :].reshape(n, HKV, D).float()
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("hqk,khd->qhd", p, v).to(bf16)
        h = o.reshape(n, HQ * D) @ layer["o"]
        residual = (residual.float() + h.float()).to(bf16)
        h = rms(residual, layer["ln2"])
        gate, up = (h @ layer["gate_up"]).float().chunk(2, -1)
        h = (torch.nn.functional.silu(gate) * up).to(bf16) @ layer["down"]
    residual = (residual.float() + h.float()).to(bf16)
    return (rms(residual, model["norm"])[-1:] @ model["lm_head"]).float()[0]


def serve(engine, rng):
    """The loop; returns the requests with their emitted tokens and logits, and decode stats."""
    waiting, arrivals = serving.stream(rng)
    running, done, step, decode_s, decode_tokens = [], [], 0, 0.0, 0
    while waiting or running:
        arrived = [r for r in waiting if arrivals[r.rid] <= step]
        waiting = [r for r in waiting if arrivals[r.rid] > step]
        if running:  # one token for every running request
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.time_kernels(True)
            logits = engine.step(running, [1] * len(running), engine.decode)
            tokens = greedy(logits, step)
            engine.time_kernels(False)
            decode_s += time.perf_counter() - start
            decode_tokens += len(running)
            emit(running, tokens, logits, f"decode of {len(running)}")
        if arrived:  # prefill the new prompts, which emit their first token
            lens = [len(r.tokens) for r in arrived]
            logits = engine.step(arrived, lens, engine.prefill)
            tokens = greedy(logits)
            emit(arrived, tokens, logits, f"prefill of {len(arrived)}")
            running += arrived
        for r in [r for r in running if len(r.emitted) == r.max_new]:
            engine.release(r)
            running.remove(r)
            done.append(r)
        step += 1
    return done, decode_s, decode_tokens


def greedy(logits, seed=None):
    """Tokens by rtcinfer's top_k_top_p_sampling_from_logits with top_k 1, in both loops:
    FlashInfer's sampling module takes minutes to build, and with one sampler the comparison
    is of the step's other ops."""
    if seed is not None:
        return rtcinfer.top_k_top_p_sampling_from_logits(logits, 1, 1.0, seed=seed)
    return rtcinfer.top_k_top_p_sampling_from_logits(logits, 1, 1.0)


def emit(requests, tokens, logits, where):
    for r, t, row in zip(requests, tokens.tolist(), logits, strict=True):
        r.emitted.append((len(r.tokens), t, row.cpu().numpy(), where))
        r.tokens.append(t)


def main():
    gen = torch.Generator(device=dev).manual_seed(0)
    rng = np.random.default_rng(0)
    model = weights(gen)
    ok = True
    fi = flashinfer_or_none()
    for lib in (rtcinfer,) + ((fi,) if fi is not None else ()):
        name = lib.__name__
        for graphs in (False, True):
            engine = Engine(model, rng, graphs, lib)
            serve(engine, np.random.default_rng(1))  # warm-up: compiles, loads, captures
            engine.reset(rng)  # other pages, the same stream: nothing new to capture
            done, decode_s, decode_tokens = serve(engine, np.random.default_rng(1))
            print(f"{name}, decode steps in CUDA graphs (one per batch size):" if graphs
                  else f"{name}, eager:")  # fmt: skip
            good = serving.check(done, lambda t: reference_logits(model, t).cpu().numpy())
            ok &= good or lib is not rtcinfer  # the comparison's own result is reported only
            line = (f"decode: {decode_tokens} tokens in {decode_s * 1e3:.1f} ms, "
                    f"{decode_tokens / decode_s:.0f} tokens/s")  # fmt: skip
            if not graphs:
                share = 100 * engine.kernel_ms / 1e3 / decode_s
                line += f"; {name} kernels (events) {share:.0f}% of the step time"
            print(line)
    rtcinfer.check_errors()
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
