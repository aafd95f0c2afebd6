"""aten's CPU flash kernel as the ``sdpa_flash`` backend on CPU tensors:
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), a blocked online softmax with
its own LSE, GQA natively, float32 accumulation for half inputs. It keeps no (seq_q x seq_k) tensor
for the backward: it saves out and lse and recomputes the probabilities blockwise.

How the cases the kernel does not take directly are mapped onto it:
- Layout: our (b, s, h, d) tensors are passed as the (b, h, s, d) views aten expects (no copy, unless
  head_dim is strided: the kernel gives wrong values then, so that case is copied).
- Masks beyond full / causal (windows, chunks, and causal with seq_q != seq_k, since aten's
  ``is_causal`` is top-left aligned): the query-block plan of ``blocks.py``. Each piece (query rows
  with exactly the keys they can see) runs without a mask where every row sees every key, with
  ``is_causal`` on a diagonal square, else with the piece's additive mask; pieces of one geometry
  and mask (a window's interior blocks) run as one batched kernel call, on strided views of q, k
  and v (overlapping for the keys; no copy for a contiguous single sequence), since many small
  calls cost their threads' synchronization (severely on shared cores). Every row is in one piece
  with all its keys, so the pieces' outputs and LSEs are final (no merge); the backward
  runs the kernel's backward per piece and adds the key gradients of overlapping pieces. A window
  of w costs O(seq * (w + block)), skipped blocks cost nothing (bench/bench_attention_cpu.py: a
  window of 128 at seq 4096 against full causal). Rows that see no key are in no piece: out 0,
  lse -inf, no gradient.
- Varlen: one dense call per document (the kernel has no packed mode). The loop costs one host read
  of cu_seqlens per call, free on the CPU.
- v's head_dim different from q/k's (multi-head latent attention): the kernel refuses it ("Q/K/V
  should have the same head size"), so the narrower of q/k and v is zero-padded to the wider head_dim
  (no score changes; out = [out, 0], the extra columns dropped; the backward pads out and dout alike
  and drops the gradients' extra columns). That is the kernel's only way; bench/bench_attention_cpu.py
  measures it against the blockwise backend, which takes the head dims natively.
- A gradient for the LSE (ring attention): d lse_i / d S_ij = P_ij adds dlse_i * P_ij to dS_ij. The
  backward kernel takes no dlse, so it rides in one extra head_dim column: q' = [q, 0], k' = [k, 0],
  v' = [v, 1], out' = [out, 0], dout' = [dout, dlse]. The kernel's dP'_ij = dout_i.v_j + dlse_i and its
  delta_i = dout'_i.out'_i = dout_i.out_i, so dS = P (dP - delta + dlse): exactly the gradient with the
  LSE term; the scores are unchanged (the extra q/k column is 0, the scale is passed explicitly).
- Soft-capping: no aten kernel has it (``dispatch.why_not`` sends it to the blockwise backend).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops.attention.blocks import Piece, groups, piece_mask, plan

aten = torch.ops.aten
# torch's own binding skips the Python OpOverloadPacket of torch.ops.aten: 5 us of an 8 us small call.
_cpu_flash = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu",
                     aten._scaled_dot_product_flash_attention_for_cpu)
_cpu_flash_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    # (b, s, h, d) <-> (b, h, s, d), a view. head_dim must have unit stride: aten's CPU flash kernel
    # silently returns wrong values for a strided head_dim (seen on torch 2.13), so such inputs are copied.
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _pad_to(t: torch.Tensor, d: int) -> torch.Tensor:
    # One head_dim for q, k and v: zero columns change no score (q.k) and give out = [out, 0].
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _pad_col(t: torch.Tensor, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return torch.cat([t, value.to(t.dtype).unsqueeze(-1)], -1)
    return F.pad(t, (0, 1), value=value)


def _block_rows(a: AttentionArgs) -> int:
    """Query rows per piece: about half the window's span (measured best at a window of 128: 64 rows,
    bench/bench_attention_cpu.py), within [64, 512]; 512 without a bounded span."""
    if a.left >= 0 and a.right >= 0:
        span = a.left + a.right + 1
    elif a.chunk > 0:
        span = a.chunk
    else:
        return 512
    b = 64
    while b < 512 and 2 * b < span:
        b *= 2
    return b


def _plain(q, k, a: AttentionArgs) -> bool:
    """The kernel takes the call as is: full, or causal with seq_q == seq_k."""
    return not a.local and (a.right < 0 or q.shape[1] == k.shape[1])


def _index(pcs: list[Piece], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows, keys) of a group of pieces of one geometry, as flat index tensors (n*R,), (n*K,)."""
    r, kk = pcs[0].r1 - pcs[0].r0, pcs[0].k1 - pcs[0].k0
    r0 = torch.tensor([p.r0 for p in pcs], device=device)
    k0 = torch.tensor([p.k0 for p in pcs], device=device)
    return ((r0[:, None] + torch.arange(r, device=device)).flatten(),
            (k0[:, None] + torch.arange(kk, device=device)).flatten())


def _stride(starts: list[int]) -> int | None:
    """The constant step between the pieces' starts, or None."""
    if len(starts) == 1:
        return 0
    step = starts[1] - starts[0]
    return step if all(y - x == step for x, y in zip(starts, starts[1:])) else None


def _stack(t: torch.Tensor, idx: torch.Tensor, n: int, start: int = 0, step: int | None = None) -> torch.Tensor:
    """(b, s, heads, x) rows ``idx`` (n blocks) -> (b * n, heads, rows per block, x), aten's layout.
    Blocks at a constant ``step`` from ``start`` of a contiguous single-sequence tensor are a strided
    view (overlapping for a window's keys): no copy; else the rows are gathered."""
    b, _, hh, x = t.shape
    rows = idx.numel() // n
    if b == 1 and step is not None and t.is_contiguous():
        st = t.stride()
        return t.as_strided((n, hh, rows, x), (step * st[1], st[2], st[1], 1), t.storage_offset() + start * st[1])
    return t.index_select(1, idx).view(b, n, -1, hh, x).transpose(2, 3).reshape(b * n, hh, -1, x)


def _unstack(t: torch.Tensor, b: int) -> torch.Tensor:
    """(b * n, heads, rows, x) -> (b, n * rows, heads, x): the inverse of ``_stack``."""
    bn, hh, r, x = t.shape
    return t.view(b, bn // b, hh, r, x).transpose(2, 3).reshape(b, -1, hh, x)


def _lse_stack(lse: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    b, hh, _ = lse.shape
    return lse.index_select(2, idx).view(b, hh, n, -1).transpose(1, 2).reshape(b * n, hh, -1)


def _lse_unstack(l: torch.Tensor, b: int) -> torch.Tensor:
    bn, hh, r = l.shape
    return l.view(b, bn // b, hh, r).transpose(1, 2).reshape(b, hh, -1)


def _dense_fwd(q, k, v, a: AttentionArgs):
    qs, dv = q.shape, v.shape[-1]  # (read once: a tensor's shape costs as much as a small op's arithmetic)
    if dv != qs[-1]:  # multi-head latent attention (q/k 192, v 128): the kernel's only way is padding
        d = max(dv, qs[-1])
        out, lse = _dense_fwd(_pad_to(q, d), _pad_to(k, d), _pad_to(v, d), a)
        return out[..., :dv], lse
    if not a.local and (a.right < 0 or qs[1] == k.shape[1]):  # _plain, inline: every call
        return _plain_fwd(q, k, v, a)
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    pieces = plan(sq, sk, a, _block_rows(a))
    # Every row is in one piece but the leading rows that see no key (out 0, lse -inf).
    first = pieces[0].r0 if pieces else sq
    out = q.new_empty((b, sq, h, dv))
    out[:, :first] = 0
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    lse[:, :, :first] = float("-inf")
    # One kernel call per group of pieces of one geometry (a window's interior blocks batched: many
    # small calls cost their threads' synchronization, badly on shared cores).
    for pcs in groups(pieces, sq, sk, a):
        pc, n = pcs[0], len(pcs)
        mask = piece_mask(pc, sq, sk, a, q.dtype, q.device) if pc.mode == "mask" else None
        rows, keys = _index(pcs, q.device)
        rstep, kstep = _stride([p.r0 for p in pcs]), _stride([p.k0 for p in pcs])
        o, l = _cpu_flash(_stack(q, rows, n, pc.r0, rstep), _stack(k, keys, n, pc.k0, kstep),
                          _stack(v, keys, n, pc.k0, kstep), 0.0, pc.mode == "causal", attn_mask=mask, scale=a.scale)
        out.index_copy_(1, rows, _unstack(o, b))
        lse.index_copy_(2, rows, _lse_unstack(l, b))
    return out, lse


def _piece_bwd(dout, q, k, v, out, lse, dlse, causal: bool, mask, scale: float):
    """The kernel's backward on (b, h, s, d) tensors, with an LSE gradient in an extra column."""
    d = q.shape[-1]
    if dlse is not None:
        q, k, out, v = _pad_col(q, 0.0), _pad_col(k, 0.0), _pad_col(out, 0.0), _pad_col(v, 1.0)
        dout = _pad_col(dout, dlse)
    dq, dk, dv = _cpu_flash_bwd(dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=mask, scale=scale)
    if dlse is not None:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    return dq, dk, dv


def _dense_bwd(dout, q, k, v, out, lse, dlse, a: AttentionArgs):
    b, sq, h, d = q.shape
    dv = v.shape[-1]
    if dv != d:  # padded as in the forward (out and dout too); the gradients' extra columns dropped
        p = max(d, dv)
        dq, dk, dv_ = _dense_bwd(_pad_to(dout, p), _pad_to(q, p), _pad_to(k, p), _pad_to(v, p), _pad_to(out, p),
                                 lse, dlse, a)
        return dq[..., :d], dk[..., :d], dv_[..., :dv]
    if _plain(q, k, a):
        g = _piece_bwd(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, dlse, a.causal, None, a.scale)
        return tuple(t.transpose(1, 2) for t in g)
    sk = k.shape[1]
    pieces = plan(sq, sk, a, _block_rows(a))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq[:, :pieces[0].r0 if pieces else sq] = 0  # the leading rows that see no key
    # Overlapping pieces add into the key gradients: float32 accumulators for half inputs.
    acc = torch.promote_types(k.dtype, torch.float32)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dvv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for pcs in groups(pieces, sq, sk, a):
        pc, n = pcs[0], len(pcs)
        mask = piece_mask(pc, sq, sk, a, q.dtype, q.device) if pc.mode == "mask" else None
        rows, keys = _index(pcs, q.device)
        rstep, kstep = _stride([p.r0 for p in pcs]), _stride([p.k0 for p in pcs])
        g = _piece_bwd(_stack(dout, rows, n, pc.r0, rstep), _stack(q, rows, n, pc.r0, rstep),
                       _stack(k, keys, n, pc.k0, kstep), _stack(v, keys, n, pc.k0, kstep),
                       _stack(out, rows, n, pc.r0, rstep), _lse_stack(lse, rows, n),
                       None if dlse is None else _lse_stack(dlse, rows, n), pc.mode == "causal", mask, a.scale)
        dq.index_copy_(1, rows, _unstack(g[0], b).to(dq.dtype))
        dk.index_add_(1, keys, _unstack(g[1], b).to(acc))
        dvv.index_add_(1, keys, _unstack(g[2], b).to(acc))
    return dq, dk.to(k.dtype), dvv.to(v.dtype)


def _per_document(q, k, v, cu_q, cu_k, a):
    """Varlen forward as one dense call per document: out (total_q, h, dv), lse (h, total_q)."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if q1 > q0 and k1 > k0:
            o, l = _dense_fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], a)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _per_document_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a):
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if q1 > q0 and k1 > k0:
            g = _dense_bwd(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                           lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1], a)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _plain_fwd(q, k, v, a: AttentionArgs):
    """A dense call the kernel takes as is (``_plain``, equal head dims), on (b, h, s, d) views."""
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and q.shape[-1] > 1:
        # (a contiguous tensor's head_dim has unit stride, but where it is 1: is_contiguous ignores it)
        o, lse = _cpu_flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, a.causal, scale=a.scale)
        return o.transpose(1, 2), lse
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if qt.stride(-1) != 1 or kt.stride(-1) != 1 or vt.stride(-1) != 1:  # see _bhsd
        qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
    o, lse = _cpu_flash(qt, kt, vt, 0.0, a.causal, scale=a.scale)
    return o.transpose(1, 2), lse


def cpu_flash_fwd(q, k, v, cu_q, cu_k, a: AttentionArgs):
    """aten's CPU flash kernel: dense or varlen (per document), with its own LSE."""
    if cu_q is None:
        qs = q.shape
        if not a.local and (a.right < 0 or qs[1] == k.shape[1]) and v.shape[-1] == qs[-1]:  # the common call
            if q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and qs[-1] > 1:  # _plain_fwd, inline
                o, lse = _cpu_flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, a.causal,
                                    scale=a.scale)
                return o.transpose(1, 2), lse
            return _plain_fwd(q, k, v, a)
        return _dense_fwd(q, k, v, a)
    return _per_document(q, k, v, cu_q, cu_k, a)


def cpu_flash_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a: AttentionArgs):
    """aten's CPU flash backward kernel (dlse folded in, see the module docstring)."""
    if cu_q is None:
        return _dense_bwd(dout, q, k, v, out, lse, dlse, a)
    return _per_document_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, a)
