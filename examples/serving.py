"""What the two serving loops share (serve_torch.py, serve_jax.py): the model's sizes, the
request stream, a request's state, and the check of every emitted token against a dense
reference."""

import numpy as np

HQ, HKV, D, HIDDEN, INTER, VOCAB, LAYERS = 32, 8, 128, 4096, 2048, 2048, 2
PAGE, PAGES, THETA, EPS = 16, 512, 1e4, 1e-6
# (arrival step, prompt length, tokens to generate)
REQUESTS = [(0, 37, 12), (0, 300, 6), (1, 5, 16), (2, 129, 9), (4, 64, 14), (5, 17, 4),
            (6, 200, 10), (8, 90, 8)]  # fmt: skip


class Request:
    """A request's tokens (prompt, then what it emitted), its pages, how many of its tokens the
    cache holds, and per emitted token (context length, token, its logits, the step)."""

    def __init__(self, rid, prompt, max_new):
        self.rid, self.tokens, self.max_new = rid, list(prompt), max_new
        self.pages, self.cached, self.emitted = [], 0, []


def stream(rng):
    """The requests of REQUESTS with random prompts, and each one's arrival step."""
    requests = [Request(i, rng.integers(0, VOCAB, n).tolist(), m)
                for i, (_, n, m) in enumerate(REQUESTS)]  # fmt: skip
    return requests, [a for a, _, _ in REQUESTS]


class Step:
    """One model pass's host tables: each request's `new_tokens[b]` tokens appended to its
    pages (new pages taken from `free`), as plan() and the kernels take them: the page table
    (indptr, indices, last page lengths, indices padded to PAGES for a fixed shape), the new
    tokens, their positions and requests, qo_indptr and each request's last new row."""

    def __init__(self, requests, new_tokens, free):
        starts = [r.cached for r in requests]
        for r, n in zip(requests, new_tokens, strict=True):
            r.cached += n
            while len(r.pages) * PAGE < r.cached:
                r.pages.append(free.pop())
        self.indptr = np.cumsum([0] + [len(r.pages) for r in requests]).astype(np.int32)
        self.indices = np.array([p for r in requests for p in r.pages], np.int32)
        self.last = np.array([r.cached - (len(r.pages) - 1) * PAGE for r in requests], np.int32)
        self.padded = np.zeros(PAGES, np.int32)
        self.padded[: len(self.indices)] = self.indices
        self.tokens = np.array([t for r, s, n in zip(requests, starts, new_tokens, strict=True)
                                for t in r.tokens[s : s + n]], np.int32)  # fmt: skip
        self.positions = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(starts, new_tokens, strict=True)]
        ).astype(np.int32)
        self.batch_indices = np.repeat(np.arange(len(requests)), new_tokens).astype(np.int32)
        self.qo_indptr = np.cumsum([0] + list(new_tokens)).astype(np.int32)
        self.ends = self.qo_indptr[1:] - 1


def block_table(requests, width: int):
    """Each request's pages in order, a row of `width` per request (the rest 0): the page table
    as an engine keeps it on the device (decode_tables)."""
    blocks = np.zeros((len(requests), width), np.int32)
    for row, r in zip(blocks, requests, strict=True):
        row[: len(r.pages)] = r.pages
    return blocks


def decode_tables(xp, tokens, positions, blocks, capacity: int):
    """A decode step's tables from what an engine keeps on the device, computed with the array
    namespace xp (numpy or jax.numpy; inside jax.jit, on the device): request b appends
    tokens[b] at positions[b] to its pages blocks[b] (in order; pages past its length, reserved
    ahead, are not read). Returns Step's (tokens, positions, batch indices, indices padded to
    `capacity`, indptr, last page lengths, ends) for one new token per request: request b
    holds n_b = positions[b] // PAGE + 1 pages, indptr = [0, cumsum(n)], last_b = positions[b]
    + 1 - (n_b - 1) * PAGE, and slot s < indptr[-1] of the indices holds page s - indptr[r] of
    the request r with indptr[r] <= s < indptr[r + 1] (the rest 0)."""
    batch, width = blocks.shape
    n = positions // PAGE + 1
    indptr = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(n).astype(xp.int32)])
    slot = xp.arange(capacity, dtype=xp.int32)
    owner = xp.sum(slot[:, None] >= indptr[None, 1:], axis=1)  # batch past the last page
    row = xp.minimum(owner, batch - 1)
    page = blocks[row, xp.clip(slot - indptr[row], 0, width - 1)]
    indices = xp.where(owner < batch, page, 0).astype(xp.int32)
    rows = xp.arange(batch, dtype=xp.int32)
    return tokens, positions, rows, indices, indptr, (positions + 1 - (n - 1) * PAGE), rows


def shard_columns(widths, n: int) -> np.ndarray:
    """Column order of a weight made of parts `widths` wide side by side (qkv: q, k, v; gate_up:
    gate, up) that gives each of n tensor-parallel shards one contiguous block holding its
    n-th of every part, in order: w[:, order] split into n equal blocks is what each device
    holds (its heads' q, k and v; its gate and up columns)."""
    starts = np.cumsum([0, *widths[:-1]])
    return np.concatenate(
        [
            np.arange(s + i * (w // n), s + (i + 1) * (w // n))
            for i in range(n)
            for s, w in zip(starts, widths, strict=True)
        ]
    )


def check(done, reference, resample=None) -> bool:
    """Every emitted token's logits (float) against reference(tokens) -> the dense model's
    logits of the last position (NumPy): within 3e-2 of max |logit|, all finite, the token the
    reference's argmax or within twice the logits' error of it (a near tie). Prints each
    request's tokens, a line per mismatch (with resample(row) -> the sampler's token for that
    row again, when given) and a summary; returns whether all hold."""
    worst, flips, ok = 0.0, 0, True
    for r in sorted(done, key=lambda r: r.rid):
        for n, token, row, where in r.emitted:
            want = np.asarray(reference(r.tokens[:n]), np.float64)
            row = np.asarray(row, np.float64)
            finite = np.isfinite(row)
            error = float(np.abs(row - want).max()) if finite.all() else float("inf")
            scale = float(np.abs(want).max())
            worst = max(worst, error / scale)
            best = int(want.argmax())
            good = error < 3e-2 * scale
            if token != best:
                flips += 1
                good &= bool(want[best] - want[token] <= 2 * error)
            if not good:
                again = "" if resample is None else f", sampled again {resample(row)}"
                print(f"request {r.rid} at context {n} ({where}): token {token}, argmax {best}, "
                      f"non-finite logits {int((~finite).sum())}{again}: MISMATCH")  # fmt: skip
            ok &= good
        print(f"request {r.rid}: prompt {len(r.tokens) - len(r.emitted)}, tokens "
              f"{[e[1] for e in r.emitted]}")  # fmt: skip
    print(f"logits max error {worst:.1e} (relative to max |logit|), tokens other than the "
          f"reference's argmax: {flips} (near ties)")  # fmt: skip
    return ok
