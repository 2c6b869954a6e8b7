"""A Llama-style pre-attention and MLP step on PyTorch tensors (needs a CUDA GPU)."""

import torch

import rtcinfer

tokens, hidden, inter = 256, 4096, 14336
x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
residual = torch.randn_like(x)
w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
rtcinfer.fused_add_rmsnorm(x, residual, w, eps=1e-5)
q = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
pos = torch.arange(tokens, device="cuda", dtype=torch.int32)
rtcinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos)
h = rtcinfer.silu_and_mul(torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
print("ok:", tuple(x.shape), tuple(q.shape), tuple(h.shape), h.dtype)
