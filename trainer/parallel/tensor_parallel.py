"""Tensor + sequence parallel for the decoder families (Megatron-LM's split, Shoeybi et al. 2019; with
sequence parallel, Korthikanti et al. 2022), through ``torch.distributed.tensor.parallel``.

Each block's attention and feed-forward module gives its own plan (``tp_plan()``, relative names,
``""`` for the module itself; an optional ``tp_finish(tp_mesh)`` runs after it), so a family with
other modules (DeepSeek-V3's latent attention, a MoE) brings its plan with them. The shared decoder's
plan, per transformer block, on a 1-D ``tp`` mesh:

  attention_norm, ffn_norm   sequence parallel: input sharded on the sequence (Shard(1)), weight
                             replicated. Our rms_norm / add_rms_norm DTensor rules run them on the
                             local rows, so nothing is communicated around the norms; their weight
                             gradients come out Partial and are summed over tp by DTensor.
  attention, feed_forward    input all-gathered on the sequence (Shard(1) -> Replicate) on entry;
  wq, wk, wv, w1, w3         colwise: the weight split on its output dim, the output a local tensor
                             holding n_heads / tp heads (or ffn_hidden / tp columns);
  wo, w2                     rowwise: the weight split on its input dim, the Partial output
                             reduce-scattered onto the sequence (Shard(1)).

Around the blocks: ``tok_embeddings`` is split on the vocabulary (rowwise: each rank looks up its
own rows, the Partial sum is reduce-scattered onto the sequence); ``norm`` is sequence parallel;
``output`` is colwise (its weight split on the vocabulary, ``Shard(0)``). Loss parallel (the
default) is the trainer's fused loss: the model returns the final norm's sequence-sharded hidden
states and ``titan_kernels.linear_cross_entropy`` takes them with the vocab-split output weight
(``trainer.models.common.losses.linear_cross_entropy_loss``): hidden is all-gathered (as ``output``'s
colwise input would be), each rank computes the logits of its own vocabulary rows chunk by chunk,
and only token-sized max / sum-exp / target-logit values are all-reduced, never the (batch, seq,
vocab) logits, which are not even materialized; hidden's gradient is reduce-scattered back onto
the sequence. ``output``'s own forward is then unused; called (logits wanted), it returns them
vocab-sharded (``Shard(-1)``), for a cross-entropy under ``loss_parallel()``
(``loss_parallel_context``). With ``disable_loss_parallel`` the logits are all-gathered and the
loss is the plain cross-entropy.

Between modules the hidden states are plain local tensors holding this rank's sequence shard (as
in torchtitan), so the residual adds are local and pipeline stages pass plain tensors.

Per layer and micro-batch this communicates, in the forward: 2 all-gathers and 2 reduce-scatters
of the (batch, seq, dim) activation (the backward the same with the roles swapped); see
trainer/parallel/README.md for the bytes.

Async TP (``enable_async_tensor_parallel``, CUDA only): Inductor's micro-pipelining
(``torch._inductor.config._micro_pipeline_tp``) fuses each all-gather / reduce-scatter with the
matmul next to it over symmetric memory, so it needs ``compile.enable``. Unverified here: it needs
several GPUs.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


class SequenceParallelAll(SequenceParallel):
    """Sequence parallel for a norm with several tensor inputs (``AddRMSNorm(x, residual)``): every
    tensor input becomes a sequence-sharded DTensor, every output a local tensor."""

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        convert = partial(SequenceParallel._prepare_input_fn, sequence_sharding, mod, device_mesh=device_mesh)
        return tuple(convert((t,)) if isinstance(t, torch.Tensor) else t for t in inputs)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def check_tp_divisibility(args, tp: int) -> None:
    """Raise ValueError (naming ``parallelism.tensor_parallel_degree``) unless tp divides every size
    the model's args say tensor parallel splits (``tp_divisible()``: heads, FFN widths, vocabulary;
    each rank gets an equal part)."""
    if tp == 1:
        return
    for what, n in args.tp_divisible().items():
        if n % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree: {tp} does not divide the model's {what} = {n} "
                f"(each tensor-parallel rank holds an equal part)"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True, async_tp: bool = False) -> nn.Module:
    """Apply the tensor + sequence parallel plan (module docstring) to ``model`` in place.

    ``model`` is a ``trainer.models.common.decoder.Transformer`` or a pipeline stage of one (any of
    tok_embeddings / norm / output may be None), on the meta device or materialized, with nn.Linear
    or Float8Linear layers (the fp8_linear op has DTensor rules for colwise and rowwise shards).
    Tied embeddings are not supported (the output would need the embedding's other split).

    Raises ValueError for tied embeddings, RuntimeError for async TP off CUDA.
    """
    if getattr(model, "args", None) is not None and model.args.tie_word_embeddings:
        raise ValueError(
            "parallelism.tensor_parallel_degree: tied embeddings (1B/3B flavors) are not supported with tensor "
            "parallel; use data parallel for them"
        )
    plan: dict[str, nn.Module] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))
        finish_block(block, tp_mesh)
    extra = getattr(model, "tp_finish", None)  # a family's modules outside the blocks (e.g. MTP)
    if extra is not None:
        extra(tp_mesh)
    if async_tp:
        enable_async_tp(tp_mesh)
    return model


def block_plan(block: nn.Module) -> dict:
    """The plan of one transformer block (module docstring): its norms sequence parallel, its attention
    and feed-forward by their own ``tp_plan()``."""
    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallelAll()}
    for name in ("attention", "feed_forward"):
        for key, style in getattr(block, name).tp_plan().items():
            plan[f"{name}.{key}" if key else name] = style
    return plan


def finish_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """After the plan: the block's modules' own ``tp_finish(tp_mesh)`` (replicated weights, meshes)."""
    for name in ("attention", "feed_forward"):
        finish = getattr(getattr(block, name), "tp_finish", None)
        if finish is not None:
            finish(tp_mesh)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on Inductor's TP micro-pipelining with symmetric memory for the ``tp`` group (CUDA only).

    Takes effect for the compiled blocks (``compile.enable``). Raises RuntimeError off CUDA.
    """
    if tp_mesh.device_type != "cuda":
        raise RuntimeError(
            f"parallelism.enable_async_tensor_parallel: needs CUDA devices (symmetric memory), got a "
            f"{tp_mesh.device_type!r} mesh"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def loss_parallel_context(enabled: bool):
    """``loss_parallel()`` when the logits are vocab-sharded DTensors, else a no-op context (the
    logits path; the fused loss needs no context)."""
    import contextlib

    return loss_parallel() if enabled else contextlib.nullcontext()
