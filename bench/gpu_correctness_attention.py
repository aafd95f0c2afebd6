"""flash_attn's part of bench/gpu_correctness.py (stage 3 of bench/run_gpu.sh): every attention
backend of the device against float64 math written out here.

  * causal on every backend, non-causal on the automatic choice, varlen (three documents) on the
    automatic choice;
  * the variants the model families use, on the automatic choice: varlen with a sliding window,
    sinks and soft-capping (GPT-OSS's layer, packed documents); multi-head latent attention's head
    dims (q/k 192, v 128: DeepSeek-V3) causal on every backend that takes them (the others are
    listed with the reason).
Each new mask or head-dim pair is another compile of the Triton kernels (default tiles here), so the
variants stay few: the CPU interpreter tests cover their combinations (tests/kernels/).
"""
from __future__ import annotations

from bench.gpu_checks import randn_as, tolerance, vjp


def attention_f64(q, k, v, causal, cu=None, window=(-1, -1), sinks=None, softcap=0.0):
    """Float64 attention: q (b, s, h, d) / k, v (b, s, h_kv, .), or packed (total, h, .) with cu.
    Mask per sequence, positions aligned bottom-right: p - left <= j <= p + right (causal: right 0);
    sinks: one more logit per head in each row's softmax, its probability dropped."""
    import torch

    group = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(group, -2), v.repeat_interleave(group, -2)
    scale = q.shape[-1] ** -0.5
    left, right = window[0], 0 if causal else window[1]

    def dense(q, k, v):  # (S, H, D)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        sq, sk = q.shape[0], k.shape[0]
        p = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if left >= 0:
            seen &= j >= p - left
        if right >= 0:
            seen &= j <= p + right
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, sq, 1)], -1)
            return torch.einsum("hqk,khd->qhd", s.softmax(-1)[..., :-1], v)
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    if cu is None:
        return torch.stack([dense(q[i], k[i], v[i]) for i in range(q.shape[0])])
    bounds = cu.tolist()
    return torch.cat([dense(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


def _compare(c, op, be, case, outs, inputs, want_fn, g, dtype):
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    out64 = want_fn(*x64)
    want = vjp(out64, x64, g.double())
    names = ("dq", "dk", "dv", "dsinks")
    for qn, got, ref in (("out", outs[0], out64), *zip(names, outs[1:], want)):
        c.add(op, be, case, qn, got, ref, tolerance(dtype))


def check_flash_attn(c, dev, S) -> None:
    import torch

    import titan_kernels as tk
    from titan_kernels.ops import attention as att

    (b, s, h, hkv, d), dtype = S.attn

    def qkv(*lead):
        return (randn_as(*lead, h, d, dtype=dtype, dev=dev).requires_grad_(),
                randn_as(*lead, hkv, d, dtype=dtype, dev=dev).requires_grad_(),
                randn_as(*lead, hkv, d, dtype=dtype, dev=dev).requires_grad_())

    # Causal (the training case) on every backend; non-causal on the automatic choice only (each mask
    # is another compile of our Triton kernels).
    for be in (*att.ATTENTION_BACKENDS, None):
        for causal in ((True,) if be is not None else (False,)):
            q, k, v = qkv(b, s)
            g = randn_as(b, s, h, d, dtype=dtype, dev=dev)
            case = f"b{b} s{s} h{h}/{hkv} d{d} {'causal' if causal else 'full'} {str(dtype)[6:]}"
            try:
                out = tk.flash_attn(q, k, v, causal=causal, backend=be)
                grads = vjp(out, (q, k, v), g)
                if be is None:
                    be = f"auto ({tk.attention_backend(q, k, v, causal=causal).backend})"
            except RuntimeError as e:  # this backend cannot take the case here (the reason says why)
                c.skip(f"flash_attn [{be}] {case}: {str(e).splitlines()[0][:160]}")
                continue
            _compare(c, "flash_attn", be, case, (out, *grads), (q, k, v),
                     lambda q, k, v: attention_f64(q, k, v, causal), g, dtype)

    # varlen: three documents packed in one sequence, on the automatic choice; plain causal, then
    # GPT-OSS's sliding layer (window 128, sinks) with Gemma's soft-capping.
    t_total = b * s
    cu = torch.tensor([0, t_total // 3, t_total // 3 + 1, t_total], dtype=torch.int32, device=dev)
    maxlen = int((cu[1:] - cu[:-1]).max())
    for window, with_sinks, softcap in (((-1, -1), False, 0.0), ((min(127, maxlen // 4), 0), True, 30.0)):
        q, k, v = qkv(t_total)
        sinks = torch.randn(h, device=dev, requires_grad=True) if with_sinks else None
        g = randn_as(t_total, h, d, dtype=dtype, dev=dev)
        kw = dict(window_size=window, sinks=sinks, softcap=softcap)
        out = tk.flash_attn_varlen(q, k, v, cu, cu, maxlen, maxlen, causal=True, **kw)
        inputs = (q, k, v) + ((sinks,) if with_sinks else ())
        label = tk.attention_backend(q, k, v, causal=True, cu_seqlens_q=cu, max_seqlen_q=maxlen, max_seqlen_k=maxlen,
                                     window_size=window, softcap=softcap).backend
        case = f"{t_total} tokens, 3 documents h{h}/{hkv} d{d} causal" + (
            f" window {window[0] + 1} sinks softcap {softcap:g}" if with_sinks else "")
        _compare(c, "flash_attn_varlen", str(label), case, (out, *vjp(out, inputs, g)), inputs,
                 lambda q, k, v, s=None: attention_f64(q, k, v, True, cu, window, s, softcap), g, dtype)

    # Multi-head latent attention's head dims (DeepSeek-V3: q/k 192, v 128), causal, every backend.
    d_qk, d_v = (192, 128) if dev.type == "cuda" else (24, 16)
    for be in (*att.ATTENTION_BACKENDS, None):
        q, k, v = (randn_as(b, s, h, x, dtype=dtype, dev=dev).requires_grad_() for x in (d_qk, d_qk, d_v))
        g = randn_as(b, s, h, d_v, dtype=dtype, dev=dev)
        case = f"b{b} s{s} h{h} d{d_qk}/{d_v} causal {str(dtype)[6:]}"
        try:
            out = tk.flash_attn(q, k, v, backend=be)
            grads = vjp(out, (q, k, v), g)
            if be is None:
                be = f"auto ({tk.attention_backend(q, k, v).backend})"
        except RuntimeError as e:
            c.skip(f"flash_attn [{be}] {case}: {str(e).splitlines()[0][:160]}")
            continue
        _compare(c, "flash_attn (MLA)", be, case, (out, *grads), (q, k, v),
                 lambda q, k, v: attention_f64(q, k, v, True), g, dtype)
