"""top_k's select pass (cuda_src/sampling/renorm.cu, select_top_k) transcribed to NumPy and run
against the float64 reference without a GPU: where the block scans place each thread's values
above the threshold and its ties, chunk after chunk, and when the pass stops."""

from __future__ import annotations

import numpy as np
import pytest

from tests import reference_sampling as sref


def select_model(row, k: int, v: float, threads: int, vec: int, ties_last: bool = False):
    """The kernel's pass over one row (its threads in lockstep): (values, indices, chunks)."""
    clean = np.where(np.isnan(row), -np.inf, row)
    greater = int((clean > v).sum())  # pass 1
    ties = k - greater
    skip = int((clean == v).sum()) - ties if ties_last else 0
    values, indices = np.full(k, np.nan), np.full(k, -1)
    g_base = t_base = c = chunks = 0
    while c < len(row) and (g_base < greater or t_base < skip + ties):
        segs = [clean[c + t * vec : c + (t + 1) * vec] for t in range(threads)]
        gts = np.array([(s > v).sum() for s in segs])
        eqs = np.array([(s == v).sum() for s in segs])
        g_at = g_base + np.cumsum(gts) - gts  # the exclusive block scans
        t_at = t_base + np.cumsum(eqs) - eqs
        for t in range(threads):
            for j, a in enumerate(segs[t]):
                i = c + t * vec + j
                if a > v:
                    values[g_at[t]], indices[g_at[t]] = row[i], i
                    g_at[t] += 1
                elif a == v:
                    if skip <= t_at[t] < skip + ties:
                        slot = greater + t_at[t] - skip
                        values[slot], indices[slot] = row[i], i
                    t_at[t] += 1
        g_base, t_base = g_base + gts.sum(), t_base + eqs.sum()
        c, chunks = c + threads * vec, chunks + 1
    return values, indices, chunks


@pytest.mark.parametrize("ties_last", [False, True])
@pytest.mark.parametrize("threads, vec", [(32, 1), (8, 4), (64, 8)])
def test_the_select_pass_gives_the_reference(threads, vec, ties_last):
    rng = np.random.default_rng(threads * vec)
    for _ in range(200):
        d = int(rng.integers(1, 60)) * vec
        x = np.round(rng.standard_normal(d) * 4) / 2  # ties
        x[rng.random(d) < 0.1] = -np.inf
        x[rng.random(d) < 0.05] = np.nan
        k = int(rng.integers(1, d + 1))
        clean = np.where(np.isnan(x), -np.inf, x)
        v = np.sort(clean)[::-1][k - 1]  # the radix select's threshold
        values, indices, _ = select_model(x, k, v, threads, vec, ties_last)
        want_v, want_i = sref.top_k_ref(x, k, ties_last)
        np.testing.assert_array_equal(indices, want_i[0])
        np.testing.assert_array_equal(values, want_v[0])


def test_the_pass_stops_once_both_groups_are_full():
    x = np.zeros(4096)
    x[:3] = [5.0, 4.0, 3.0]  # the top 3 sit in the first chunk
    _, indices, chunks = select_model(x, 3, 3.0, threads=32, vec=4)
    assert indices.tolist() == [0, 1, 2] and chunks == 1
