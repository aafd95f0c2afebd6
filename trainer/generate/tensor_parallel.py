"""Tensor parallel generation (Megatron-LM's split, Shoeybi et al. 2019, without sequence parallel:
a decode step has one token per sequence, nothing to split on the sequence).

On a 1-D ``tp`` mesh, per block: the shared attention's wq/wk/wv colwise (each rank its heads, and
so its part of every KV cache), wo rowwise with the output all-reduced (replicated); the dense
feed-forward's w1/w3 colwise, w2 rowwise. Norms, embeddings, the output projection and the modules
without a plan here (MLA's latents, MoE experts) stay whole on every rank, so every rank computes
the same logits and draws the same token from the same seed.
"""
from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainer.models.common.attention import Attention
from trainer.models.common.feed_forward import FeedForward


def apply_generation_tp(model, tp_mesh) -> None:
    """Split ``model``'s shared attention and dense feed-forward layers over ``tp_mesh`` (module
    docstring), in place, on the meta device or materialized. Raises ValueError when the mesh size
    does not divide the kv heads or the FFN width."""
    tp = tp_mesh.size()
    for i, block in model.layers.items():
        plan = {}
        att, ffn = block.attention, block.feed_forward
        if isinstance(att, Attention):
            if att.n_kv_heads % tp:
                raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {att.n_kv_heads} "
                                 f"kv heads of layer {i}")
            plan.update({"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                         "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
        if isinstance(ffn, FeedForward):
            if ffn.w1.out_features % tp:
                raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the FFN width "
                                 f"{ffn.w1.out_features} of layer {i}")
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                         "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan)
        if isinstance(att, Attention):
            att.tp_finish(tp_mesh)  # the sinks split on the heads as wq's rows
