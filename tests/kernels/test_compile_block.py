"""A small Llama pre-norm block built on the titan ops compiles with torch.compile(fullgraph=True)
(Inductor, on the CPU) with no graph break, forward and backward, and matches eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import titan_kernels as tk


class PreNormBlock(nn.Module):
    def __init__(self, dim=64, n_heads=4, n_kv_heads=2, max_seq=32):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.attn_norm = tk.nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = tk.nn.RMSNorm(dim, eps=1e-5)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 96, bias=False)
        self.w2 = nn.Linear(96, dim, bias=False)
        cos, sin = tk.rope_cos_sin(self.head_dim, max_seq, theta=10000.0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, residual):
        b, s, _ = x.shape
        h_norm, h = tk.add_rms_norm(x, residual, self.attn_norm.weight, 1e-5)
        q = self.wq(h_norm).view(b, s, self.n_heads, self.head_dim)
        k, v = self.wkv(h_norm).view(b, s, 2, self.n_kv_heads, self.head_dim).unbind(2)  # strided views
        q, k = tk.apply_rotary_emb(q, k, self.cos, self.sin, interleaved=True)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return h + self.w2(F.silu(self.w1(self.ffn_norm(h))))


@pytest.mark.parametrize("be", ["reference", "triton"])
def test_prenorm_block_compiles_fullgraph_and_matches_eager(be):
    if not tk.available_backends("cpu")[be].available:
        pytest.skip(f"{be} unavailable: {tk.available_backends('cpu')[be].reason}")
    torch.manual_seed(0)
    block = PreNormBlock()
    x = torch.randn(2, 11, 64, requires_grad=True)
    r = torch.randn(2, 11, 64, requires_grad=True)
    with tk.use_backend(be):
        eager = block(x, r)
        g = torch.randn_like(eager)
        grads_eager = torch.autograd.grad(eager, [x, r, *block.parameters()], g)
        torch._dynamo.reset()
        compiled_block = torch.compile(block, fullgraph=True)  # Inductor; a graph break would raise
        out = compiled_block(x, r)
        grads = torch.autograd.grad(out, [x, r, *block.parameters()], g)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
