"""Fused linear + cross-entropy: ``torch.ops.titan.linear_cross_entropy`` and its backward
``torch.ops.titan.linear_cross_entropy_backward``; ``linear_cross_entropy`` is the public function.

``loss = cross_entropy(hidden @ weight.T, labels)`` without ever holding the (N, V) logits: the
tokens are processed in chunks whose float32 logits take a few MiB (CPU) or a few hundred MiB
(CUDA), and for "mean"/"sum" the gradients of hidden and weight are computed in the same pass as
the loss (three GEMMs in all, as unfused). The algorithm, its math and the vocabulary-parallel
reduction are in ``titan_kernels.reference.cross_entropy``; the backends differ in the two
elementwise passes over a chunk (softmax statistics, the gradient): ``reference`` (aten ops; the
CPU's choice) and ``triton`` (two Triton kernels; the CUDA choice). The GEMMs are aten's in both.
No native CPU backend, because it cannot pay enough: on our 2-core CPU (shared; OpenMP waiting
passively, as the trainer runs) the time outside the three GEMMs is 14% of forward+backward at
(4096, 256, 32000) fp32 and 24% at the debug model's (2048, 256, 258), so a fused C++ pass, which
could save at most part of that, would gain under ~10% of this op and under 1% of a training step.
Against the unfused eager loss, forward+backward takes 0.93x its time at (4096, 256, 32000), 0.60x
at (1024, 128, 4096) and 1.10x at (2048, 256, 258) (paired, medians;
``python -m bench.bench_cross_entropy --paired N D V``).

The op returns (loss, lse, dhidden, dweight). lse is the per-token log-sum-exp (float32); dhidden
and dweight are the gradients of the loss for grad_output = 1 (empty when not asked for, and for
reduction "none", whose backward recomputes the logits chunk by chunk from lse). These three are
auxiliary outputs without a gradient of their own. The backward scales the saved gradients by
grad_output; double backward raises a RuntimeError naming the op (the saved gradients are not
themselves differentiated).

Tensor parallel: with ``weight`` a DTensor split on the vocabulary (``Shard(0)``, as the output
projection under ``ColwiseParallel``), ``linear_cross_entropy`` runs the vocabulary-parallel loss:
each rank computes the logits of its own vocabulary rows for all tokens, and only token-sized
statistics (max, sum-exp, target logit) are all-reduced inside the op; hidden is all-gathered
(never the logits) and its gradient reduced back to hidden's own placement.

Built by the op scaffold (``titan_kernels.ops._scaffold``): the custom ops with their fakes, one
autograd definition for the op path and the eager fast path, the forward's request handed to the
backward, and the sharding rules of direct op calls below.
"""
from __future__ import annotations

import functools

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops._common import check_float, check_same_device, check_tensor
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import cross_entropy as _ref

OP = "linear_cross_entropy"
cross_entropy_def = Op(OP)
REDUCTIONS = ("mean", "sum", "none")
_DOUBLE_BACKWARD = (
    "titan::linear_cross_entropy: double backward (differentiating its gradients, e.g. "
    "create_graph=True followed by another backward) is not supported"
)

# Every implementation: the chunked loop of ``reference.cross_entropy`` (fwd, bwd) with its own
# elementwise passes; the reference's are aten ops.
cross_entropy_def.register("reference", (_ref.linear_cross_entropy_fwd, _ref.linear_cross_entropy_bwd))


def _register_triton() -> None:
    # Without triton the family is unavailable and says why (backend_status).
    module = "titan_kernels.triton.cross_entropy"  # imported at the first call (LazyKernel)
    stats, grad_ = _backend.LazyKernel(module, "softmax_stats"), _backend.LazyKernel(module, "softmax_grad_")
    # The Triton statistics pass leaves the logits as they are: the gradient pass reads them again.
    passes = _ref.Kernels(stats, lambda z, m, lse, *rest: grad_(z, lse, *rest), grad_)
    cross_entropy_def.register("triton", (functools.partial(_ref.linear_cross_entropy_fwd, kernels=passes),
                                          functools.partial(_ref.linear_cross_entropy_bwd, kernels=passes)))


_register_triton()


# ----------------------------------------------------------------------------- validation


def _validate(hidden, weight, labels, ignore_index, reduction) -> None:
    check_float(hidden, "hidden")
    check_float(weight, "weight")
    check_tensor(labels, "labels")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected shape (N, D) (or (..., D)), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape (V, {hidden.shape[-1]}) (vocabulary x the last dim of hidden), "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (the dtype of hidden), got {weight.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels: expected dtype int64, got {str(labels.dtype).replace('torch.', '')}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (the leading dims of hidden), got {tuple(labels.shape)}"
        )
    check_same_device({"hidden": hidden, "weight": weight, "labels": labels})
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")


# ----------------------------------------------------------------------------- the ops


def forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str,
    compute_dhidden: bool, compute_dweight: bool, vocab_start: int, vocab_size: int, group: str | None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy of the logits ``hidden @ weight.T`` against ``labels``, chunk by chunk.

    hidden (N, D) and weight (V_local, D), one float dtype; labels (N,) int64, values in
    [0, vocab_size) or ``ignore_index``. ``vocab_start``/``vocab_size``: the first vocabulary row
    this rank holds and the whole vocabulary (-1: V_local, unsplit); ``group``: the process group
    name of the vocabulary split or None. ``compute_dhidden``/``compute_dweight``: compute the
    gradients in this pass ("mean"/"sum" only). ``backend``: the request (None: the one in force).

    Returns (loss, lse, dhidden, dweight): loss float32, () or (N,) for "none"; lse (N,) float32;
    dhidden (N, D) in hidden.dtype and dweight (V_local, D) in weight.dtype (float32-accumulated),
    or empty (0,) tensors. Under a split, dhidden is this rank's part of the vocabulary sum.
    Raises ValueError for a label out of range (CPU; elsewhere that token's loss is NaN).
    """
    return cross_entropy_def.kernels(hidden.device, backend).forward(
        hidden, weight, labels, ignore_index, reduction, compute_dhidden, compute_dweight, vocab_start, vocab_size,
        group,
    )


def _fused(reduction: str, flag: bool) -> bool:
    return flag and reduction != "none"


def _fake(hidden, weight, labels, ignore_index, reduction, compute_dhidden, compute_dweight, vocab_start, vocab_size,
          group, backend=None):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    dh = hidden.new_empty(tuple(hidden.shape) if _fused(reduction, compute_dhidden) else (0,))
    dw = weight.new_empty(tuple(weight.shape) if _fused(reduction, compute_dweight) else (0,))
    return loss, lse, dh, dw


def backward(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
    ignore_index: int, reduction: str, compute_dhidden: bool, compute_dweight: bool, vocab_start: int,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of linear_cross_entropy from its lse, recomputing the logits chunk by chunk.

    grad_loss: () for "mean"/"sum", (N,) for "none"; the other tensors as the forward, lse (N,)
    float32 from it. ``backend``: the forward's request. Returns (dhidden (N, D) in hidden.dtype,
    dweight (V_local, D) in weight.dtype), each an empty (0,) tensor when not asked.
    """
    return cross_entropy_def.kernels(hidden.device, backend).backward(
        grad_loss, hidden, weight, labels, lse, ignore_index, reduction, compute_dhidden, compute_dweight, vocab_start
    )


def _backward_fake(grad_loss, hidden, weight, labels, lse, ignore_index, reduction, compute_dhidden, compute_dweight,
                   vocab_start, backend=None):
    return (hidden.new_empty(tuple(hidden.shape) if compute_dhidden else (0,)),
            weight.new_empty(tuple(weight.shape) if compute_dweight else (0,)))


def _setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, reduction, compute_dh, compute_dw, vocab_start = inputs[:8]
    _, lse, dh, dw = output
    ctx.mark_non_differentiable(lse, dh, dw)
    ctx.reduction, ctx.ignore_index, ctx.vocab_start = reduction, ignore_index, vocab_start
    ctx.saved_dh, ctx.saved_dw = _fused(reduction, compute_dh), _fused(reduction, compute_dw)
    if ctx.saved_dh and ctx.saved_dw:
        ctx.save_for_backward(dh, dw)
    else:  # a gradient to recompute from lse (always for "none")
        ctx.save_for_backward(dh, dw, hidden, weight, labels, lse)


def _refuse_double_backward(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """With create_graph, give the gradients a grad_fn that raises (naming the op) if it is ever
    differentiated, instead of a silently wrong second derivative (the pattern of
    ``torch.autograd.function.once_differentiable``)."""
    if not torch.is_grad_enabled():
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    err = torch._C._functions.DelayedError(_DOUBLE_BACKWARD, len(present))
    wrapped = err(*[g.detach().requires_grad_() for g in present])
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return [next(wrapped) if g is not None else None for g in grads]


def _grads(ctx, grad_loss, _dlse=None, _ddh=None, _ddw=None):
    want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    saved = ctx.saved_tensors
    with torch.no_grad():
        dh = dw = None
        if ctx.saved_dh and want_dh:
            dh = saved[0] * grad_loss.to(saved[0].dtype)
        if ctx.saved_dw and want_dw:
            dw = saved[1] * grad_loss.to(saved[1].dtype)
        need_dh, need_dw = want_dh and dh is None, want_dw and dw is None
        if need_dh or need_dw:
            hidden, weight, labels, lse = saved[2:]
            rdh, rdw = cross_entropy_def.backward(grad_loss, hidden, weight, labels, lse, ctx.ignore_index,
                                                  ctx.reduction, need_dh, need_dw, ctx.vocab_start, ctx.backend)
            dh = rdh if need_dh else dh
            dw = rdw if need_dw else dw
    dh, dw = _refuse_double_backward([dh, dw])
    return dh, dw, None, None, None, None, None, None, None, None


def _sharding(hidden, weight, labels, *scalars):
    """The vocabulary-parallel loss (weight Shard(0)) needs collectives between the softmax statistics
    and the gradient, which a sharding rule cannot express: ``linear_cross_entropy`` handles DTensors
    itself and calls the op on local shards with the group. This rule covers direct calls of the op
    with DTensors: replicated inputs run locally (anything else is made Replicate by DTensor, never
    computed wrong). It depends only on tensor arguments (DTensor leaves the scalars out of its cache key)."""
    from torch.distributed.tensor import Replicate

    rep = Replicate()
    return [([rep] * 4, [rep, rep, rep, *[None] * len(scalars)])]


def _backward_sharding(grad_loss, hidden, weight, labels, lse, *scalars):
    from torch.distributed.tensor import Replicate

    rep = Replicate()
    return [([rep, rep], [rep] * 5 + [None] * len(scalars))]


cross_entropy_def.define(forward, _fake, setup=_setup, grads=_grads, backward=backward, backward_fake=_backward_fake,
                         sharding=_sharding, backward_sharding=_backward_sharding)


# ----------------------------------------------------------------------------- public API


def _loss_2d(hidden, weight, labels, ignore_index, reduction, vocab_start=0, vocab_size=-1, group=None):
    grad = torch.is_grad_enabled()
    return cross_entropy_def(
        hidden, weight, labels, ignore_index, reduction, grad and hidden.requires_grad, grad and weight.requires_grad,
        vocab_start, vocab_size, group,
    )[0]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` without materializing them.

    Same value as ``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=..., reduction=...)``
    (flattened over the leading dims), computed chunk by chunk with float32 logits, softmax and
    accumulation whatever the input dtype; the gradients of hidden and weight are computed in the
    same pass (for "mean" and "sum").

    Args:
        hidden: (N, D) (or (..., D)) float32 / bfloat16 / float16, any strides.
        weight: (V, D), the dtype of hidden (e.g. the output projection's weight).
        labels: (N,) (or hidden's leading shape) int64, each in [0, V) or ``ignore_index``.
        ignore_index: label value that contributes no loss and no gradient.
        reduction: "mean" over the non-ignored tokens (NaN if there is none, as
            ``F.cross_entropy``; the gradients are then 0), "sum", or "none" (labels' shape, 0 at
            ignored tokens).

    Returns:
        float32 loss. DTensor inputs (tensor parallel): a replicated DTensor; with ``weight``
        split on the vocabulary (``Shard(0)``) the loss is computed vocabulary-parallel, with no
        gather of the logits (module docstring).

    Raises:
        TypeError: a non-float hidden/weight, different dtypes, labels not int64, ignore_index not an int.
        ValueError: shapes that do not match, different devices, an unknown reduction, a label out
            of range (checked on the CPU, before any GEMM; on CUDA such a token's loss is NaN, since
            the check would wait for the device), DTensors on different meshes.
        RuntimeError: the requested backend cannot run on the device.

    Source: the softmax cross-entropy gradient (Goodfellow et al. 2016, sec. 6.2.2.3); chunking and
    fused gradients as in Liger-Kernel's FLCE; vocabulary-parallel as Megatron-LM (Shoeybi et al. 2019).
    """
    _validate(hidden, weight, labels, ignore_index, reduction)
    if _has_dtensor(hidden, weight, labels):
        return _linear_cross_entropy_dtensor(hidden, weight, labels, ignore_index, reduction)
    d = hidden.shape[-1]
    loss = _loss_2d(hidden.reshape(-1, d), weight, labels.reshape(-1), ignore_index, reduction)
    return loss.view(labels.shape) if reduction == "none" else loss


# ----------------------------------------------------------------------------- DTensor (tensor parallel)


def _has_dtensor(*tensors) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def _linear_cross_entropy_dtensor(hidden, weight, labels, ignore_index, reduction):
    """The DTensor path. The weight keeps at most one vocabulary split (``Shard(0)`` on one mesh
    dim; any other placement is made Replicate first); hidden and labels are made Replicate (an
    all-gather of the hidden states under sequence parallel, as ``ColwiseParallel``'s input). Each
    rank runs the op on its local shards with that mesh dim's group, so the max, sum-exp and target
    logit are all-reduced inside, token-sized. hidden's gradient comes out Partial over the split
    (each rank's vocabulary part) and is reduced to hidden's placement by DTensor's autograd;
    weight's gradient is this rank's rows (``Shard(0)``)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = next(t.device_mesh for t in (weight, hidden, labels) if isinstance(t, DTensor))
    rep = [Replicate()] * mesh.ndim

    def as_dtensor(t, name):
        if not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, rep, run_check=False)
        if t.device_mesh != mesh:
            raise ValueError(f"{name}: expected a DTensor on the mesh of the other inputs {mesh}, got {t.device_mesh}")
        return t

    hidden, weight, labels = as_dtensor(hidden, "hidden"), as_dtensor(weight, "weight"), as_dtensor(labels, "labels")
    split = next((i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0), None)
    want = [Shard(0) if i == split else Replicate() for i in range(mesh.ndim)]
    if list(weight.placements) != want:
        weight = weight.redistribute(mesh, want)
    grad_placements = [Partial() if i == split else Replicate() for i in range(mesh.ndim)]
    h = hidden.redistribute(mesh, rep).to_local(grad_placements=grad_placements)
    y = labels.redistribute(mesh, rep).to_local()
    w = weight.to_local()
    vocab_size = weight.shape[0]
    if split is None:
        start, group = 0, None
    else:
        _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        start, group = offset[0], mesh.get_group(split).group_name
    d = h.shape[-1]
    loss = _loss_2d(h.reshape(-1, d), w, y.reshape(-1), ignore_index, reduction, start, vocab_size, group)
    if reduction == "none":
        loss = loss.view(y.shape)
    return DTensor.from_local(loss, mesh, rep, run_check=False)
