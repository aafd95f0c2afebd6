"""DTensor sharding rules for the titan ops.

Each rule tells DTensor which input placements let the op run on local shards with no
communication, and the placements of its outputs, for one mesh dimension (DTensor expands them to
the whole mesh). A placement not listed (e.g. a sharded hidden dim for rms_norm) makes DTensor
redistribute the inputs to a listed one, never compute a wrong answer.

Rules are registered on import of ``titan_kernels`` (when torch.distributed is available).
"""
from __future__ import annotations

import titan_kernels.ops.rms_norm  # noqa: F401  (defines the ops the rules below refer to)
import titan_kernels.ops.rotary  # noqa: F401
import titan_kernels.ops.fp8  # noqa: F401  (fp8_linear, fp8_grouped_mm)
import titan_kernels.ops.swiglu  # noqa: F401
import titan_kernels.ops.newton_schulz  # noqa: F401

import torch

if torch.distributed.is_available():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def _row_dims(x) -> range:
        # Every dim but the normalized (last) one may be sharded: batch, sequence, ...
        return range(len(x.shape) - 1)

    # ------------------------------------------------------------------------- rms_norm
    # Mirrors PyTorch's rules for aten._fused_rms_norm: rows shard freely, the hidden dim must be
    # whole on every rank, the weight is replicated and its gradient comes out Partial (a per-rank
    # sum over local rows, reduced later by whoever owns the parameter, e.g. FSDP or TP).

    @register_sharding(torch.ops.titan.rms_norm.default)
    def _rms_norm_sharding(x, weight, eps):
        w = Replicate() if weight is not None else None
        rules = [([Replicate(), Replicate()], [Replicate(), w, None])]
        for d in _row_dims(x):
            rules.append(([Shard(d), Shard(d)], [Shard(d), w, None]))
        return rules

    @register_sharding(torch.ops.titan.add_rms_norm.default)
    def _add_rms_norm_sharding(x, residual, weight, eps):
        w = Replicate() if weight is not None else None
        rules = [([Replicate()] * 3, [Replicate(), Replicate(), w, None])]
        for d in _row_dims(x):
            rules.append(([Shard(d)] * 3, [Shard(d), Shard(d), w, None]))
        return rules

    @register_sharding(torch.ops.titan.rms_norm_backward.default)
    def _rms_norm_backward_sharding(dy, x, weight, rstd, dresidual, compute_dweight, *backend):
        # backend: the forward's request, a string (or None) passed on positionally when given.
        w, flags = (Replicate() if weight is not None else None), [None] * (1 + len(backend))
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), w, Replicate(),
                                              Replicate() if dresidual is not None else None, *flags])]
        # With no weight, dweight is an empty placeholder: keep it Replicate (nothing to reduce).
        dw = Partial() if weight is not None else Replicate()
        for d in _row_dims(x):
            rules.append(([Shard(d), dw], [Shard(d), Shard(d), w, Shard(d),
                                           Shard(d) if dresidual is not None else None, *flags]))
        return rules


if torch.distributed.is_available():
    # ------------------------------------------------------------------------- rotary
    # Every head of every token is rotated on its own, by angles that depend only on the token's
    # position: q/k split on batch (dim 0) or heads (dim 2) run locally with cos/sin replicated and
    # 2-D position_ids split on batch like q. k may stay replicated while q is split on heads
    # (fewer kv heads than ranks). seq (dim 1) is local only with explicit position_ids split the
    # same way (without them each shard would count positions from 0). head_dim (dim 3) is never
    # split: a pair may straddle ranks, so DTensor gathers it first. The backward has the same
    # signature and the same rules. DTensor requires cos/sin (and position_ids) to be DTensors too
    # (e.g. Replicate), or the call to run under ``implicit_replication()``.

    @register_sharding([torch.ops.titan.rotary.default, torch.ops.titan.rotary_backward.default])
    def _rotary_sharding(q, k, cos, sin, position_ids, interleaved, *backend):
        # backend: the request (a string or None), when passed positionally; no placement.
        rep, flags = Replicate(), [None] * (1 + len(backend))
        pos = rep if position_ids is not None else None
        rules = [
            ([rep, rep], [rep, rep, rep, rep, pos, *flags]),
            ([Shard(2), Shard(2)], [Shard(2), Shard(2), rep, rep, pos, *flags]),
            ([Shard(2), rep], [Shard(2), rep, rep, rep, pos, *flags]),
        ]
        pos_batch = None if position_ids is None else (Shard(0) if position_ids.ndim == 2 else rep)
        rules.append(([Shard(0), Shard(0)], [Shard(0), Shard(0), rep, rep, pos_batch, *flags]))
        if position_ids is not None:
            pos_seq = Shard(position_ids.ndim - 1)
            rules.append(([Shard(1), Shard(1)], [Shard(1), Shard(1), rep, rep, pos_seq, *flags]))
        return rules


if torch.distributed.is_available():
    # ------------------------------------------------------------------------- swiglu
    # Elementwise: gate and up (and dy) split the same way on any dim run locally, the hidden dim
    # included (tensor parallel: w1/w3 colwise give Shard(-1) outputs), and the outputs keep that
    # placement. Partial inputs are not local (silu is not linear): DTensor reduces them first.
    # The clamped variant's scalars (alpha, limit, up_offset) change nothing: it is elementwise too.
    # rest: backend and the scalars, as many as the call passed (none of them a tensor).

    @register_sharding(torch.ops.titan.swiglu.default)
    def _swiglu_sharding(gate, up, *rest):
        flags = [None] * len(rest)
        rules = [([Replicate()], [Replicate(), Replicate(), *flags])]
        for d in range(len(gate.shape)):
            rules.append(([Shard(d)], [Shard(d), Shard(d), *flags]))
        return rules

    @register_sharding(torch.ops.titan.swiglu_backward.default)
    def _swiglu_backward_sharding(dy, gate, up, *rest):
        flags = [None] * len(rest)
        rules = [([Replicate(), Replicate()], [Replicate()] * 3 + flags)]
        for d in range(len(gate.shape)):
            rules.append(([Shard(d), Shard(d)], [Shard(d)] * 3 + flags))
        return rules


if torch.distributed.is_available():
    # ------------------------------------------------------------------------- fp8 (Float8Linear)
    # fp8_linear is y = x W^T with x (..., K) and W (N, K); it shards as a matmul: tokens (any dim
    # of x but the last) with W replicated, colwise (W split on N -> y split on its last dim) and
    # rowwise (x and W split on K -> y Partial). Each rank quantizes its own shards with their own
    # scales: exact dequantized math per shard, equal to the unsharded result to fp8 accuracy.
    # The backward: tokens -> dW Partial; colwise -> dx Partial, dW Shard(0); rowwise -> dx split
    # on K, dW Shard(1). A gradient that is not asked for is an empty (..., 0) / (N, 0) tensor,
    # for which the same placements are valid (the rules must not depend on the bool flags, which
    # DTensor leaves out of its sharding cache key). The rules hold for every recipe (the string
    # argument is not in the cache key either). fp8_quantize and fp8_gemm have no rules: their
    # tensorwise scale would need a collective, so DTensor refuses them instead.

    @register_sharding(torch.ops.titan.fp8_linear.default)
    def _fp8_linear_sharding(x, weight, recipe):
        rep, k = Replicate(), len(x.shape) - 1
        rules = [
            ([rep], [rep, rep, None]),
            ([Shard(k)], [rep, Shard(0), None]),
            ([Partial()], [Shard(k), Shard(1), None]),
        ]
        for d in range(k):
            rules.append(([Shard(d)], [Shard(d), rep, None]))
        return rules

    @register_sharding(torch.ops.titan.fp8_linear_backward.default)
    def _fp8_linear_backward_sharding(dy, x, weight, recipe, compute_dx, compute_dweight, backend=None):
        rep, k, flags = Replicate(), len(x.shape) - 1, [None, None, None, None]
        rules = [
            ([rep, rep], [rep, rep, rep, *flags]),
            ([Partial(), Shard(0)], [Shard(k), rep, Shard(0), *flags]),
            ([Shard(k), Shard(1)], [rep, Shard(k), Shard(1), *flags]),
        ]
        for d in range(k):
            rules.append(([Shard(d), Partial()], [Shard(d), Shard(d), rep, *flags]))
        return rules


import titan_kernels.ops.attention  # noqa: E402,F401  (defines the flash_attn ops)

if torch.distributed.is_available():
    # ------------------------------------------------------------------------- flash_attn
    # Attention mixes tokens of one sequence and is independent across batch entries and heads.
    # Dense q/k/v (batch, seq, heads, d) run locally split on batch (dim 0) or heads (dim 2; lse
    # (batch, heads, seq) on dim 1); varlen (total, heads, d) only on heads (dim 1; lse on dim 0),
    # with cu_seqlens replicated. Splitting heads keeps GQA groups whole when n_kv_heads divides
    # evenly (the local ratio is unchanged); with one KV head (MQA) k/v may stay replicated while q
    # is split, and then dk/dv come out Partial (each rank sums over its own query heads). A split
    # sequence is not local (every query needs every key): DTensor gathers it; context parallelism
    # (ring attention, which uses the LSE) is the layer that handles it without a gather.
    # The rules depend only on tensor arguments (DTensor leaves the scalars out of its cache key).

    @register_sharding(torch.ops.titan.flash_attn.default)
    def _flash_attn_sharding(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *scalars):
        # sinks (n_heads,) follow q's heads: Shard(0) when heads are split, else replicated.
        rep, flags = Replicate(), [None] * len(scalars)

        def sk(p):
            return p if sinks is not None else None

        if cu_seqlens_q is None:
            rules = [
                ([rep, rep], [rep, rep, rep, None, None, sk(rep), *flags]),
                ([Shard(0), Shard(0)], [Shard(0), Shard(0), Shard(0), None, None, sk(rep), *flags]),
                ([Shard(2), Shard(1)], [Shard(2), Shard(2), Shard(2), None, None, sk(Shard(0)), *flags]),
            ]
            if k.shape[2] == 1:
                rules.append(([Shard(2), Shard(1)], [Shard(2), rep, rep, None, None, sk(Shard(0)), *flags]))
            return rules
        return [
            ([rep, rep], [rep, rep, rep, rep, rep, sk(rep), *flags]),
            ([Shard(1), Shard(0)], [Shard(1), Shard(1), Shard(1), rep, rep, sk(Shard(0)), *flags]),
        ]

    @register_sharding(torch.ops.titan.flash_attn_backward.default)
    def _flash_attn_backward_sharding(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, sinks, *scalars):
        # dsinks sums over batch and rows: Partial when the batch is split, Shard(0) with the heads;
        # without sinks it is an empty tensor, replicated.
        rep, flags = Replicate(), [None] * len(scalars)

        def dl(p):
            return p if dlse is not None else None

        def sk(p):
            return p if sinks is not None else None

        def ds(p):
            return p if sinks is not None else rep

        if cu_seqlens_q is None:
            rules = [
                ([rep] * 4, [rep] * 6 + [dl(rep), None, None, sk(rep), *flags]),
                ([Shard(0)] * 3 + [ds(Partial())], [Shard(0)] * 6 + [dl(Shard(0)), None, None, sk(rep), *flags]),
                ([Shard(2)] * 3 + [ds(Shard(0))],
                 [Shard(2)] * 5 + [Shard(1), dl(Shard(1)), None, None, sk(Shard(0)), *flags]),
            ]
            if k.shape[2] == 1:
                rules.append(([Shard(2), Partial(), Partial(), ds(Shard(0))],
                              [Shard(2), Shard(2), rep, rep, Shard(2), Shard(1), dl(Shard(1)), None, None,
                               sk(Shard(0)), *flags]))
            return rules
        return [
            ([rep] * 4, [rep] * 6 + [dl(rep), rep, rep, sk(rep), *flags]),
            ([Shard(1)] * 3 + [ds(Shard(0))],
             [Shard(1)] * 5 + [Shard(0), dl(Shard(0)), rep, rep, sk(Shard(0)), *flags]),
        ]


import titan_kernels.ops.cross_entropy  # noqa: E402,F401  (defines the linear_cross_entropy ops)

if torch.distributed.is_available():
    # ------------------------------------------------------------------------- linear_cross_entropy
    # The vocabulary-parallel loss (weight Shard(0)) needs collectives between the softmax
    # statistics and the gradient, which a sharding rule cannot express: the public
    # ``titan_kernels.linear_cross_entropy`` handles DTensors itself and calls the op on local
    # shards with the group. These rules cover direct calls of the ops with DTensors: replicated
    # inputs run locally (anything else is made Replicate by DTensor, never computed wrong). The
    # rules depend only on tensor arguments (DTensor leaves the scalars out of its cache key).

    @register_sharding(torch.ops.titan.linear_cross_entropy.default)
    def _linear_cross_entropy_sharding(hidden, weight, labels, *scalars):
        rep = Replicate()
        return [([rep] * 4, [rep, rep, rep, *[None] * len(scalars)])]

    @register_sharding(torch.ops.titan.linear_cross_entropy_backward.default)
    def _linear_cross_entropy_backward_sharding(grad_loss, hidden, weight, labels, lse, *scalars):
        rep = Replicate()
        return [([rep, rep], [rep] * 5 + [None] * len(scalars))]


import titan_kernels.ops.grouped_mm  # noqa: E402,F401  (defines the grouped_mm ops)
import titan_kernels.ops.moe_permute  # noqa: E402,F401  (defines the MoE routing ops)

if torch.distributed.is_available():
    # ------------------------------------------------------------------------- grouped_mm, fp8_grouped_mm (MoE experts)
    # y[group e] = x[group e] @ w[e] is a matmul per group: tensor parallel on the experts runs locally.
    # Colwise (w1/w3: w split on N) -> y split on its last dim; rowwise (w2: x and w split on K) -> y
    # Partial; a Partial x (or w) with the other replicated -> y Partial (linear). The groups are rows
    # of x, so the offsets stay replicated; a split token dim would cut groups: DTensor gathers it.
    # Expert parallel (w split on E with each rank's own token groups) is not a placement of x: the
    # trainer's all-to-all hands each rank local tensors and calls the op on them.
    # Backward: colwise -> dx Partial, dw Shard(2); rowwise -> dx Shard(1), dw Shard(1). A gradient not
    # asked for is an empty (T, 0) / (E, K, 0) tensor, for which the same placements hold (the rules
    # must not depend on the bool flags, the recipe or the backend string, left out of DTensor's cache key).
    # The float8 op shards the same way, each rank scaling its own shards (fp8_linear's rule): colwise is
    # exact (every scale of the forward and of the weight gradient sees the whole K of its column;
    # dgrad's per-token scales are per N shard), rowwise takes per-K-shard scales for x and w, equal to
    # the unsharded result to float8 accuracy. A Partial input is not taken: quantizing each summand
    # with its own scale loses the sum's precision where summands cancel, so DTensor reduces it first.

    def _grouped_mm_rules(n_scalars: int, linear: bool) -> list:
        rep, flags = Replicate(), [None] * n_scalars
        rules = [
            ([rep], [rep, rep, rep, *flags]),
            ([Shard(1)], [rep, Shard(2), rep, *flags]),
            ([Partial()], [Shard(1), Shard(1), rep, *flags]),
        ]
        if linear:
            rules += [([Partial()], [Partial(), rep, rep, *flags]), ([Partial()], [rep, Partial(), rep, *flags])]
        return rules

    def _grouped_mm_backward_rules(n_scalars: int) -> list:
        rep, flags = Replicate(), [None] * n_scalars
        return [
            ([rep, rep], [rep, rep, rep, rep, *flags]),
            ([Partial(), Shard(2)], [Shard(1), rep, Shard(2), rep, *flags]),
            ([Shard(1), Shard(1)], [rep, Shard(1), Shard(1), rep, *flags]),
        ]

    @register_sharding(torch.ops.titan.grouped_mm.default)
    def _grouped_mm_sharding(x, w, offsets, *backend):
        return _grouped_mm_rules(len(backend), linear=True)

    @register_sharding(torch.ops.titan.grouped_mm_backward.default)
    def _grouped_mm_backward_sharding(dy, x, w, offsets, need_dx, need_dw, *backend):
        return _grouped_mm_backward_rules(2 + len(backend))

    @register_sharding(torch.ops.titan.fp8_grouped_mm.default)
    def _fp8_grouped_mm_sharding(x, w, offsets, recipe, *backend):
        return _grouped_mm_rules(1 + len(backend), linear=False)

    @register_sharding(torch.ops.titan.fp8_grouped_mm_backward.default)
    def _fp8_grouped_mm_backward_sharding(dy, x, w, offsets, recipe, need_dx, need_dw, *backend):
        return _grouped_mm_backward_rules(3 + len(backend))

    # ------------------------------------------------------------------------- moe_permute / moe_unpermute
    # Rows move whole: tokens split on the hidden dim (dim 1) permute and combine locally with the
    # routing indices (and scores) replicated. Both are linear in the moved rows: a Partial buffer
    # (after a rowwise w2) combines to a Partial result, reduced after the (smaller) combine, and the
    # Partial gradient of a colwise GEMM's input goes back through the permute still Partial.
    # The unpermute backward on split columns (or of a Partial buffer) gives each rank a share of the
    # scores' gradient: Partial.

    @register_sharding(torch.ops.titan.moe_permute.default)
    def _moe_permute_sharding(x, src, dst, *backend):
        rep, flags = Replicate(), [None] * len(backend)
        return [([rep], [rep, rep, rep, *flags]), ([Shard(1)], [Shard(1), rep, rep, *flags]),
                ([Partial()], [Partial(), rep, rep, *flags])]

    @register_sharding(torch.ops.titan.moe_permute_backward.default)
    def _moe_permute_backward_sharding(dxp, dst, *backend):
        rep, flags = Replicate(), [None] * len(backend)
        return [([rep], [rep, rep, *flags]), ([Shard(1)], [Shard(1), rep, *flags]),
                ([Partial()], [Partial(), rep, *flags])]

    @register_sharding(torch.ops.titan.moe_unpermute.default)
    def _moe_unpermute_sharding(yp, src, dst, scores, *backend):
        rep, flags = Replicate(), [None] * len(backend)
        s = rep if scores is not None else None
        return [
            ([rep], [rep, rep, rep, s, *flags]),
            ([Shard(1)], [Shard(1), rep, rep, s, *flags]),
            ([Partial()], [Partial(), rep, rep, s, *flags]),
        ]

    @register_sharding(torch.ops.titan.moe_unpermute_backward.default)
    def _moe_unpermute_backward_sharding(dout, yp, src, dst, scores, need_dscores, *backend):
        rep, flags = Replicate(), [None] + [None] * len(backend)
        s = rep if scores is not None else None
        return [
            ([rep, rep], [rep, rep, rep, rep, s, *flags]),
            ([Shard(1), Partial()], [Shard(1), Shard(1), rep, rep, s, *flags]),
            # A Partial buffer (the forward combined it unreduced): dyp = scores * dout needs only
            # dout, and <dout, sum of shares> is the sum of the per-rank dots: dscores Partial.
            ([rep, Partial()], [rep, Partial(), rep, rep, s, *flags]),
        ]


if torch.distributed.is_available():
    # ------------------------------------------------------------------------- newton_schulz
    # Each matrix of the batch is orthogonalised on its own: the leading (batch) dims, e.g. MoE
    # experts split by expert parallel, shard freely; the two matrix dims must be whole (a matrix
    # split there is all-gathered by DTensor; the distributed Muon gathers it on one rank instead).
    # fused_adamw_ needs no rule: it runs on the local shards of DTensor inputs (ops/fused_adamw.py).

    @register_sharding(torch.ops.titan.newton_schulz.default)
    def _newton_schulz_sharding(g, *scalars):
        rep, flags = Replicate(), [None] * len(scalars)
        return [([rep], [rep, *flags])] + [([Shard(d)], [Shard(d), *flags]) for d in range(len(g.shape) - 2)]
