"""Fused AdamW step: ``torch.ops.titan.fused_adamw_``, in place over lists of tensors, one kernel
launch per list (per dtype combination).

Math: ``torch.optim.AdamW`` (Loshchilov & Hutter 2019; no amsgrad), float32 arithmetic whatever the
storage. States (exp_avg, exp_avg_sq) float32 or bfloat16; parameters float32 or bfloat16; bfloat16
storage is written with stochastic rounding from a counter-based hash keyed by (seed, step, the
parameter's key, the element's counter), so a resumed run draws the same bits
(``titan_kernels.reference.fused_adamw`` gives the formulas and the hash).

DTensor: parameters, gradients and states that are DTensors (FSDP2 / TP / EP shards) are updated on
their local tensors, without any communication; an element's counter is its index in the global
tensor when the local shard is a block of whole rows (FSDP2 and dim-0 shardings: the bits do not
depend on the layout), else its local index in a stream keyed also by the shard's global offset.

The op has no autograd (it is an optimizer step; a call is refused under grad mode for tensors
that require grad, as for any in-place update of a leaf). A fake implementation makes it trace.

Backends (automatic order: cpu > reference on CPU tensors; triton > reference on CUDA):
``reference`` (aten ops per tensor), ``triton`` (one launch for the list, multi-tensor table) and
``cpu`` (csrc, at::vec + at::parallel_for over the chunks of all tensors). bench/bench_optim.py
times them against ``torch.optim.AdamW`` (foreach and fused).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

from titan_kernels.ops._common import check_tensor, dtype_name
from titan_kernels.ops._overlap import check_no_overlap
from titan_kernels.ops._scaffold import Op
from titan_kernels.reference import fused_adamw as _ref

OP = "fused_adamw"
fused_adamw_def = Op("fused_adamw_", impls=OP)  # titan::fused_adamw_: in place, as torch names it
DTYPES = (torch.float32, torch.bfloat16)
fused_adamw_def.register("reference", _ref.fused_adamw_)
fused_adamw_def.register_triton("titan_kernels.triton.fused_adamw", "fused_adamw_")


def _native(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, keys, offsets):
    decay, step_size, bc2_sqrt = _ref.step_scalars(lr, beta1, beta2, weight_decay, step)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, grads[i].dtype, exp_avgs[i].dtype), []).append(i)
    for idx in groups.values():
        torch.ops.titan.fused_adamw_native_(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], beta1, beta2, eps, decay, step_size, bc2_sqrt,
            [keys[i] for i in idx], [offsets[i] for i in idx])


fused_adamw_def.register_native(_native, families=("cpu",))  # available where csrc is built


# ----------------------------------------------------------------------------- validation


def _check_lists(params, grads, exp_avgs, exp_avg_sqs) -> int:
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    for name, lst in lists.items():
        if not isinstance(lst, (list, tuple)):
            raise TypeError(f"{name}: expected a list of tensors, got {type(lst).__name__}")
    n = len(params)
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per parameter), got {len(lst)}")
    for i in range(n):
        p = check_tensor(params[i], f"params[{i}]")
        for name, lst in lists.items():
            t = check_tensor(lst[i], f"{name}[{i}]")
            if t.dtype not in DTYPES:
                raise TypeError(f"{name}[{i}]: expected dtype float32 or bfloat16, got {dtype_name(t.dtype)}")
            if t.shape != p.shape:
                raise ValueError(f"{name}[{i}]: expected shape {tuple(p.shape)} (the shape of params[{i}]), "
                                 f"got {tuple(t.shape)}")
            if t.device != p.device:
                raise ValueError(f"{name}[{i}]: expected device {p.device} (the device of params[{i}]), got {t.device}")
        if exp_avg_sqs[i].dtype != exp_avgs[i].dtype:
            raise TypeError(f"exp_avg_sqs[{i}]: expected dtype {dtype_name(exp_avgs[i].dtype)} (the dtype of exp_avgs[{i}]), "
                            f"got {dtype_name(exp_avg_sqs[i].dtype)}")
        if i and p.device != params[0].device:
            raise ValueError(f"params[{i}]: expected device {params[0].device} (the device of params[0]), got {p.device}")
    return n


def _check_hyper(lr, beta1, beta2, eps, weight_decay, step) -> None:
    def real(name, v, ok, expected):  # numpy's scalars are numbers too
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"{name}: expected {expected}, got {v!r}")

    real("lr", lr, lambda v: v >= 0, "a finite value >= 0")
    real("beta1", beta1, lambda v: 0 <= v < 1, "a value in [0, 1)")
    real("beta2", beta2, lambda v: 0 <= v < 1, "a value in [0, 1)")
    real("eps", eps, lambda v: v > 0, "a finite value > 0")
    real("weight_decay", weight_decay, lambda v: v >= 0, "a finite value >= 0")
    if not _is_int(step) or step < 1:
        raise ValueError(f"step: expected an integer >= 1 (the 1-based step being taken), got {step!r}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_keys(seed, param_keys, n: int) -> None:
    """seed an int; param_keys None or a list/tuple of n ints (1.5 would be truncated, "a" fail deep inside)."""
    if not _is_int(seed):
        raise TypeError(f"seed: expected an int, got {seed!r} ({type(seed).__name__})")
    if param_keys is None:
        return
    if not isinstance(param_keys, (list, tuple)):
        raise TypeError(f"param_keys: expected None or a list of {n} ints (one per parameter), got "
                        f"{type(param_keys).__name__}")
    if len(param_keys) != n:
        raise ValueError(f"param_keys: expected {n} integers (one per parameter), got {len(param_keys)}")
    for i, k in enumerate(param_keys):
        if not _is_int(k):
            raise TypeError(f"param_keys[{i}]: expected an int, got {k!r} ({type(k).__name__})")


# ----------------------------------------------------------------------------- DTensor shards


def _shard_counter(t) -> tuple[int, int]:
    """(counter offset, extra key) of a DTensor's local shard (module docstring)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) == tuple(t.shape[1:]) and len(off) == t.dim():
        return off[0] * math.prod(t.shape[1:]), 0
    return 0, _ref.hash32(hash(tuple(off)) & _ref.M32)


def _locals(tensors, params, name: str) -> list[torch.Tensor]:
    """The local tensors of ``tensors``, each laid out like its parameter: a gradient with other
    placements (e.g. replicated for a sharded parameter) is redistributed first."""
    from torch.distributed.tensor import DTensor

    out = []
    for i, (t, p) in enumerate(zip(tensors, params)):
        if isinstance(p, DTensor) != isinstance(t, DTensor):
            raise TypeError(f"{name}[{i}]: expected a {'DTensor' if isinstance(p, DTensor) else 'plain tensor'} like "
                            f"params[{i}], got a {type(t).__name__}")
        if isinstance(t, DTensor):
            if t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
                if name != "grads":  # an updated tensor must be the parameter's layout: its shard is written
                    raise ValueError(f"{name}[{i}]: expected the placements of params[{i}] {tuple(p.placements)}, "
                                     f"got {tuple(t.placements)}")
                t = t.redistribute(p.device_mesh, p.placements)
            t = t.to_local()
        out.append(t)
    return out


# ----------------------------------------------------------------------------- the op


def forward(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: int, keys: list[int], offsets: list[int], backend: Optional[str] = None,
) -> None:
    """One AdamW step in place over plain tensors (see ``titan_kernels.fused_adamw_``): the kernels run
    on contiguous copies of the non-contiguous tensors (written back after). ``keys``: each tensor's
    stream key (``reference.fused_adamw.tensor_key``), ``offsets``: counter bases."""
    if not params:
        return
    fn = fused_adamw_def.kernels(params[0].device, backend).forward
    lists = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)]
    back = []
    for li, lst in enumerate(lists):
        for i, t in enumerate(lst):
            if not t.is_contiguous():
                c = t.contiguous()
                lst[i] = c
                if li != 1:
                    back.append((t, c))
    fn(*lists, lr, beta1, beta2, eps, weight_decay, step, keys, offsets)
    for t, c in back:
        t.copy_(c)


# No sharding rule: the public function runs on the local shards of DTensor inputs.
fused_adamw_def.define(forward, lambda *args: None, mutates_args=("params", "exp_avgs", "exp_avg_sqs"),
                       differentiable=False)


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    step: int,
    seed: int = 0,
    param_keys: Sequence[int] | None = None,
    backend: str | None = None,
) -> None:
    """One AdamW step of every parameter of the lists, in place: parameters and both states are read
    and written in one pass, in one kernel launch per list (per dtype combination).

    Args:
        params: parameters, float32 or bfloat16, any shape and strides (zero-size allowed); plain
            tensors or DTensors (updated on their local shards, no communication).
        grads: their gradients, same shapes; float32 or bfloat16 (each list one dtype per launch).
        exp_avgs, exp_avg_sqs: the Adam moments, same shapes; float32 or bfloat16 (the pair one dtype).
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled decay p *= 1 - lr*wd).
        step: the 1-based step being taken (bias corrections 1 - beta^step).
        seed: the run's seed for stochastic rounding (bfloat16 parameters or states).
        param_keys: one integer per parameter naming its random stream (stable across runs and
            layouts, e.g. a hash of the parameter's name); default its index in the list.
        backend: an implementation ("reference", "triton", "cpu") or None for the automatic choice.

    float32 storage gets the float32 result of torch.optim.AdamW's formula; bfloat16 storage the same
    value rounded stochastically (unbiased: E[stored] = the float32 value).

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16, exp_avg_sq's dtype != exp_avg's,
            a seed that is not an int, param_keys not a list/tuple of ints.
        ValueError: lists of different lengths, mismatched shapes or devices, hyperparameters out of
            range (lr < 0, beta outside [0, 1), eps <= 0, weight_decay < 0, step < 1), param_keys of
            another length, or aliasing: a parameter or state that shares memory with any other
            argument (the same tensor as exp_avg and exp_avg_sq, a gradient that is a view of its
            parameter, overlapping views, an expanded tensor); gradients may share with each other.
            The aliasing check runs in eager mode (under torch.compile storages are not traced).
        RuntimeError: the requested backend cannot run on these tensors.

    Source: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019), Algorithm 2;
    torch.optim.AdamW; stochastic rounding: Gupta et al. 2015.
    """
    n = _check_lists(params, grads, exp_avgs, exp_avg_sqs)
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step)
    _check_keys(seed, param_keys, n)
    from torch.distributed.tensor import DTensor

    keys, offsets = [], []
    for i, p in enumerate(params):
        pk = int(param_keys[i]) if param_keys is not None else i
        offset = 0
        if isinstance(p, DTensor):
            offset, extra = _shard_counter(p)
            pk ^= extra
        keys.append(_ref.tensor_key(int(seed), step, pk))
        offsets.append(offset)
    lists = [_locals(x, params, name) for x, name in ((params, "params"), (grads, "grads"), (exp_avgs, "exp_avgs"),
                                                      (exp_avg_sqs, "exp_avg_sqs"))]
    if any(t.requires_grad and torch.is_grad_enabled() for t in lists[0]):
        raise RuntimeError("fused_adamw_: params require grad and grad mode is on; call it under torch.no_grad() "
                           "(an optimizer step)")
    if not torch.compiler.is_compiling():  # storage pointers do not trace: eager mode only
        # On the local tensors: what the kernels read and write. Gradients are only read: they may share.
        check_no_overlap(dict(zip(("params", "grads", "exp_avgs", "exp_avg_sqs"), lists)), read_only=("grads",))
    args = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step), keys, offsets)
    fused_adamw_def.call(*lists, *args, backend)
