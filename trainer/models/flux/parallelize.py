"""Flux's parallel layouts (``ModelSpec.parallelize``): tensor parallel on the heads and the MLP
width, context parallel on the joint sequence, then the shared activation checkpointing, compile
per block and FSDP2 / HSDP (``trainer.parallel``), then materialize and initialize.

Tensor parallel (Megatron's split, activations replicated between blocks, as torchtitan splits
Flux): each stream's wq / wk / wv and MLP input colwise (this rank's heads and hidden columns), the
attention and MLP output projections rowwise (their partial outputs all-reduced), the AdaLN
modulation colwise with its output all-gathered (every rank needs all the shifts, scales and
gates), the QK RMSNorms on the local heads (weights replicated, their gradients summed over tp by
DTensor). A single block's output projection is two column blocks (``out_attn``, ``out_mlp``), each
rowwise like its input. The input embedders and the final layer are replicated DTensors.

Context parallel: the trainer's task shards the text and image tokens (and their position ids and
targets) over the cp ranks (``ContextParallel.shard``, each stream on its own, so the joint
sequence of every rank is its text part then its image part); every block's attention is then the
non-causal ring over the cp ranks (``trainer.parallel.context_parallel``), exact whatever the order
of keys. The rotary tables come from the local tokens' ids.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from trainer.parallel.context_parallel import ContextParallel
from trainer.parallel.fsdp import apply_fsdp, reshard_after_forward
from trainer.parallel.parallelize import ParallelModel, checkpoint_and_compile
from trainer.parallel.tensor_parallel import check_tp_divisibility


def _qkv_plan(prefix: str) -> dict:
    # the norms see (b, s, heads, head_dim) with this rank's heads: "sequence" parallel on dim 2
    norm = lambda: SequenceParallel(sequence_dim=2, use_local_output=True)  # noqa: E731
    return {f"{prefix}.wq": ColwiseParallel(), f"{prefix}.wk": ColwiseParallel(), f"{prefix}.wv": ColwiseParallel(),
            f"{prefix}.q_norm": norm(), f"{prefix}.k_norm": norm()}


def block_tp_plan(block: nn.Module) -> dict:
    """The tensor-parallel plan of a double- or single-stream block (module docstring)."""
    mod = lambda: ColwiseParallel(output_layouts=Replicate())  # noqa: E731
    if hasattr(block, "img"):  # double-stream
        plan = {}
        for s in ("img", "txt"):
            plan.update({f"{s}.mod.lin": mod(), f"{s}.proj": RowwiseParallel(), f"{s}.mlp.w1": ColwiseParallel(),
                         f"{s}.mlp.w2": RowwiseParallel(), **_qkv_plan(f"{s}.attn")})
        return plan
    return {"mod.lin": mod(), "mlp_in": ColwiseParallel(), "out_attn": RowwiseParallel(),
            "out_mlp": RowwiseParallel(), **_qkv_plan("attn")}


def _replicate(module: nn.Module, tp_mesh) -> None:
    """Parameters as DTensors replicated over tp (so that every parameter of the model is a DTensor of
    the tp mesh, as the optimizer's fused step needs), plain tensors in and out."""
    def to_dtensor(mod, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t
                     for t in inputs)

    def to_local(mod, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tp(model: nn.Module, tp_mesh) -> None:
    for block in model.blocks():
        parallelize_module(block, tp_mesh, block_tp_plan(block))
    for name in ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "final_layer"):
        if getattr(model, name) is not None:
            _replicate(getattr(model, name), tp_mesh)


@contextlib.contextmanager
def without_context_parallel(model: nn.Module):
    """Inside: every block attends over its whole input (sampling runs the full sequence on each cp rank)."""
    saved = [(b, b.context_parallel) for b in model.blocks()]
    for b, _ in saved:
        b.context_parallel = None
    try:
        yield
    finally:
        for b, cp in saved:
            b.context_parallel = cp


def parallelize_flux(model: nn.Module, config, dims, mesh, device: torch.device, *, use_fsdp: bool,
                     param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                     loss_fn=None, layer_modes: list[str] | None = None) -> ParallelModel:
    """``trainer.parallel.parallelize.parallelize_decoder``'s contract for a meta-device
    ``FluxTransformer`` (``layer_modes``: the activation mode of each block, by block index). Raises ValueError naming the key for pipeline or expert parallel, heads or
    MLP width not divisible by tp, or compile with TP off CUDA."""
    p = config.parallelism
    if dims.pp_enabled:
        raise ValueError(f"parallelism.pipeline_parallel_degree: {model.args.pipeline_refusal()}")
    if dims.ep_enabled:
        raise ValueError("parallelism.expert_parallel_degree: Flux has no experts")
    check_tp_divisibility(model.args, dims.tp)
    if config.compile.enable and dims.tp_enabled and device.type != "cuda":
        raise ValueError("compile.enable: not supported with parallelism.tensor_parallel_degree > 1 on this device "
                         "(see trainer.parallel.parallelize)")
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    cp = None
    if dims.cp_enabled:
        cp = ContextParallel(mesh["cp"])
        for block in model.blocks():
            block.context_parallel = cp
    checkpoint_and_compile(model, config, dims, device, layer_modes)
    if use_fsdp:
        apply_fsdp(model, dims.dp_mesh(mesh), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward(p.fsdp_reshard_after_forward, False))
    model.to_empty(device=device)
    model.init_weights(config.training.seed)
    model.train()
    partial = []
    if dims.tp_enabled and not use_fsdp:  # the QK-norm weights' gradients are Partial over tp
        partial = [prm for name, prm in model.named_parameters() if name.endswith("norm.weight")]
    return ParallelModel(model, [model], None, cp, False, dims.fsdp_size if use_fsdp else 1, partial)
