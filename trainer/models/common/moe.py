"""Mixture-of-experts feed-forward: token-choice top-k router, routed SwiGLU experts over grouped
GEMMs, optional shared experts, and load balancing (auxiliary-loss-free bias or sequence-wise loss).

``MoE(dim, args)`` maps x (batch, seq, dim) -> (batch, seq, dim), like the dense FeedForward:

1. Router: ``scores = softmax(x W_g)`` (or sigmoid) in float32, (tokens, E). Each token picks the
   ``top_k`` experts of highest ``scores + expert_bias`` (the bias steers the choice only, Wang et
   al. 2024, arXiv 2408.15664); with group-limited routing (DeepSeek-V3, ``n_group`` > 1) only
   among the ``topk_group`` groups whose two best biased scores sum highest. Its weights are the
   chosen *scores*, renormalised to sum to 1 (``route_norm``) and times ``route_scale``.
2. Permute: the (token, expert) rows copied into expert order, tokens in order within an expert
   (``titan_kernels.moe_permute``); ``counts[e]`` rows go to expert e.
3. Experts: ``w2_e(silu(x w1_e) * x w3_e)`` for every expert at once: three grouped GEMMs
   (``grouped_mm``: x (N, K) sorted by expert, w (E, K, N'), offsets = cumulative counts) and one
   ``titan_kernels.swiglu``. Weights are stored (E, in, out), the layout grouped_mm takes. With
   ``--float8.enable`` (``trainer.float8`` sets ``GroupedExperts.float8_recipe``) the three GEMMs are
   ``titan_kernels.fp8_grouped_mm``: rowwise e4m3 operands, forward, dgrad and (recipe ``rowwise``)
   wgrad in float8.
   Under expert parallel (``trainer.parallel.expert_parallel``) the rows travel by all-to-all to
   the ranks holding their experts and back; this module does not change.
4. Unpermute: every row's output times its weight, summed back into its token
   (``titan_kernels.moe_unpermute``, float32 accumulation).
5. Shared experts (DeepSeek-V3): one SwiGLU every token goes through, added.

Load balancing (``MoEArgs.load_balance``):
  bias      the routed counts of every step accumulate in ``tokens_per_expert``; after each
            optimizer step ``update_load_balance`` sums them over the data-parallel ranks and moves
            ``expert_bias[e] += rate * sign(mean count - count[e])`` (the paper's update, rate 1e-3).
            The bias is a persistent buffer (checkpointed), the same on every rank.
  aux_loss  DeepSeek-V3's sequence-wise balance loss (sec. 2.1.2): per sequence,
            ``alpha * sum_e f_e P_e`` with ``f_e = E / (k S) * (tokens of the sequence routed to e)``
            and ``P_e`` the mean over its tokens of the scores normalised to sum 1; averaged over the
            sequences. Its gradient is added in the backward (``_AddAuxLoss``) with weight 1 per
            micro-batch forward, as if added to that micro-batch's loss.
  none      neither.

Tensor parallel (``trainer.parallel.tensor_parallel``): the input is all-gathered over the sequence,
every tp rank routes all tokens alike (router weight replicated), the experts and shared experts
are split on their hidden size; the routed output is a partial sum, reduce-scattered back onto the
sequence here (``tp_mesh``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import titan_kernels
from trainer.models.common.feed_forward import FeedForward
from trainer.models.common.moe_args import MoEArgs


_counting_paused = False


@contextlib.contextmanager
def no_expert_counting():
    """Forwards inside do not count towards the load balance, e.g. the pipeline schedule's
    metadata-inference forward of its first step (not a training forward)."""
    global _counting_paused
    before, _counting_paused = _counting_paused, True
    try:
        yield
    finally:
        _counting_paused = before


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, float8: str | None = None) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w[e]``: x (T, K) sorted by group, w (E, K, N),
    offsets int32 (E,) cumulative group ends (offsets[-1] == T); returns (T, N) in x's dtype.

    ``titan_kernels.grouped_mm`` when the package has it, else ``torch._grouped_mm`` (float32 /
    bfloat16; on the CPU its row strides must be multiples of 16 bytes); with ``float8`` (a recipe of
    ``titan_kernels.fp8_grouped_mm``: "rowwise" or "rowwise_with_gw_hp") its float8 variant. The one
    place to switch.
    """
    if float8 is not None:
        return titan_kernels.fp8_grouped_mm(x, w, offsets, recipe=float8)
    op = getattr(titan_kernels, "grouped_mm", None)
    if op is not None:
        return op(x, w, offsets)
    return torch._grouped_mm(x, w, offs=offsets)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor parameter (autograd-aware: its gradient is a DTensor with the
    parameter's placements), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def run_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, float8: str | None = None, biases=None, activation: dict | None = None) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert: x (N, dim), counts (E,) rows per expert, w1/w3
    (E, dim, hidden), w2 (E, hidden, dim) -> (N, dim). Weights are cast to x's dtype (mixed precision).
    ``float8``: the fp8_grouped_mm recipe of the three GEMMs (None: high precision). ``biases``: None or
    (b1, b2, b3) of shapes (E, hidden), (E, dim), (E, hidden), added per row by its expert.
    ``activation``: ``titan_kernels.swiglu``'s keywords (GPT-OSS's clamped variant; None: plain)."""
    offsets = counts.cumsum(0).to(torch.int32)
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    h1, h3 = grouped_mm(x, w1, offsets, float8), grouped_mm(x, w3, offsets, float8)
    if biases is not None:
        b1, b2, b3 = (_rows(b.to(x.dtype), counts, x.shape[0]) for b in biases)
        h1, h3 = h1 + b1, h3 + b3
    out = grouped_mm(titan_kernels.swiglu(h1, h3, **(activation or {})), w2, offsets, float8)
    return out if biases is None else out + b2


def _rows(b: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
    """Expert e's row of ``b`` (E, .) repeated for its ``counts[e]`` rows: (n, .), no host sync."""
    return torch.repeat_interleave(b, counts, dim=0, output_size=n)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three (E, ., .) parameters: w1, w3 (E, dim, hidden), w2 (E, hidden, dim).

    ``forward(x (N, dim) sorted by expert, counts (E,) int64) -> (N, dim)``. ``expert_parallel``
    (set by ``trainer.parallel.expert_parallel.apply_ep``) sends the rows to the ranks holding their
    experts and back; the parameters are then DTensors split on the expert dimension.
    ``float8_recipe`` (set by ``trainer.float8.convert_model_to_float8``): the GEMMs run as
    ``titan_kernels.fp8_grouped_mm`` with that recipe; None (default) keeps them in high precision.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, bias: bool = False,
                 activation: dict | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        # GPT-OSS: biases on the three projections, and the clamped SwiGLU (``activation``).
        if bias:
            self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        else:
            self.w1_bias = self.w2_bias = self.w3_bias = None
        self.activation = activation
        self.expert_parallel = None
        self.float8_recipe: str | None = None
        self.tp_mesh = None  # set by tensor parallel: w2_bias is then added once over the tp ranks

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        f8, act, biases = self.float8_recipe, self.activation, self._biases()
        if self.expert_parallel is not None:
            return self.expert_parallel(x, counts, lambda xs, cs: run_experts(xs, cs, w1, w2, w3, f8, biases, act))
        return run_experts(x, counts, w1, w2, w3, f8, biases, act)

    def _biases(self):
        if self.w1_bias is None:
            return None
        b1, b2, b3 = local(self.w1_bias), local(self.w2_bias), local(self.w3_bias)
        if self.tp_mesh is not None:
            # Every tp rank adds w2's bias to its partial output, which the ranks then sum: each adds
            # 1/tp of it, and the gradient (1/tp per rank) is summed back over tp to the whole one.
            b2 = _sum_grad_over(b2, self.tp_mesh) / self.tp_mesh.size()
        return b1, b2, b3


class Router(nn.Module):
    """Token-choice top-k router: ``forward(x (T, dim), expert_bias (E,) or None) -> (scores (T, E)
    float32, top-k expert ids (T, k) int64, top-k weights (T, k) float32)`` (module docstring, step 1)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        a = self.args
        b = self.gate.bias
        logits = F.linear(x, local(self.gate.weight).to(x.dtype), None if b is None else local(b).to(x.dtype)).float()
        scores = torch.softmax(logits, dim=-1) if a.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        if a.n_group > 1:
            choice = limit_groups(choice, a.n_group, a.topk_group)
        idx = choice.topk(a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if a.route_norm and a.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if a.route_scale != 1.0:
            weights = weights * a.route_scale
        return scores, idx, weights


def limit_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing (sec. 2.1.2; its ``n_group`` / ``topk_group``): the experts
    form ``n_group`` equal groups; each token keeps the ``topk_group`` groups whose two best
    ``choice`` values sum highest, and the other experts' values become -inf. choice (T, E) float32."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
    keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)  # True = dropped group
    return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(t, e)


def _sum_grad_over(t: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; the backward sums the gradient over ``mesh`` (all-reduce), via DTensor:
    a replicated view whose local gradient is declared Partial."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``x``; the backward adds the gradient of ``aux`` (weight 1), so a balance loss
    trains the router without being added to the reported loss."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_meta = (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.ones((), dtype=dtype, device=device)


def sequence_balance_loss(scores: torch.Tensor, idx: torch.Tensor, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without alpha: the mean over the ``batch`` sequences
    of ``sum_e f_e P_e`` (module docstring). scores (batch*seq, E) float32, idx (batch*seq, k)."""
    n_experts = scores.shape[-1]
    s = scores.view(batch, -1, n_experts)
    seq = s.shape[1]
    p = (s / (s.sum(-1, keepdim=True) + 1e-20)).mean(1)  # (batch, E)
    hits = torch.zeros(batch, n_experts, device=scores.device, dtype=scores.dtype)
    hits.scatter_add_(1, idx.view(batch, -1), torch.ones_like(idx.view(batch, -1), dtype=scores.dtype))
    f = hits * (n_experts / (top_k * seq))
    return (f * p).sum(-1).mean()


class MoE(nn.Module):
    """The mixture-of-experts feed-forward (module docstring). x (batch, seq, dim) -> (batch, seq, dim).

    Buffers: ``expert_bias`` (E,) float32, persistent; ``tokens_per_expert`` (E,) float32, the
    routed (token, expert) pairs since the last ``update_load_balance`` (not checkpointed).
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        activation = None
        if args.swiglu_limit or args.swiglu_alpha != 1.0 or args.swiglu_up_offset:
            activation = dict(alpha=args.swiglu_alpha, limit=args.swiglu_limit or None, up_offset=args.swiglu_up_offset)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, bias=args.expert_proj_bias,
                                      activation=activation)
        if args.num_shared_experts:
            self.shared_experts = FeedForward(dim, args.hidden_dim * args.num_shared_experts)
        else:
            self.shared_experts = None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)
        self.tp_mesh = None  # set by tensor parallel: the routed output is reduce-scattered over it

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def tp_plan(self) -> dict:
        """Under tensor parallel: the input all-gathered over the sequence into a plain tensor (every tp
        rank routes all tokens alike); the shared experts split like the FeedForward. The routed
        experts are split on their hidden size by ``trainer.parallel.expert_parallel.shard_experts``,
        and the layer reduce-scatters their partial output itself (``tp_finish``)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInput

        plan = {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)}
        if self.shared_experts is not None:
            plan.update({f"shared_experts.{k}": v for k, v in self.shared_experts.tp_plan(gather_input=False).items()})
        return plan

    def tp_finish(self, tp_mesh) -> None:
        """After the plan: the router weight a replicated DTensor on tp (each rank computes its full,
        identical gradient from the all-gathered tokens), and the routed output reduce-scattered over tp."""
        from torch.distributed.tensor import Replicate, distribute_tensor

        gate = self.router.gate
        for name in ("weight", "bias"):
            w = getattr(gate, name)
            if w is not None:
                setattr(gate, name, nn.Parameter(distribute_tensor(w.data, tp_mesh, [Replicate()], src_data_rank=None),
                                                 requires_grad=w.requires_grad))
        self.tp_mesh = tp_mesh
        self.experts.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        tp = self.tp_mesh
        # Under TP every rank routes the same (all-gathered) tokens, but the experts' hidden size is
        # split: the gradients reaching the experts' input rows and the routing weights are partial
        # sums over tp. ``_sum_grad_over`` all-reduces them in the backward (Megatron's "f"), so the
        # input gradient and the router's are whole and alike on every tp rank.
        expert_in = _sum_grad_over(tokens, tp) if tp is not None else tokens
        # The bias always steers the choice: zero unless trained with load_balance "bias" or imported
        # (DeepSeek-V3's e_score_correction_bias); load_balance only decides whether it moves.
        scores, idx, weights = self.router(tokens, self.expert_bias)
        if tp is not None:
            weights = _sum_grad_over(weights, tp)
        # Permute: one fused copy of the token rows into expert order (titan_kernels.moe_permute:
        # tokens in order within an expert); counts (E,) rows per expert.
        rows, routing = titan_kernels.moe_permute(expert_in, idx, a.num_experts)
        counts = routing.counts
        # Count once per micro-batch: not in evaluation, nor when activation checkpointing recomputes
        # this forward inside the backward (a graph task is running then). A compiled block cannot ask
        # that (Dynamo does not trace the query): there a recomputed forward counts again, which scales
        # all of a layer's counts alike - its load (max / mean) and the bias update (the sign of
        # mean - count) do not change.
        counting = self.training and torch.is_grad_enabled() and not _counting_paused
        if counting and not torch.compiler.is_compiling():
            counting = torch._C._current_graph_task_id() == -1
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        routed = self.experts(rows, counts)
        # Unpermute: each (token, expert) output times its weight, summed into the token (one fused pass).
        out = titan_kernels.moe_unpermute(routed, routing, weights).view(bsz, seq, dim)
        if self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Partial, Shard

            # Each tp rank summed over its part of the experts' hidden size: a partial sum, scattered
            # onto the sequence like a rowwise layer's output.
            out = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False).redistribute(
                self.tp_mesh, [Shard(1)]).to_local()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if a.load_balance == "aux_loss" and self.training and torch.is_grad_enabled() and a.aux_loss_coeff > 0:
            aux = a.aux_loss_coeff * sequence_balance_loss(scores, idx, bsz, a.top_k)
            out = _AddAuxLoss.apply(out, aux)
        return out


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    """``(name, MoE)`` of every MoE layer in ``model``, in order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_load_balance(modules: list[tuple[str, MoE]], group=None) -> torch.Tensor | None:
    """After an optimizer step: sum the step's routed counts over ``group`` (the data-parallel ranks,
    None = one process), move the bias of the layers that balance by bias (module docstring), reset
    the counts. One all-reduce for all layers, no host synchronisation.

    Returns the load of each layer, (layers,) float32 on the device: max count / mean count over its
    experts (1.0 = perfectly balanced; ``load_metrics`` names them), or None without MoE layers.
    """
    if not modules:
        return None
    counts = torch.stack([m.tokens_per_expert for _, m in modules])  # (layers, E)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(counts, group=group)
    mean = counts.mean(dim=1, keepdim=True)
    for (_, m), c, mu in zip(modules, counts, mean):
        if m.args.load_balance == "bias" and m.args.bias_update_rate > 0:
            # No step without tokens moves the bias (sign(0 - 0) = 0 anyway).
            m.expert_bias += m.args.bias_update_rate * torch.sign(mu - c)
        m.tokens_per_expert.zero_()
    return counts.max(dim=1).values / mean.squeeze(1).clamp_min(1e-20)


def load_metrics(modules: list[tuple[str, MoE]], load: torch.Tensor | None) -> dict[str, float]:
    """``{"moe_max_load": the largest layer load, "moe_load/<layer>": each layer's}`` from
    ``update_load_balance``'s result (reads it on the host: call at log steps)."""
    if load is None:
        return {}
    values = load.tolist()
    out = {"moe_max_load": max(values)}
    for (name, _), v in zip(modules, values):
        out[f"moe_load/{name.removesuffix('.feed_forward')}"] = v
    return out
