"""Qwen3 hyperparameters (dense and mixture-of-experts): ``Qwen3Args``, ``MoEArgs``, the published
flavors and their analytic counts (total and active parameters, FLOPs per token).

Plain Python (no torch), like ``trainer.models.llama_args``, so that the memory estimate and the
planner load fast; ``trainer.models.qwen3`` builds the modules.

Qwen3 (Qwen team, "Qwen3 Technical Report", 2025; the models' config.json) differs from Llama 3 in:
QK-norm (RMSNorm over head_dim on every query and key head, before the rotary), head_dim 128
whatever dim / n_heads is, rope_theta 1e6 without frequency scaling, RMSNorm eps 1e-6, a vocabulary
of 151936, tied embeddings in the 0.6B/1.7B/4B models, no biases. The MoE models (30B-A3B, 235B-A22B)
replace every feed-forward with 128 routed SwiGLU experts, softmax router, top-8 with the top-k
weights renormalised, no shared experts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

QWEN3_VOCAB = 151936
LOAD_BALANCE = ("bias", "aux_loss", "none")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (``trainer.models.moe.MoE``).

    num_experts routed SwiGLU experts of hidden size ``hidden_dim``; each token goes to ``top_k`` of
    them (token choice). ``score_func``: softmax (Qwen3) or sigmoid (DeepSeek-V3) router scores;
    ``route_norm``: the top-k weights renormalised to sum to 1; ``route_scale`` multiplies them.
    ``num_shared_experts``: experts every token goes through (DeepSeek-V3 style; one SwiGLU of
    hidden ``num_shared_experts * hidden_dim``), 0 for Qwen3.

    ``load_balance``: "bias" = auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664):
    a per-expert bias added to the scores for the top-k choice only, moved by
    ``bias_update_rate * sign(mean load - load)`` after each optimizer step; "aux_loss" = the
    sequence-wise auxiliary loss of DeepSeek-V3 (sec. 2.1.2) with weight ``aux_loss_coeff``; "none".
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    num_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance: str = "bias"
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEArgs.{name}: expected an integer >= 1, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArgs.top_k: expected at most num_experts={self.num_experts}, got {self.top_k}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEArgs.num_shared_experts: expected an integer >= 0, got {self.num_shared_experts!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEArgs.score_func: expected one of {', '.join(SCORE_FUNCS)}, got {self.score_func!r}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(
                f"MoEArgs.load_balance: expected one of {', '.join(LOAD_BALANCE)}, got {self.load_balance!r}")
        if not self.bias_update_rate >= 0 or not self.aux_loss_coeff >= 0:
            raise ValueError(f"MoEArgs: bias_update_rate and aux_loss_coeff must be >= 0, got "
                             f"{self.bias_update_rate!r}, {self.aux_loss_coeff!r}")

    def replace(self, **changes) -> "MoEArgs":
        return dataclasses.replace(self, **changes)

    # -- counts of one MoE layer of model width ``dim`` --

    def router_params(self, dim: int) -> int:
        return dim * self.num_experts

    def expert_params(self, dim: int) -> int:
        """The routed experts' weights (w1, w2, w3 of every expert)."""
        return self.num_experts * 3 * dim * self.hidden_dim

    def shared_params(self, dim: int) -> int:
        return 3 * dim * self.hidden_dim * self.num_shared_experts

    def total_params(self, dim: int) -> int:
        return self.router_params(dim) + self.expert_params(dim) + self.shared_params(dim)

    def active_params(self, dim: int) -> int:
        """Weights one token uses: the router, its top_k experts and the shared experts."""
        return self.router_params(dim) + self.top_k * 3 * dim * self.hidden_dim + self.shared_params(dim)


@dataclass(frozen=True)
class Qwen3Args:
    """Hyperparameters of a Qwen3 model; the same interface as ``ModelArgs`` (Llama) where they agree.

    ``hidden_dim``: the dense SwiGLU hidden size (intermediate_size); unused in MoE layers.
    ``moe``: MoEArgs, or None for a dense model; with it every layer is a MoE layer (Qwen3's
    decoder_sparse_step = 1), except the first ``n_dense_layers``. ``vocab_size = -1``: from the
    tokenizer (the debug flavors).
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int = 128
    hidden_dim: int = 3072
    vocab_size: int = QWEN3_VOCAB
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    init_std: float = 0.02
    depth_init: bool = True
    moe: MoEArgs | None = None
    n_dense_layers: int = 0

    name = "qwen3"  # the --model.name of this family (a class attribute, not a field)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # read back from a checkpoint's JSON record
            object.__setattr__(self, "moe", MoEArgs(**self.moe))
        for name in ("dim", "n_layers", "n_heads", "head_dim", "hidden_dim", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen3Args.{name}: expected an integer >= 1, got {v!r}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Args.head_dim: must be even for rotary, got {self.head_dim}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"Qwen3Args.n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.vocab_size != -1 and self.vocab_size < 1:
            raise ValueError(f"Qwen3Args.vocab_size: expected -1 (from the tokenizer) or >= 1, got {self.vocab_size}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"Qwen3Args.n_dense_layers: expected 0..{self.n_layers}, got {self.n_dense_layers}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has a mixture-of-experts feed-forward."""
        return self.moe is not None and layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return 0 if self.moe is None else self.n_layers - self.n_dense_layers

    def replace(self, **changes) -> "Qwen3Args":
        return dataclasses.replace(self, **changes)

    # -- analytic counts (no model needed; trainer.estimate, the planner and the MFU) --

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def attention_params(self) -> int:
        q = self.n_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return 2 * self.dim * q + 2 * self.dim * kv + (2 * self.head_dim if self.qk_norm else 0)

    def dense_layer_params(self) -> int:
        return self.attention_params() + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def layer_params(self) -> int:
        """Parameters of one block (a MoE block when the model has any; all its experts)."""
        if self.moe is None:
            return self.dense_layer_params()
        return self.attention_params() + self.moe.total_params(self.dim) + 2 * self.dim

    def active_layer_params(self) -> int:
        """Parameters one token uses in a block (a MoE block: router, top_k experts, shared experts)."""
        if self.moe is None:
            return self.dense_layer_params()
        return self.attention_params() + self.moe.active_params(self.dim) + 2 * self.dim

    def expert_params(self) -> int:
        """All routed-expert weights of the model (what expert parallel splits)."""
        return 0 if self.moe is None else self.n_moe_layers * self.moe.expert_params(self.dim)

    def _count(self, per_moe_layer: int) -> int:
        self._need_vocab()
        out = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        layers = self.n_dense_layers * self.dense_layer_params() + self.n_moe_layers * per_moe_layer \
            if self.moe is not None else self.n_layers * self.dense_layer_params()
        return self.embedding_params() + layers + self.dim + out

    def num_params(self) -> int:
        """Total trainable parameters (the tied output weight counted once)."""
        return self._count(self.layer_params())

    def active_params(self) -> int:
        """Parameters one token uses (= num_params for a dense model); the 'A3B' of 30B-A3B."""
        return self._count(self.active_layer_params())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6*N_active + 6*n_layers*n_heads*2*head_dim*seq_len`` (torchtitan's
        formula with the active parameters: a token multiplies only by its experts' weights).

        N_active excludes the input embedding (a lookup) unless it is tied to the output.
        """
        n = self.active_params() - (0 if self.tie_word_embeddings else self.embedding_params())
        return 6 * n + 6 * self.n_layers * self.n_heads * 2 * self.head_dim * seq_len

    def _need_vocab(self) -> None:
        if self.vocab_size < 1:
            raise ValueError("Qwen3Args.vocab_size: not set; take it from the tokenizer first")


def _moe(num_experts: int, top_k: int, hidden_dim: int, **kw) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax",
                   route_norm=True, **kw)


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # Small enough for our CPU: head_dim 32 (not 128) keeps attention cheap; vocab from the tokenizer.
    "debugmodel": Qwen3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768,
                            vocab_size=-1),
    "debugmodel_moe": Qwen3Args(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768,
                                vocab_size=-1, moe=_moe(8, 2, 256)),
    # Qwen/Qwen3-*/config.json
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe=_moe(128, 8, 768)),
    "235B-A22B": Qwen3Args(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                           moe=_moe(128, 8, 1536)),
}


def qwen3_model_args(flavor: str, vocab_size: int, max_seq_len: int) -> Qwen3Args:
    """The flavor's Qwen3Args for a tokenizer of ``vocab_size`` tokens and sequences up to ``max_seq_len``
    (the debug flavors take the tokenizer's vocabulary; the others keep 151936 and reject a larger one).

    Raises ValueError: unknown flavor, a tokenizer larger than the embedding, bad sizes.
    """
    if flavor not in QWEN3_FLAVORS:
        raise ValueError(f"flavor: expected one of {', '.join(QWEN3_FLAVORS)} for qwen3, got {flavor!r}")
    args = QWEN3_FLAVORS[flavor]
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected an integer >= 1, got {vocab_size!r}")
    if args.vocab_size == -1:
        args = args.replace(vocab_size=vocab_size)
    elif vocab_size > args.vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {vocab_size} tokens but flavor {flavor!r} has an embedding "
                         f"of {args.vocab_size}; use the model's own tokenizer")
    return args.replace(max_seq_len=max_seq_len)


def format_params(args) -> str:
    """``30.53e9 parameters (3.35e9 active)`` for a MoE model, ``8.19e9 parameters`` for a dense one."""
    total = args.num_params()
    active = getattr(args, "active_params", None)
    exp = 9 if total >= 1e9 else 6  # the debug flavors in millions
    text = f"{total / 10**exp:.2f}e{exp} parameters"
    if active is not None and active() != total:
        text += f" ({active() / 10**exp:.2f}e{exp} active)"
    return text
