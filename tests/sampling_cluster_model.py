"""NumPy model of the cluster sampler (cuda_src/sampling/sampling_cluster.cu), bit-exact: its
masses are integers (fixed point), its pivots float32 operations that NumPy performs the same
way, and its draw order is reproduced below: (CTA, thread, float4 group, element), or token
order when a top-k row is finished on rank 0's candidate list."""

from __future__ import annotations

import numpy as np

from rtcinfer.sampling.cluster import THREADS, slice_elements
from tests.sampling_model import Probs, below, uniform

__all__ = ["Probs", "draw_order", "on_list", "sample_row", "warp_maxima"]

MAX_ROUNDS = 64


def draw_order(vocab: int, cluster: int, vec: int, threads: int = THREADS) -> np.ndarray:
    """Token ids in the order the kernel's prefix sum visits them."""
    seg, out = slice_elements(vocab, cluster, vec), []
    for r in range(cluster):
        base = r * seg
        n = max(0, min(seg, vocab - base))
        quads = np.arange(-(-n // 4))
        quads = quads[np.lexsort((quads // threads, quads % threads))]  # by thread, then step
        ids = (base + 4 * quads[:, None] + np.arange(4)).reshape(-1)
        out.append(ids[ids < base + n])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def fixed(values, M) -> np.ndarray:
    """rint(fp32(v * 2^(40 - E))) for M in [2^E, 2^(E+1)), the scale at most 2^127."""
    E = int(np.float32(M).view(np.uint32) >> np.uint32(23)) - 127
    scale = np.float32(2.0 ** min(40 - E, 127))
    scaled = (values.astype(np.float32) * scale).astype(np.float32)
    return np.rint(scaled.astype(np.float64)).astype(np.uint64)


def warp_maxima(values, cluster: int, vec: int, threads: int = THREADS) -> np.ndarray:
    """[cluster * warps] maxima of the values each warp loads (vectors of `vec` elements dealt
    to the threads in turn)."""
    seg, warps = slice_elements(len(values), cluster, vec), threads // 32
    out = np.zeros(cluster * warps, np.float32)
    for r in range(cluster):
        part = values[r * seg : r * seg + max(0, min(seg, len(values) - r * seg))]
        warp = (np.arange(len(part)) // vec % threads) // 32
        np.maximum.at(out, r * warps + warp, part)
    return out


def on_list(values, k: int, cluster: int, vec: int, threads: int = THREADS) -> bool:
    """Whether rank 0 finishes the row on its candidate list: k within the warp maxima, a
    positive floor (the k-th largest of them), and at most `threads` values >= the floor."""
    maxima = warp_maxima(values, cluster, vec, threads)
    if k > len(maxima):
        return False
    floor = np.sort(maxima)[::-1][k - 1]
    return bool(floor > 0 and np.count_nonzero(values >= floor) <= threads)


def kth_largest(values, k: int, padded: int) -> np.float32:
    """The k-th largest value, the row padded with zeros to `padded` elements."""
    v = np.sort(np.concatenate([values, np.zeros(padded - len(values), np.float32)]))
    return np.float32(v[len(v) - k])


def sample_row(row, op: str, *, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=0, b=0,
               cluster=8, vec=4) -> int:  # fmt: skip
    """The token cluster_sample_kernel draws for output row b from probability row `row`."""
    v = Probs.clean(row)
    vocab = len(v)
    M = np.float32(v.max())
    if not M > 0:
        return 0
    order = draw_order(vocab, cluster, vec)
    f = fixed(v, M)
    low = np.float32(0)
    use_k = op in ("top_k", "top_k_top_p", "top_k_first") and 0 < top_k < vocab
    if use_k:
        seg = slice_elements(vocab, cluster, vec)  # each slice is padded to whole float4s
        padded = sum(-(-max(0, min(seg, vocab - r * seg)) // 4) * 4 for r in range(cluster))
        low = below(kth_largest(v, int(top_k), padded))
        if on_list(v, int(top_k), cluster, vec):  # rank 0 draws from the list in token order
            order = np.arange(vocab)
    if op == "min_p" and min_p > 0:
        low = below(np.float32(min(np.float32(min_p), np.float32(1))) * M)
    top_p = np.float32(top_p)
    rejecting = op in ("top_p", "top_k_top_p", "top_k_first") and top_p < 1
    base_mass = int(f.sum()) if op == "top_k_top_p" and rejecting and use_k else 0
    high, P = M, 0
    fo, vo = f[order], v[order]
    for r in range(MAX_ROUNDS):
        mass = np.where(vo > low, fo, np.uint64(0))
        total = int(mass.sum())
        if total == 0:
            break
        target = int(np.floor(np.float64(uniform(seed, offset, b, r)) * np.float64(total)))
        target = min(target, total - 1)
        j = int(np.flatnonzero(np.cumsum(mass) > np.uint64(target))[0])
        token, x1 = int(order[j]), np.float32(vo[j])
        if not rejecting:
            return token
        if r == 0:
            P = int(np.rint(np.float64(top_p) * np.float64(base_mass or total)))
        x2 = np.float32(np.float32(x1 + high) * np.float32(0.5))
        stats = [(np.count_nonzero(v > x), int(f[v > x].sum())) for x in (x1, x2)]
        if stats[0][0] == 0 or stats[0][1] < P:
            return token
        if stats[1][0] == 0 or stats[1][1] < P:
            low, high = x1, x2
        else:
            low = x2
    return int(np.flatnonzero(v == M)[0])
