"""AdamW step in plain PyTorch (float32 math), with stochastic rounding for bfloat16 storage: the
ground truth of ``titan::fused_adamw_``.

Math (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019; exactly the update of
``torch.optim.AdamW`` without amsgrad), per element at 1-based step t:
    p  <- p * (1 - lr * weight_decay)
    m  <- m + (1 - beta1) * (g - m)                      (= beta1 m + (1 - beta1) g, torch's lerp)
    v  <- beta2 * v + (1 - beta2) * g * g
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
The update uses m and v before they are rounded to their storage dtype.

Stochastic rounding (float32 -> bfloat16): add 16 random bits to the low half of the float32 bit
pattern and truncate. The result is one of the two neighbouring bf16 values, the upper one with
probability equal to the distance from the lower one in units of their gap, so E[round(x)] = x
(Gupta et al., "Deep Learning with Limited Numerical Precision", 2015). NaN stays NaN.

Random bits: a counter-based hash (no state to save), so a resumed run draws the same bits. Per
tensor, ``tensor_key(seed, step, param_key)`` (host side); per element, with c its 64-bit counter
(``offset`` + the flat index in the tensor), the 16-bit words
    w0 = low half of r1, w1 = high half of r1, w2 = low half of r2, with
    r1 = h(lo32(c) + h(key ^ hi32(c))),  r2 = h(lo32(c) + h(key ^ hi32(c) ^ K2)),
and the bf16 outputs among (param, exp_avg, exp_avg_sq), in that order, take w0, w1, w2: float32
parameters with bf16 states need one hash per element, everything in bf16 two. h = "lowbias32" (C. Wellons' 32-bit integer hash, bias 0.17):
    x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16   (mod 2^32).
Every backend (reference, Triton, csrc) computes the same bits, so they agree bit for bit.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
K2 = 0x5BD1E995  # separates the second stream (exp_avg_sq) from the first
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B


def hash32(x: int) -> int:
    """lowbias32 of a Python int (taken mod 2^32); returns an int in [0, 2^32)."""
    x &= M32
    x ^= x >> 16
    x = (x * MUL1) & M32
    x ^= x >> 15
    x = (x * MUL2) & M32
    x ^= x >> 16
    return x


def tensor_key(seed: int, step: int, param_key: int) -> int:
    """The per-tensor key of the random stream at ``step`` (uint32 as a Python int)."""
    return hash32(hash32(hash32(seed & M32) ^ (seed >> 32) ^ (param_key & M32)) ^ (step & M32))


def _hash32_t(x: torch.Tensor) -> torch.Tensor:
    # int64 tensors holding uint32 values; products stay below 2^63.
    x = x ^ (x >> 16)
    x = (x * MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def random_bits(key: int, offset: int, n: int, device: torch.device, second: bool = False) -> torch.Tensor:
    """r1 (or r2 with ``second``) of the module docstring for counters offset .. offset + n - 1, as
    int64 tensors of uint32 values."""
    c = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    hi = (c >> 32) & M32
    k = (hi ^ key) ^ (K2 if second else 0)
    return _hash32_t(((c & M32) + _hash32_t(k)) & M32)


def stochastic_round_bf16(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 up or down at random: ``bits16`` (int64, values in [0, 2^16))
    are added to the low half of the bit pattern, which is then cut off. NaN stays NaN."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    u = ((u + bits16) & 0xFFFF0000) & M32
    u = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)
    out = u.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out.view(x.shape))


def step_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """(decay, step_size, bias_correction2_sqrt) = (1 - lr*wd, lr / (1 - beta1^t), sqrt(1 - beta2^t)),
    computed in float64 as torch.optim.AdamW does on the host."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return 1.0 - lr * weight_decay, lr / bc1, bc2 ** 0.5


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                key: int = 0, offset: int = 0) -> None:
    """One AdamW step of one tensor, in place (module docstring). float32 math (float64 when the
    parameter is float64); bfloat16 storage (parameter or states) is written with stochastic
    rounding from the stream ``key`` at counters ``offset``.. (flat row-major index)."""
    acc = torch.float64 if param.dtype == torch.float64 else torch.float32
    decay, step_size, bc2_sqrt = step_scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.to(acc)
    p = param.to(acc) * decay
    m = exp_avg.to(acc)
    m = m + (1.0 - beta1) * (g - m)
    v = exp_avg_sq.to(acc) * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (v.sqrt() / bc2_sqrt + eps))
    outs = [(param, p), (exp_avg, m), (exp_avg_sq, v)]
    rounded = [t for t, _ in outs if t.dtype == torch.bfloat16]
    words = []
    if rounded:
        r1 = random_bits(key, offset, param.numel(), param.device).view(param.shape)
        words = [r1 & 0xFFFF, r1 >> 16]
        if len(rounded) == 3:
            words.append(random_bits(key, offset, param.numel(), param.device, second=True).view(param.shape) & 0xFFFF)
    j = 0
    for t, value in outs:
        if t.dtype == torch.bfloat16:
            t.copy_(stochastic_round_bf16(value, words[j]))
            j += 1
        else:
            t.copy_(value)


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, keys, offsets):
    """The reference backend of ``titan::fused_adamw_``: ``adamw_step_`` on each tensor of the lists
    (``keys``: the per-tensor stream keys of ``tensor_key``; ``offsets``: counter bases)."""
    for i, p in enumerate(params):
        adamw_step_(p, grads[i], exp_avgs[i], exp_avg_sqs[i], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, step=step, key=keys[i], offset=offsets[i])
