"""NumPy model of the sampling kernels (cuda_src/sampling/philox.cuh, row_scan.cuh, row_select.cuh,
sampling.cu, renorm.cu), with the same loop structure:

- Philox4x32-10 and the uniform of (seed, offset, row, draw): bit-exact;
- pass 0's block maxima, the floor taken from them (the k-th largest, min-p's threshold, the
  top-p cut), the gather of the values >= floor into per-warp regions and the list-or-row
  decision (a top-p list that does not prove its floor serving round 0 first): bit-exact, but
  for the list's mass against P (float64 here, fp32 in the kernel);
- the radix select (count or fixed-point mass, 8-bit digits): bit-exact (integers);
- the dual-pivot rejection rounds: the same pivots and decisions, with float64 sums where the
  kernel sums fp32 in a fixed order, so a token can differ from the kernel's only when a draw
  or a decision lies within rounding of a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rtcinfer.layout import row_threads, widest_vec
from rtcinfer.sampling import renorm, samplers

# --- Philox4x32-10 ----------------------------------------------------------------------------

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """counter: [..., 4] uint32, key: [..., 2] uint32 -> [..., 4] uint32 (Random123's)."""
    c = [np.asarray(counter, np.uint64)[..., i] for i in range(4)]
    k0, k1 = (np.asarray(key, np.uint64)[..., i] for i in range(2))
    for _ in range(10):
        p0, p1 = np.uint64(_M0) * c[0], np.uint64(_M1) * c[2]
        c = [
            (p1 >> np.uint64(32)) ^ c[1] ^ k0,
            p1 & _U32,
            (p0 >> np.uint64(32)) ^ c[3] ^ k1,
            p0 & _U32,
        ]
        k0, k1 = (k0 + np.uint64(_W0)) & _U32, (k1 + np.uint64(_W1)) & _U32
    return np.stack(c, axis=-1).astype(np.uint32)


def uniform(seed: int, offset: int, row, draw) -> np.ndarray:
    """The kernels' uniform in [0, 1): word 0 of philox((draw, row, offset), seed) >> 8, / 2^24."""
    row, draw = np.broadcast_arrays(np.asarray(row, np.uint64), np.asarray(draw, np.uint64))
    counter = np.stack([draw, row, np.full_like(row, offset & 0xFFFFFFFF),
                        np.full_like(row, (offset >> 32) & 0xFFFFFFFF)], axis=-1)  # fmt: skip
    key = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], np.uint64)
    x = philox4x32_10(counter, np.broadcast_to(key, counter.shape[:-1] + (2,)))[..., 0]
    return ((x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


# --- kernel geometry and value policies --------------------------------------------------------

BLOCKS_W = 256  # block maxima per warp


@dataclass(frozen=True)
class Block:
    threads: int
    vec: int

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def cap_w(self) -> int:
        return 8 * self.threads // self.warps

    def seg(self, n: int) -> int:
        return -(-(n // self.vec) // self.warps) * self.vec

    def steps(self, n: int) -> tuple[int, int, int]:
        """(steps, group, blocks) per warp: steps of 32 * vec elements, `group` steps a block."""
        steps = -(-self.seg(n) // (32 * self.vec))
        group = max(1, -(-steps // BLOCKS_W))
        return steps, group, -(-steps // group)


def block_for(vocab: int, batch: int = 1, sm_count: int = 132, itemsize: int = 4,
              op: str = "plain") -> Block:  # fmt: skip
    """The kernels' block for `op` (a sampler's or a renorm op's name) on [batch, vocab]."""
    by_rank = op in samplers.BY_RANK or op in renorm.BY_RANK
    return Block(row_threads(vocab, batch, sm_count, by_rank), widest_vec(vocab, itemsize))


class Probs:
    lowest = np.float32(0.0)

    @staticmethod
    def clean(v):
        v = np.asarray(v, np.float32)
        return np.where(v > 0, v, np.float32(0)).astype(np.float32)  # NaN, -0, < 0 -> +0

    @staticmethod
    def key(v):
        return np.asarray(v, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)


class Logits:
    lowest = np.float32(-np.inf)

    @staticmethod
    def clean(v):
        v = np.asarray(v, np.float32)
        return np.where(np.isnan(v), np.float32(-np.inf), v).astype(np.float32)

    @staticmethod
    def key(v):
        b = np.asarray(v, np.float32).view(np.uint32)
        return np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)


# --- pass 0 and the candidate list -------------------------------------------------------------


@dataclass
class Scan:
    values: np.ndarray  # cleaned row (float32)
    bmax: np.ndarray  # [warps, blocks] block maxima (lowest for blocks past the row)
    M: np.float32  # row maximum
    S: float  # sum of the cleaned values (float64 here, fp32 in the kernel)


def _segments(values, block: Block, fill):
    """[warps, steps, 32 * vec] view of the row as the warps read it (`fill` past the end)."""
    n, seg, (steps, _, _) = len(values), block.seg(len(values)), block.steps(len(values))
    padded = np.full(block.warps * seg, fill, np.float32)
    padded[:n] = values
    out = np.full((block.warps, steps * 32 * block.vec), fill, np.float32)
    out[:, :seg] = padded.reshape(block.warps, seg)
    return out.reshape(block.warps, steps, 32 * block.vec)


def scan_row(row, block: Block, policy=Probs) -> Scan:
    """Pass 0: sum, maximum and block maxima (a block = `group` steps of one warp)."""
    values = policy.clean(row)
    steps, group, blocks = block.steps(len(values))
    step_max = _segments(values, block, policy.lowest).max(axis=2)  # [warps, steps]
    padded = np.full((block.warps, blocks * group), policy.lowest, np.float32)
    padded[:, :steps] = step_max
    bmax = padded.reshape(block.warps, blocks, group).max(axis=2)
    total = float(values.astype(np.float64).sum()) if policy is Probs else 0.0
    return Scan(values, bmax, np.float32(values.max()), total)


def gather(scan: Scan, block: Block, floor, policy=Probs):
    """Token ids of the valid values >= floor (token order), read from the blocks whose maximum
    reaches floor (a block holding such a value always does); None when a warp's region of
    cap_w slots overflows."""
    values, seg = scan.values, block.seg(len(scan.values))
    take = (values >= floor) & (values > policy.lowest)
    ids = np.flatnonzero(take)
    if np.bincount(ids // seg, minlength=block.warps).max(initial=0) > block.cap_w:
        return None
    return ids.astype(np.int64)


# --- radix select ------------------------------------------------------------------------------


def fixed_mass(v, M) -> np.ndarray:
    """The kernels' fixed-point masses: round(v * 2^40 / M) in float64."""
    scale = np.float64(2.0**40) / np.float64(M)
    return np.rint(np.asarray(v, np.float64) * scale).astype(np.uint64)


def radix_select(values, policy, *, k=None, p_fixed=None, M=None):
    """(threshold value, kept fixed mass) of the kernels' radix select over `values` (already
    restricted to the entries considered); None when every value is kept (fewer than k)."""
    keys = policy.key(values).astype(np.uint64)
    mass = fixed_mass(values, M) if M is not None else np.zeros(len(values), np.uint64)
    prefix, greater, greater_mass, kept = 0, 0, 0, 0
    for level in range(4):
        shift = 24 - 8 * level
        sel = np.ones(len(keys), bool) if level == 0 else (keys >> (shift + 8)) == prefix
        digits = ((keys[sel] >> shift) & 255).astype(np.int64)
        cnt = np.bincount(digits, minlength=256)
        msum = np.zeros(256, np.uint64)
        np.add.at(msum, digits, mass[sel])
        above_cnt = np.concatenate([np.cumsum(cnt[::-1])[::-1][1:], [0]])  # bins > d
        above_mass = np.concatenate([np.cumsum(msum[::-1])[::-1][1:], [np.uint64(0)]])
        pick = None
        if p_fixed is None:
            reach = np.flatnonzero(greater + above_cnt + cnt >= k)
            pick = int(reach.max()) if len(reach) else None
        else:
            a = np.uint64(greater_mass) + above_mass
            ok = np.flatnonzero((cnt > 0) & ((a < np.uint64(p_fixed)) | (a == 0)))
            pick = int(ok.min()) if len(ok) else None
        if pick is None:
            return None
        prefix = (prefix << 8) | pick
        greater += int(above_cnt[pick])
        greater_mass = int(np.uint64(greater_mass) + above_mass[pick])
        kept = greater_mass + int(msum[pick])
    threshold = np.array([prefix], np.uint32)
    if policy is Logits:
        b = threshold[0]
        threshold = np.array([b & 0x7FFFFFFF if b & 0x80000000 else ~b & 0xFFFFFFFF], np.uint32)
    return threshold.view(np.float32)[0], kept


# --- the samplers (cuda_src/sampling/sampling.cu) ---------------------------------------------

OPS = ("plain", "top_k", "top_p", "min_p", "top_k_top_p", "top_k_first")
MAX_ROUNDS = 64


def below(t) -> np.float32:
    """The largest float32 below t (0 for t <= 0)."""
    t = np.float32(t)
    return (
        (np.array([t], np.float32).view(np.uint32) - np.uint32(1)).view(np.float32)[0]
        if t > 0
        else np.float32(0)
    )


@dataclass
class Draw:
    token: int
    rounds: int  # draws used (0 for the fallback)
    on_list: bool
    part: bool = False  # round 0 drew from a list whose mass did not prove the top-p floor


def _inverse_transform(values, u) -> int:
    """The draw among `values` (in the order given) for uniform u: the first whose running sum
    (float64) exceeds u times their total; the last when rounding keeps every sum below it."""
    cum = np.cumsum(values.astype(np.float64))
    hit = np.flatnonzero(cum > float(u) * cum[-1])
    return int(hit[0]) if len(hit) else len(values) - 1


def _fixed_scale(M) -> np.float64:
    return np.float64(2.0**40) / np.float64(M)


def sample_floor(scan: Scan, op: str, use_k, top_k, use_p, P, use_min, t):
    """(floor, needs a mass proof) of the kernel, from the block maxima: the k-th largest block
    maximum (top-k), min-p's threshold, or the top-p cut of the block maxima alone (valid when
    the values >= it carry mass >= P)."""
    blocks = scan.bmax[scan.bmax > 0]
    if op == "min_p":
        return (np.float32(t) if use_min else np.float32(0)), False
    if op in ("top_k", "top_k_top_p", "top_k_first") and use_k:
        found = radix_select(blocks, Probs, k=top_k)
        return (np.float32(0) if found is None else found[0]), False
    if op in ("top_p", "top_k_top_p", "top_k_first") and use_p and scan.M > 0:
        p_fixed = np.uint64(np.rint(np.float64(max(P, np.float32(0))) * _fixed_scale(scan.M)))
        found = radix_select(blocks, Probs, p_fixed=p_fixed, M=scan.M)
        return (np.float32(0) if found is None else found[0]), True
    return np.float32(0), False


def sample_row(row, op: str, *, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=0, b=0,
               block: Block | None = None, scan: Scan | None = None) -> Draw:  # fmt: skip
    """The token the kernel draws for output row b from probability row `row` (pass `scan`
    and `block` to reuse pass 0 across draws of the same row)."""
    block = block or block_for(len(row))
    scan = scan or scan_row(row, block)
    values, M, S = scan.values, scan.M, np.float32(scan.S)
    vocab = len(values)
    use_k = op in ("top_k", "top_k_top_p", "top_k_first") and 0 < top_k < vocab
    use_p = op in ("top_p", "top_k_top_p", "top_k_first") and np.float32(top_p) < 1
    P = np.float32(top_p) * S
    use_min = op == "min_p" and min_p > 0
    t = np.float32(min(min_p, 1.0)) * M
    floor, need_mass = sample_floor(scan, op, use_k, top_k, use_p, P, use_min, t)
    ids = part = None
    if op != "plain" and (floor > 0 or vocab <= 8 * block.threads):
        ids = gather(scan, block, floor)
        if ids is not None and need_mass and not values[ids].astype(np.float64).sum() >= P:
            part, ids = ids, None  # the floor is not proved: stream the row, list first
    on_list = ids is not None
    first = None
    if part is not None:  # round 0 over the listed values (all kept), then those below the floor
        order = np.concatenate([part, np.flatnonzero((values > 0) & (values < floor))])
        j = _inverse_transform(values[order], uniform(seed, offset, b, 0))
        if j < len(part):
            return Draw(int(order[j]), 1, False, part=True)
        first = int(order[j]), np.float32(values[order[j]])
    if not on_list:
        ids = np.arange(vocab)
    low = below(floor) if on_list else np.float32(0)
    src = values[ids]
    if use_min:
        low = max(low, below(t))
    if op == "top_k_first" and use_k and M > 0:
        found = radix_select(src[src > low], Probs, k=top_k, M=M)
        if found is not None:
            low = below(found[0])
            P = np.float32(top_p) * np.float32(np.float64(found[1]) / _fixed_scale(M))
    rejecting, high = (use_k and op != "top_k_first") or use_p, M

    def kept(c, m):
        return (not use_k or c < top_k) and (not use_p or c == 0 or m < P)

    for r in range(MAX_ROUNDS):
        if r == 0 and first is not None:
            token, x1 = first
        else:
            cand = src > low
            if not cand.any():
                break
            cv, cid = src[cand], ids[cand]
            j = _inverse_transform(cv, uniform(seed, offset, b, r))
            token, x1 = int(cid[j]), np.float32(cv[j])
        if not rejecting:
            return Draw(token, r + 1, on_list)
        x2 = np.float32(np.float32(x1 + high) * np.float32(0.5))
        above = [
            (np.count_nonzero(src > x), src[src > x].astype(np.float64).sum()) for x in (x1, x2)
        ]
        if kept(*above[0]):
            return Draw(token, r + 1, on_list, part=first is not None)
        if kept(*above[1]):
            low, high = x1, x2
        else:
            low = x2
    token = 0 if not M > 0 else int(np.flatnonzero(values == M)[0])
    return Draw(token, 0, on_list)


# --- threshold ops (cuda_src/sampling/renorm.cu) ----------------------------------------------


def renorm_row(row, op: str, param, block: Block | None = None) -> np.ndarray:
    """The kernel's output row (float32) of top_k_renorm / top_p_renorm / top_k_mask."""
    policy = Logits if op == "top_k_mask" else Probs
    block = block or block_for(len(row))
    scan = scan_row(row, block, policy)
    values, M, S = scan.values, scan.M, np.float32(scan.S)
    vocab, by_mass = len(values), op == "top_p_renorm"
    found = None
    if by_mass:
        keep_all = not np.float32(param) < 1 or not M > 0
    else:
        keep_all = param <= 0 or param >= vocab
    if not keep_all:
        mass_m = M if op != "top_k_mask" else None
        p_fixed = None
        if by_mass:
            P = np.float32(max(np.float32(param), np.float32(0)) * S)
            p_fixed = np.uint64(np.rint(np.float64(P) * _fixed_scale(M)))
        blocks = scan.bmax[scan.bmax > policy.lowest]
        if by_mass:
            bt = radix_select(blocks, policy, p_fixed=p_fixed, M=M)
        else:
            bt = radix_select(blocks, policy, k=int(param))
        floor = policy.lowest if bt is None else bt[0]
        ids = None
        if floor > policy.lowest or vocab <= 8 * block.threads:
            ids = gather(scan, block, floor, policy)
            if ids is not None and by_mass and not values[ids].astype(np.float64).sum() >= P:
                ids = None
        entries = values[ids] if ids is not None else values[values > policy.lowest]
        if by_mass:
            found = radix_select(entries, policy, p_fixed=p_fixed, M=mass_m)
        else:
            found = radix_select(entries, policy, k=int(param), M=mass_m)
    raw = np.asarray(row, np.float32)
    if op == "top_k_mask":
        v = np.float32(-np.inf) if found is None else found[0]
        keep = ~np.isnan(raw) & (raw >= v)
        return np.where(keep, raw, np.float32(-np.inf)).astype(np.float32)
    v = np.float32(0) if found is None else found[0]
    z = S if found is None else np.float32(np.float64(found[1]) / _fixed_scale(M))
    inv = np.float32(1) / z if z > 0 else np.float32(0)
    return np.where(values >= v, values * inv, np.float32(0)).astype(np.float32)
