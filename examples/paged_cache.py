"""What the decode examples share: an engine's page table on the host, and float64 NumPy
references of what the GPU does (the append of new tokens, attention over each request)."""

import numpy as np


class PageTable:
    """Each request's pages, drawn from a shuffled free list as it grows (the engine's job).

    A request of n tokens holds ceil(n / page_size) pages; token j sits in page
    pages[j // page_size], slot j % page_size."""

    def __init__(self, lengths, page_size, num_pages, rng):
        self.page_size = page_size
        self.free = [int(p) for p in rng.permutation(num_pages)]
        self.lengths = list(lengths)
        self.pages = [[self.free.pop() for _ in range(-(-n // page_size))] for n in lengths]

    def grow(self):
        """One more token per request; a request whose last page is full takes a new one."""
        for b, n in enumerate(self.lengths):
            if n % self.page_size == 0:
                self.pages[b].append(self.free.pop())
            self.lengths[b] = n + 1

    def arrays(self):
        """(kv_indptr, kv_indices, kv_last_page_len) as int32 host arrays (FlashInfer's form)."""
        indptr = np.cumsum([0] + [len(p) for p in self.pages]).astype(np.int32)
        indices = np.array([page for pages in self.pages for page in pages], np.int32)
        pairs = zip(self.lengths, self.pages, strict=True)
        last = [n - (len(p) - 1) * self.page_size for n, p in pairs]
        return indptr, indices, np.array(last, np.int32)

    def last_tokens(self):
        """(page, slot) of each request's last token."""
        return [(p[(n - 1) // self.page_size], (n - 1) % self.page_size)
                for n, p in zip(self.lengths, self.pages, strict=True)]  # fmt: skip


def append(cache, table, k, v):
    """The reference append: each request's new key and value (k, v [B, Hkv, D]) into the slot
    of its last token, in the host cache [pages, 2, page_size, Hkv, D] (NHD)."""
    for b, (page, slot) in enumerate(table.last_tokens()):
        cache[page, 0, slot], cache[page, 1, slot] = k[b], v[b]


def attention(q, cache, table):
    """Dense float64 attention of q [B, Hq, D] over each request's tokens in the host cache:
    o[b, h] = softmax(q[b, h] . K_b[:, h // group] / sqrt(D)) @ V_b[:, h // group]."""
    batch, num_qo_heads, head_dim = q.shape
    group = num_qo_heads // cache.shape[3]
    out = np.zeros((batch, num_qo_heads, head_dim))
    for b, (n, pages) in enumerate(zip(table.lengths, table.pages, strict=True)):
        k = np.repeat(cache[pages, 0].reshape(-1, *cache.shape[3:])[:n], group, axis=1)
        v = np.repeat(cache[pages, 1].reshape(-1, *cache.shape[3:])[:n], group, axis=1)
        s = np.einsum("hd,nhd->hn", q[b], k) / np.sqrt(head_dim)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v)
    return out


def check_step(step, table, mirror, q, o, cache, logits, tokens, top_k):
    """Compare one step's results (host arrays) with the references: o with attention over the
    reference cache `mirror` (max error relative to max |o|, under 2e-2 for bf16), the device
    cache with `mirror` bit for bit, each token with its row's top_k logits. Prints a line and
    returns whether all hold."""
    expected = attention(q, mirror, table)
    error = float(np.max(np.abs(o - expected)) / np.max(np.abs(expected)))
    exact = bool(np.array_equal(cache, mirror))
    top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    sampled = all(int(t) in set(row) for t, row in zip(tokens, top, strict=True))
    good = error < 2e-2 and exact and sampled
    print(
        f"step {step}: lengths {table.lengths}, attention max error {error:.1e} (relative), "
        f"cache {'exact' if exact else 'WRONG'}, tokens {[int(t) for t in tokens]} "
        f"{'in' if sampled else 'NOT in'} the top {top_k}: {'OK' if good else 'FAIL'}"
    )
    return good
