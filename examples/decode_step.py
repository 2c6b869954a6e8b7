"""A decode loop on PyTorch tensors (needs a CUDA GPU): a paged KV cache holding four requests
of different lengths; each step appends every request's new key and value
(append_paged_kv_cache, positions from the device helpers), plans the batch once (plan: host
arrays, no sync), runs batch decode (run: once per layer in a model, once here) and samples
the next tokens (top_k_top_p_sampling_from_logits). Each step is checked against float64 NumPy
(the attention output, the cache bit for bit, the tokens within the top k); exit code 1 on a
mismatch."""

import sys

import numpy as np
import paged_cache
import torch

import rtcinfer

HQ, HKV, D, PAGE, PAGES, VOCAB = 32, 8, 128, 16, 64, 32000
LENGTHS = [37, 200, 1, 513]  # tokens each request holds before the first step
STEPS, TOP_K, TOP_P = 3, 50, 0.9


def host(x):
    return x.double().cpu().numpy()


rng = np.random.default_rng(0)
torch.manual_seed(0)
batch = len(LENGTHS)
table = paged_cache.PageTable(LENGTHS, PAGE, PAGES, rng)
cache = torch.randn(PAGES, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)  # NHD pages
mirror = host(cache)  # what the reference reads
decode = rtcinfer.BatchDecodeWithPagedKVCacheWrapper()  # one per model, reused every step
append_indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32)  # one token each
ok = True
for step in range(STEPS):
    table.grow()
    indptr, indices, last = table.arrays()
    indptr_d, indices_d, last_d = (torch.from_numpy(x).cuda() for x in (indptr, indices, last))
    k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seq_lens = rtcinfer.get_seq_lens(indptr_d, last_d, PAGE)
    batch_indices, positions = rtcinfer.get_batch_indices_positions(append_indptr, seq_lens, batch)
    rtcinfer.append_paged_kv_cache(k, v, batch_indices, positions, cache, indices_d, indptr_d,
                                   last_d)  # fmt: skip
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    o = decode.run(q, cache)
    logits = torch.randn(batch, VOCAB, device="cuda")
    tokens = rtcinfer.top_k_top_p_sampling_from_logits(logits, TOP_K, TOP_P)

    paged_cache.append(mirror, table, host(k), host(v))
    ok &= paged_cache.check_step(step, table, mirror, host(q), host(o), host(cache), host(logits),
                                 tokens.cpu().numpy(), TOP_K)  # fmt: skip
rtcinfer.check_errors()  # raises if the device skipped a bad page id or position
print("OK" if ok else "FAIL")
sys.exit(0 if ok else 1)
