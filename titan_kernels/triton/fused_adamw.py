"""Triton AdamW over a list of tensors in one launch (multi-tensor apply), with stochastic rounding
for bfloat16 storage. Math and random bits: titan_kernels/reference/fused_adamw.py.

Layout: every tensor is contiguous. The launcher writes one table row per tensor (addresses of
param, grad, exp_avg, exp_avg_sq, numel, counter offset, stream key) and one row per chunk of
``BLOCK * ITERS`` elements (tensor index, first element); program i runs chunk i. One launch per
(param, grad, state) dtype combination: a parameter group normally has one.

Traffic per element: reads g, p, m, v; writes p, m, v: 28 bytes in float32, 16 with bf16 states and
parameter. Math in float32; the counter is int64, so tensors past 2^31 elements index correctly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_kernels.reference.fused_adamw import K2, MUL1, MUL2

BLOCK = 1024
ITERS = 4  # blocks per program: fewer programs and table rows for large tensors

_DT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


_MUL1 = tl.constexpr(MUL1)
_MUL2 = tl.constexpr(MUL2)
_K2 = tl.constexpr(K2)


@triton.jit
def _u32(value):
    # A uint32 scalar: Python ints >= 2^31 would otherwise promote the arithmetic to int64.
    return tl.full((), value, tl.uint32)


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * _u32(_MUL1)
    x = x ^ (x >> 15)
    x = x * _u32(_MUL2)
    return x ^ (x >> 16)


@triton.jit
def _round_bf16(x, bits):
    # Stochastic rounding to bf16: add 16 random bits below the bf16 mantissa, truncate (exact cast).
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (bits & _u32(0xFFFF))) & _u32(0xFFFF0000)
    y = u.to(tl.float32, bitcast=True)
    y = tl.where(x != x, x, y)
    return y.to(tl.bfloat16)


@triton.jit
def _adamw_kernel(
    TENSORS, CHUNKS,
    omb1, beta2, omb2, eps, decay, step_size, bc2_sqrt,
    P_DT: tl.constexpr, G_DT: tl.constexpr, S_DT: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(CHUNKS + 2 * pid)
    start = tl.load(CHUNKS + 2 * pid + 1)
    row = TENSORS + 7 * t
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DT))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(S_DT))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(S_DT))
    n = tl.load(row + 4)
    offset = tl.load(row + 5)
    key = tl.load(row + 6).to(tl.uint32)
    for it in range(ITERS):
        idx = start + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = m + omb1 * (g - m)
        v = v * beta2 + omb2 * g * g
        p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        if P_DT == tl.bfloat16 or S_DT == tl.bfloat16:
            c = idx + offset
            hi = (c >> 32).to(tl.uint32)
            lo = c.to(tl.uint32)
            r1 = _hash32(lo + _hash32(key ^ hi))
            # The bf16 outputs of (p, m, v) in order take the words r1 low, r1 high, r2 low.
            if P_DT == tl.bfloat16:
                tl.store(p_ptr + idx, _round_bf16(p, r1), mask=mask)
                if S_DT == tl.bfloat16:
                    r2 = _hash32(lo + _hash32(key ^ hi ^ _u32(_K2)))
                    tl.store(m_ptr + idx, _round_bf16(m, r1 >> 16), mask=mask)
                    tl.store(v_ptr + idx, _round_bf16(v, r2), mask=mask)
                else:
                    tl.store(m_ptr + idx, m, mask=mask)
                    tl.store(v_ptr + idx, v, mask=mask)
            else:
                tl.store(p_ptr + idx, p, mask=mask)
                tl.store(m_ptr + idx, _round_bf16(m, r1), mask=mask)
                tl.store(v_ptr + idx, _round_bf16(v, r1 >> 16), mask=mask)
        else:
            tl.store(p_ptr + idx, p, mask=mask)
            tl.store(m_ptr + idx, m, mask=mask)
            tl.store(v_ptr + idx, v, mask=mask)


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, keys, offsets,
                 *, block: int = BLOCK, iters: int = ITERS) -> None:
    """Triton backend of ``titan::fused_adamw_``; same contract as
    ``titan_kernels.reference.fused_adamw.fused_adamw_``. Every tensor must be contiguous (the op
    layer makes them so). One launch per dtype combination of (param, grad, states)."""
    from titan_kernels.reference.fused_adamw import step_scalars

    decay, step_size, bc2_sqrt = step_scalars(lr, beta1, beta2, weight_decay, step)
    combos: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            combos.setdefault((p.dtype, grads[i].dtype, exp_avgs[i].dtype), []).append(i)
    span = block * iters
    for (pdt, gdt, sdt), idxs in combos.items():
        rows, chunks = [], []
        for j, i in enumerate(idxs):
            n = params[i].numel()
            rows.append([params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                         exp_avg_sqs[i].data_ptr(), n, int(offsets[i]), int(keys[i]) & 0xFFFFFFFF])
            chunks.extend(x for s in range(0, n, span) for x in (j, s))
        dev = params[idxs[0]].device
        tensors = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        chunk_t = torch.tensor(chunks, dtype=torch.int64).to(dev, non_blocking=True)
        _adamw_kernel[(len(chunks) // 2,)](
            tensors, chunk_t, 1.0 - beta1, beta2, 1.0 - beta2, eps, decay, step_size, bc2_sqrt,
            P_DT=_DT[pdt], G_DT=_DT[gdt], S_DT=_DT[sdt], BLOCK=block, ITERS=iters, num_warps=4,
        )
