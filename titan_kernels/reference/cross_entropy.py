"""Linear + cross-entropy in plain PyTorch, chunk by chunk over tokens, float32 math.

Math, per token i with hidden state h_i (D,), label y_i and the output weight W (V, D):

    z_i = W h_i                      the logits (held for one chunk of tokens at a time, never all)
    lse_i = log sum_v exp(z_iv)      computed as m_i + log sum_v exp(z_iv - m_i), m_i = max_v z_iv
    loss_i = lse_i - z_{i, y_i}      (0 for a token whose label is ignore_index)
    g_i = d loss_i / d z_i = softmax(z_i) - onehot(y_i)
    d loss_i / d h_i = g_i W,        d loss / d W = sum_i g_i^T h_i

(softmax cross-entropy and its gradient, Goodfellow et al., "Deep Learning", 2016, sec. 6.2.2.3;
the chunked, fused forward + gradient scheme as in Liger-Kernel's fused linear cross-entropy and
Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models").

For "mean" and "sum" the gradient is known in the forward up to the scalar grad_output, so
``linear_cross_entropy_fwd`` computes the loss and both gradients in one pass over the chunks: per
chunk one logits GEMM, the softmax statistics, g in place of the logits, then ``dh_chunk = g W``
and ``dW += g^T h_chunk`` (float32 accumulator). Three GEMMs in all, the same as the unfused
forward + backward, while the largest buffer is one chunk of logits. For "none" (a gradient per
token that only the backward knows) the forward computes the losses and the log-sum-exp, and
``linear_cross_entropy_bwd`` recomputes each chunk's logits from them (four GEMMs in all).

Vocabulary-parallel (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019): with the
rows of W split over a process group, each rank's chunk holds the logits of its vocabulary slice
``[vocab_start, vocab_start + V_local)``. Per chunk the local max is all-reduced (MAX), then the
local sum-exp rescaled to the global max and the local target logit (0 where the label is not in
the slice) are all-reduced (SUM), both token-sized: the logits never leave the rank. The returned
dhidden is this rank's part of the sum over the vocabulary (the caller reduces it); dweight is
exactly this rank's rows.

The two elementwise passes over a chunk (softmax statistics; the gradient g) are ``kernels``:
``TORCH_KERNELS`` here, Triton kernels in ``titan_kernels.triton.cross_entropy``; the GEMMs are
aten's. Outputs: loss float32; lse (N,) float32; dhidden in hidden.dtype; dweight in weight.dtype,
accumulated in float32.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# Bytes of float32 logits per chunk, and the fewest rows a chunk has whatever the vocabulary. The
# weight-gradient GEMM of a chunk (dW += g^T h) reads and writes all of dW for 2 * rows FLOPs per
# element, so below a few hundred rows it is bound by memory, not by the FLOPs. Measured on our
# 2-core CPU (shared), forward+backward at (2048, 256, 32000) fp32: 4.5 s with 4 MiB chunks (32 rows),
# 2.8 s with 16 MiB, 2.1 s with 32 MiB (256 rows), 3.4 s with 64 MiB; unfused eager 3.7 s. CUDA:
# >= 512 rows at vocab 128k, where cuBLAS runs near its peak (Liger sizes its chunks about the same).
CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}
MIN_CHUNK_ROWS = {"cpu": 256, "cuda": 512}
_DEFAULT_CHUNK_BYTES = 64 << 20


def chunk_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Tokens per chunk: as many as fit ``CHUNK_BYTES`` of float32 logits of width ``n_cols`` but at
    least ``MIN_CHUNK_ROWS`` (multiples of 16 when large), at most ``n_rows``, at least 1."""
    budget = CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
    rows = max(1, budget // (4 * max(n_cols, 1)), MIN_CHUNK_ROWS.get(device.type, 1))
    if rows >= 64:
        rows -= rows % 16  # GEMM-friendly row counts
    return max(1, min(rows, n_rows))


# ----------------------------------------------------------------------------- elementwise passes


def softmax_stats_(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (C, V) float32: the max m, sum(exp(z - m)) and the logit at ``target``
    (C,) int64, a column index or -1 (then 0). With V = 0: m = -inf, sum 0 (a rank with no rows).

    Overwrites ``logits`` with exp(z - m), which ``softmax_grad_after_stats_`` turns into the
    gradient: one exp per logit and no temporary (measured 32% faster than recomputing the exp)."""
    c, v = logits.shape
    if v == 0:
        return (logits.new_full((c,), float("-inf")), logits.new_zeros((c,)), logits.new_zeros((c,)))
    has = target >= 0
    t = logits.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
    t = torch.where(has, t, torch.zeros_like(t))
    m = logits.amax(1)
    sumexp = logits.sub_(m[:, None]).exp_().sum(1)
    return m, sumexp, t


def _onehot_sub_(g: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor) -> None:
    if g.shape[1]:
        has = (target >= 0).to(g.dtype)
        g.scatter_add_(1, target.clamp_min(0)[:, None], (-has * row_scale)[:, None])


def softmax_grad_after_stats_(
    exp_logits: torch.Tensor, m: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """g = (softmax(z) - onehot(target)) * row_scale from ``softmax_stats_``'s exp(z - m), in place:
    softmax = exp(z - m) * exp(m - lse) (lse global under a vocabulary split, m this rank's max)."""
    g = exp_logits.mul_((row_scale * torch.exp(m - lse))[:, None])
    _onehot_sub_(g, target, row_scale)
    return g if out_dtype == g.dtype else g.to(out_dtype)


def softmax_grad_(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """g = (softmax(z) - onehot(target)) * row_scale per row, computed in place of ``logits`` (C, V)
    float32 (lse (C,) float32; target (C,) a column or -1 for none; row_scale (C,) float32, 0 for a
    row without a loss). Returns g in ``out_dtype`` (``logits`` itself when float32)."""
    g = logits.sub_(lse[:, None]).exp_().mul_(row_scale[:, None])
    _onehot_sub_(g, target, row_scale)
    return g if out_dtype == g.dtype else g.to(out_dtype)


class Kernels(NamedTuple):
    """The elementwise passes of the chunk loop (signatures as the torch functions above). ``stats``
    may leave anything in the logits buffer that its ``grad_after_stats`` understands; ``grad``
    starts from plain logits (the recomputing backward)."""

    stats: object
    grad_after_stats: object
    grad: object


TORCH_KERNELS = Kernels(softmax_stats_, softmax_grad_after_stats_, softmax_grad_)


# ----------------------------------------------------------------------------- GEMMs


@functools.lru_cache(maxsize=None)
def fp32_output_gemms(device_type: str, dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether aten's bf16/fp16 GEMMs with a float32 output run and agree with float32 math here:
    (``mm.dtype``, ``addmm.dtype_out`` accumulating in place into its float32 input). CUDA with
    torch >= 2.8 has both. Decided once per (device type, dtype), on a tiny problem."""
    if device_type != "cuda":
        return False, False
    a = torch.randn(8, 16, device=device_type).to(dtype)
    b = torch.randn(16, 8, device=device_type).to(dtype)
    want = a.float() @ b.float()
    try:
        mm_ok = bool(torch.allclose(torch.ops.aten.mm.dtype(a, b.t().contiguous().t(), torch.float32), want, atol=1e-3))
    except (RuntimeError, AttributeError, TypeError):
        return False, False
    try:
        acc = torch.ones(8, 8, device=device_type)
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
        addmm_ok = bool(torch.allclose(acc, want + 1, atol=1e-3))
    except (RuntimeError, AttributeError, TypeError):
        addmm_ok = False
    return mm_ok, addmm_ok


# Vocabulary rows per block when dW += g^T h has no in-place float32-output GEMM (a float32
# (rows, D) temporary per block instead of one of the whole weight).
_DW_BLOCK_ROWS = 8192


class _Gemms:
    """The three products of a chunk, with float32 logits and a float32 dweight accumulator for
    any input dtype. float32 inputs: plain aten GEMMs. bf16/fp16 on CUDA: tensor-core GEMMs with
    float32 output (g is rounded to the input dtype for the two gradient products, as in an unfused
    bf16 backward). Elsewhere (CPU) the weight is converted to float32 once per call."""

    def __init__(self, weight: torch.Tensor) -> None:
        mm_ok, self.addmm_ok = (True, True) if weight.dtype == torch.float32 else fp32_output_gemms(
            weight.device.type, weight.dtype)
        self.native = mm_ok
        self.w = weight if self.native else weight.float()
        self.g_dtype = weight.dtype if self.native else torch.float32

    def _h(self, h: torch.Tensor) -> torch.Tensor:
        return h if (self.native or h.dtype == torch.float32) else h.float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self._h(h)
        if h.dtype == torch.float32:
            return torch.mm(h, self.w.t())
        return torch.ops.aten.mm.dtype(h, self.w.t(), torch.float32)

    def dhidden(self, g: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype == g.dtype:
            torch.mm(g, self.w, out=out)
        else:
            out.copy_(torch.mm(g, self.w))

    def dweight_acc(self, acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
        h = self._h(h)
        if g.dtype == torch.float32:
            acc.addmm_(g.t(), h)
        elif self.addmm_ok:
            torch.ops.aten.addmm.dtype_out(acc, g.t(), h, torch.float32, out=acc)
        else:
            for v in range(0, acc.shape[0], _DW_BLOCK_ROWS):
                acc[v:v + _DW_BLOCK_ROWS].add_(torch.ops.aten.mm.dtype(g[:, v:v + _DW_BLOCK_ROWS].t(), h, torch.float32))


# ----------------------------------------------------------------------------- labels


def check_labels(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor | None:
    """Labels must be ``ignore_index`` or in [0, vocab_size).

    On the CPU a bad label raises ValueError (naming the first one) before any GEMM runs. On other
    devices that check would stop the host until the device catches up, so it is not made there:
    the returned mask marks the bad tokens, whose loss becomes NaN (which the trainer's
    non-finite check catches). Returns None when nothing is to be marked.
    """
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.device.type != "cpu":
        return bad
    if labels.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels: expected values in [0, {vocab_size}) (the vocabulary) or ignore_index={ignore_index}, "
            f"got {int(labels[i])} at index {i}"
        )
    return None


# ----------------------------------------------------------------------------- vocab-parallel


def _combine_over_group(m, sumexp, t, group: str):
    """Global max, sum-exp (relative to it) and target logit from every rank's vocabulary slice."""
    import torch.distributed._functional_collectives as funcol

    m_all = funcol.wait_tensor(funcol.all_reduce(m, "max", group))
    # exp(-inf - m_all) = 0 on a rank with no vocabulary rows.
    both = torch.stack([sumexp * torch.exp(m - m_all), t])
    both = funcol.wait_tensor(funcol.all_reduce(both, "sum", group))
    return m_all, both[0], both[1]


# ----------------------------------------------------------------------------- forward / backward


def _targets(labels, ignore_index, vocab_start, v_local):
    """(valid tokens, target column in this rank's slice or -1)."""
    valid = labels != ignore_index
    col = labels - vocab_start
    local = valid & (col >= 0) & (col < v_local)
    return valid, torch.where(local, col, torch.full_like(col, -1))


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    compute_dhidden: bool,
    compute_dweight: bool,
    vocab_start: int = 0,
    vocab_size: int = -1,
    group: str | None = None,
    kernels: Kernels = TORCH_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, log-sum-exp and (for "mean"/"sum", when asked) the gradients, in one chunked pass.

    hidden (N, D) and weight (V_local, D) float32/bf16/fp16 of one dtype; labels (N,) int64.
    ``vocab_start``/``vocab_size``: this rank's first vocabulary row and the whole vocabulary
    (-1: V_local, no group); ``group``: the process group name of the vocabulary split, or None.

    Returns (loss, lse, dhidden, dweight): loss float32, () for "mean" (over non-ignored tokens;
    NaN when there is none, as ``F.cross_entropy``) and "sum", (N,) for "none" (0 at ignored
    tokens); lse (N,) float32; dhidden (N, D) in hidden.dtype and dweight (V_local, D) in
    weight.dtype, the gradients of the returned loss (for grad_output 1), or empty (0,) tensors
    when not asked for or when reduction is "none".
    """
    n, d = hidden.shape
    v_local = weight.shape[0]
    vocab_size = v_local if vocab_size < 0 else vocab_size
    bad = check_labels(labels, ignore_index, vocab_size)
    valid, target = _targets(labels, ignore_index, vocab_start, v_local)
    fused = reduction != "none"
    want_dh, want_dw = fused and compute_dhidden, fused and compute_dweight
    gemm = _Gemms(weight)
    rows = chunk_rows(n, v_local, hidden.device)
    loss = hidden.new_empty((n,), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    dh = hidden.new_empty((n, d)) if want_dh else None
    dw = hidden.new_zeros((v_local, d), dtype=torch.float32) if want_dw else None
    row_scale = valid.to(torch.float32)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        h = hidden[s:e]
        z = gemm.logits(h)
        m_local, sumexp, t = kernels.stats(z, target[s:e])
        m = m_local
        if group is not None:
            m, sumexp, t = _combine_over_group(m_local, sumexp, t, group)
        lse_c = m + torch.log(sumexp)
        lse[s:e] = lse_c
        loss[s:e] = torch.where(valid[s:e], lse_c - t, torch.zeros_like(t))
        if want_dh or want_dw:
            g = kernels.grad_after_stats(z, m_local, lse_c, target[s:e], row_scale[s:e], gemm.g_dtype)
            if dh is not None:
                gemm.dhidden(g, dh[s:e])
            if dw is not None:
                gemm.dweight_acc(dw, g, h)
    if bad is not None:
        loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    if reduction == "none":
        return loss, lse, _empty(hidden), _empty(weight)
    total = loss.sum()
    n_valid = valid.sum().to(torch.float32)
    if reduction == "mean":
        # The gradients of the mean: 1 / max(n, 1), so that no token gives zero gradients, not NaN.
        scale = 1.0 / n_valid.clamp_min(1.0)
        total = total / n_valid
        if dh is not None:
            dh.mul_(scale.to(dh.dtype))
        if dw is not None:
            dw.mul_(scale)
    dh = dh if dh is not None else _empty(hidden)
    dw = dw.to(weight.dtype) if dw is not None else _empty(weight)
    return total, lse, dh, dw


def linear_cross_entropy_bwd(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    compute_dhidden: bool,
    compute_dweight: bool,
    vocab_start: int = 0,
    kernels: Kernels = TORCH_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients from the forward's log-sum-exp, recomputing each chunk's logits (the backward of
    "none"; also of "mean"/"sum" when the forward did not compute them).

    grad_loss: () for "mean"/"sum", (N,) for "none"; lse (N,) float32 from the forward (global
    under a vocabulary split, so no communication is needed here). Returns (dhidden (N, D) in
    hidden.dtype, dweight (V_local, D) in weight.dtype), each an empty (0,) tensor when not asked.
    """
    n, d = hidden.shape
    v_local = weight.shape[0]
    valid, target = _targets(labels, ignore_index, vocab_start, v_local)
    row_scale = valid.to(torch.float32) * grad_loss.to(torch.float32)
    if reduction == "mean":
        row_scale = row_scale / valid.sum().to(torch.float32).clamp_min(1.0)
    gemm = _Gemms(weight)
    rows = chunk_rows(n, v_local, hidden.device)
    dh = hidden.new_empty((n, d)) if compute_dhidden else None
    dw = hidden.new_zeros((v_local, d), dtype=torch.float32) if compute_dweight else None
    if dh is not None or dw is not None:
        for s in range(0, n, rows):
            e = min(n, s + rows)
            h = hidden[s:e]
            g = kernels.grad(gemm.logits(h), lse[s:e], target[s:e], row_scale[s:e], gemm.g_dtype)
            if dh is not None:
                gemm.dhidden(g, dh[s:e])
            if dw is not None:
                gemm.dweight_acc(dw, g, h)
    return (dh if dh is not None else _empty(hidden),
            dw.to(weight.dtype) if dw is not None else _empty(weight))
