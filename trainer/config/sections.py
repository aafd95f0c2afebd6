"""The configuration's sections: one dataclass per ``[section]`` of a TOML file, each field with its
default, its help text and, for strings, the allowed values; and :class:`ConfigError`.

This is the bottom of the package (DESIGN.md section 1): it imports nothing else of it, and no torch.
:class:`trainer.config.job.JobConfig` gathers the sections into one run's configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from trainer.errors import ConfigError  # noqa: F401  (defined on the ground floor)

__all__ = [
    "ConfigError", "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "FaultTolerance", "Float8", "Job",
    "Kernels", "LRScheduler", "Metrics", "Model", "Optimizer", "Parallelism", "Profiling", "Training", "Validation",
    "Flux",
]


def _opt(default: Any, help: str, choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None) -> Any:
    """A config field with its help text (and, for strings, the allowed values: a tuple, or a
    function returning them when they come from a registry)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _families() -> tuple[str, ...]:
    """The registered model families (read when needed: the registry is torch-free but not tiny)."""
    from trainer import registry

    return registry.names()


@dataclass
class Job:
    """Where the run writes its outputs."""

    dump_folder: str = _opt("./outputs", "Folder for metrics.jsonl, TensorBoard logs and checkpoints.")
    description: str = _opt("", "Free-text description of the run, printed at start.")
    print_config: bool = _opt(False, "Print the resolved configuration (as TOML) before training.")


@dataclass
class Model:
    """Which model to build."""

    name: str = _opt("llama3", "Model family (the registered families, trainer.registry).",
                     choices=_families)
    flavor: str = _opt(
        "debugmodel",
        "Model size: a flavor of the family with a file trainer/configs/<family>/<flavor>.toml (the list is in "
        "the --flavor line above), or custom with a Hugging Face folder (--checkpoint.initial_load_in_hf). "
        "Also --flavor.",
    )
    tokenizer_path: str = _opt(
        "",
        "Tokenizer file: a Hugging Face tokenizer.json, a tiktoken BPE file (Llama 3's tokenizer.model) "
        "or a SentencePiece .model, detected from the file (or a folder holding one). Empty = model.hf_assets_path's, "
        "else the built-in byte-level tokenizer.",
    )
    hf_assets_path: str = _opt(
        "",
        "A Hugging Face model folder (torchtitan's key): its tokenizer when model.tokenizer_path is empty, and its "
        "weights and config.json with --checkpoint.initial_load_in_hf when checkpoint.initial_load_path is empty.",
    )
    converters: list[str] = _opt(
        [], "Model converters applied before training (torchtitan's key): float8 = --float8.enable (comma-separated).",
    )
    moe_load_balance: str = _opt(
        "bias",
        "MoE flavors: expert load balancing. bias = auxiliary-loss-free (per-expert routing bias moved after "
        "each step from the token counts); aux_loss = sequence-wise auxiliary loss; none.",
        choices=("bias", "aux_loss", "none"),
    )
    moe_bias_update_rate: float = _opt(1e-3, "MoE flavors, load_balance bias: the bias step per optimizer step.")
    moe_aux_loss_coeff: float = _opt(1e-3, "MoE flavors, load_balance aux_loss: the weight of the loss.")
    mtp_layers: int = _opt(
        -1, "Multi-token prediction modules (deepseek_v3): -1 = the flavor's, 0 = none (the model alone), N = N modules "
        "predicting tokens t+2..t+N+1.")


@dataclass
class Training:
    """Batch shape, data and the length of the run."""

    steps: int = _opt(300, "Number of optimizer steps.")
    local_batch_size: int = _opt(8, "Sequences per micro-batch on each data-parallel rank.")
    global_batch_size: int = _opt(
        -1,
        "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. "
        "A multiple of that gives gradient accumulation.",
    )
    seq_len: int = _opt(256, "Tokens per training sequence.")
    max_norm: float = _opt(1.0, "Clip the global gradient norm to this value.")
    dataset: str = _opt(
        "pydoc",
        "Dataset name: 'pydoc' = the embedded English corpus shipped with Python (offline); 'c4_test' = a small "
        "sample in C4's layout shipped with the trainer (torchtitan's debug dataset name; public-domain text); "
        "'c4' or another Hugging Face dataset name (needs the network and the 'datasets' package).",
    )
    dataset_path: str = _opt(
        "", "A local .txt, .jsonl ('text' field) or .parquet ('text' column) file or folder; overrides dataset."
    )
    seed: int = _opt(42, "Random seed for weights and data order.")
    deterministic: bool = _opt(False, "Use deterministic algorithms only (slower on GPU).")
    dtype: str = _opt(
        "auto",
        "Training precision: auto = float32 on CPU, bfloat16 parameters (FSDP2 mixed precision) on GPU.",
        choices=("auto", "float32", "bfloat16"),
    )
    mixed_precision_param: str = _opt(
        "bfloat16", "Parameter dtype for compute under FSDP2 mixed precision.", choices=("bfloat16", "float32")
    )
    mixed_precision_reduce: str = _opt(
        "float32", "Gradient reduce dtype under FSDP2 mixed precision.", choices=("float32", "bfloat16")
    )
    document_masking: bool = _opt(False, "Mask attention across document boundaries inside a packed sequence.")
    mtp_loss_weight: float = _opt(
        0.3, "Multi-token prediction: the weight (lambda) of the MTP modules' mean loss beside the main loss "
        "(DeepSeek-V3 used 0.3, then 0.1); logged apart as mtp_loss.")
    gc_freq: int = _opt(50, "Run Python garbage collection every this many steps.")
    enable_cpu_offload: bool = _opt(
        False, "FSDP2 CPU offload (torchtitan's key): sharded parameters, gradients and optimizer states live in host "
        "memory, the model is initialised on the CPU and the optimizer step runs there (titan's fused_adamw_, "
        "Muon's Newton-Schulz); each block's weights cross PCIe every step (trainer/parallel/cpu_offload.py).")
    pcie_bandwidth_gbps: float = _opt(
        64.0, "Host-device bandwidth per direction in GB/s (nominal; 64 = PCIe Gen5 x16) that the memory check, "
        "activation_checkpoint.mode budget and the planner cost CPU and activation offload with.")


@dataclass
class Optimizer:
    """The optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest (trainer/optim)."""

    name: str = _opt(
        "AdamW",
        "Optimizer. adamw (AdamW is the same); muon = Muon for the 2-D hidden weights and MoE experts (per "
        "expert), AdamW for embedding, output, norms, biases and routers (see optimizer.groups).",
        choices=("AdamW", "adamw", "muon"),
    )
    lr: float = _opt(8e-4, "Peak learning rate.")
    beta1: float = _opt(0.9, "Adam beta1.")
    beta2: float = _opt(0.95, "Adam beta2.")
    eps: float = _opt(1e-8, "Adam epsilon.")
    weight_decay: float = _opt(0.1, "Decoupled weight decay.")
    implementation: str = _opt(
        "auto",
        "AdamW implementation: auto = torch's fused where available (titan's fused_adamw_ when Muon, groups or "
        "bfloat16 states need titan's optimizer), titan = titan_kernels.fused_adamw_, fused/foreach/for-loop = "
        "torch.optim.AdamW's.",
        choices=("auto", "titan", "fused", "foreach", "for-loop"),
    )
    state_dtype: str = _opt(
        "float32",
        "Dtype of AdamW's exp_avg/exp_avg_sq and Muon's momentum; bfloat16 halves the optimizer state "
        "(stochastic rounding for AdamW's states).",
        choices=("float32", "bfloat16"),
    )
    muon_momentum: float = _opt(0.95, "Muon momentum (an EMA of the gradients, as torch.optim.Muon).")
    muon_nesterov: bool = _opt(True, "Muon: Nesterov momentum.")
    muon_ns_steps: int = _opt(5, "Muon: Newton-Schulz iterations.")
    muon_ns_dtype: str = _opt(
        "auto", "Muon: dtype of the Newton-Schulz iteration; auto = bfloat16 on GPUs, float32 on the CPU.",
        choices=("auto", "float32", "bfloat16"),
    )
    muon_rms_match: float = _opt(
        0.2,
        "Muon: update scale = this x sqrt(max(rows, cols)), which gives the update AdamW's RMS so lr and "
        "weight_decay carry over (Liu et al. 2025, Moonlight).",
    )
    qk_clip_threshold: Optional[float] = _opt(
        None,
        "QK-clip (MuonClip): after each step, rescale W_q/W_k of every head whose max attention logit exceeds "
        "this (Kimi K2 uses 100); the max logit is bounded by the attention's log-sum-exp. none = off.",
    )
    groups: list[str] = _opt(
        [],
        "Per-group rules, applied in order (later rules override earlier ones): 'SELECTOR: key=value ...' with "
        "SELECTOR a kind (embedding, output, norm, bias, router, expert, hidden, other) or a glob over parameter names, "
        "keys optimizer (adamw|muon), lr_multiplier, weight_decay; e.g. 'embedding: optimizer=adamw "
        "lr_multiplier=0.5, norm: weight_decay=0'. A TOML [optimizer.groups] table maps SELECTOR to an inline table.",
    )


@dataclass
class LRScheduler:
    """Linear warmup, then decay."""

    warmup_steps: int = _opt(30, "Steps of linear warmup; the first step's LR is already > 0.")
    decay_ratio: Optional[float] = _opt(
        None,
        "Fraction of steps that decay (wsd: warmup-stable-decay). none = decay over all steps after warmup.",
    )
    decay_type: str = _opt("linear", "Decay shape after warmup.", choices=("linear", "cosine", "wsd"))
    min_lr_factor: float = _opt(0.1, "Final LR as a fraction of optimizer.lr.")


@dataclass
class Parallelism:
    """Parallel layout: data (FSDP2/HSDP), tensor + sequence, pipeline and context parallel (trainer/parallel/README.md)."""

    data_parallel_replicate_degree: int = _opt(1, "Replicas (HSDP outer dimension; 1 = plain FSDP).")
    data_parallel_shard_degree: int = _opt(-1, "FSDP shard degree; -1 = the rest of the world size.")
    fsdp_reshard_after_forward: str = _opt(
        "default",
        "Free each block's gathered parameters after its forward (FSDP2's reshard_after_forward; the backward "
        "gathers them again): default = yes except under pipeline parallel, always, never (more memory, less "
        "communication). The root module (embedding, output) always stays gathered for the loss.",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = _opt(1, "Tensor + sequence parallel degree (heads, FFN and vocab split).")
    enable_async_tensor_parallel: bool = _opt(
        False, "Overlap TP communication with the matmuls (CUDA symmetric memory; needs compile.enable)."
    )
    disable_loss_parallel: bool = _opt(
        False, "Under TP, gather the logits before the loss instead of a cross-entropy on vocab-sharded logits."
    )
    pipeline_parallel_degree: int = _opt(1, "Pipeline parallel degree (ranks holding successive stages).")
    pipeline_parallel_schedule: str = _opt(
        "1F1B", "Pipeline schedule (torch.distributed.pipelining); Interleaved*/ZBV hold 2 stages per rank.",
        choices=("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
    )
    pipeline_parallel_split_points: list[str] = _opt(
        [], "Stage boundaries as the first layer of each later stage, e.g. layers.3 (comma-separated); "
        "empty = layers split evenly.",
    )
    pipeline_parallel_microbatch_size: int = _opt(
        1, "Sequences per pipeline micro-batch; local_batch_size must be a multiple of it."
    )
    context_parallel_degree: int = _opt(
        1, "Context parallel degree: every sequence is split over this many ranks (ring attention)."
    )
    expert_parallel_degree: int = _opt(
        1, "Expert parallel degree (MoE flavors): the experts split over this many data-parallel ranks, tokens "
        "sent to them by all-to-all; must divide data_parallel_shard_degree.",
    )


@dataclass
class Checkpoint:
    """Saving and resuming."""

    enable: bool = _opt(False, "Save checkpoints and resume from the newest complete one.")
    folder: str = _opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = _opt(500, "Save every this many steps (and at the end).")
    keep_latest_k: int = _opt(0, "Keep only the newest k checkpoints; 0 = keep all.")
    async_mode: str = _opt("disabled", "Write checkpoints in the background.", choices=("disabled", "async"))
    load_step: int = _opt(-1, "Resume from this step's checkpoint; -1 = the newest.")
    model_weights_only: bool = _opt(False, "Final save holds only the model weights (an export).")
    export_dtype: str = _opt(
        "float32", "Weight dtype of a model-weights-only export.", choices=("float32", "bfloat16")
    )
    create_seed_checkpoint: bool = _opt(
        False, "Write the initial weights as step 0 on one process, then exit."
    )
    initial_load_path: str = _opt(
        "", "Start from this checkpoint when the checkpoint folder has none to resume: a DCP checkpoint or "
        "step folder, or a Hugging Face Llama / Qwen3 / Qwen3-MoE folder (with initial_load_in_hf)."
    )
    initial_load_model_only: bool = _opt(
        True, "From initial_load_path take the model weights only (start at step 0); false = the whole "
        "training state (DCP only)."
    )
    initial_load_in_hf: bool = _opt(
        False, "initial_load_path is a Hugging Face Llama, Qwen3 or Qwen3-MoE folder (safetensors + config.json)."
    )
    last_save_in_hf: bool = _opt(
        False, "The final save is a Hugging Face folder hf-step-<N> (in export_dtype) that transformers' "
        "from_pretrained loads (LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM, by model.name)."
    )
    strict_verify: bool = _opt(
        False, "A damaged, truncated or unverifiable checkpoint to resume from is an error instead of a warning and "
        "a fall back to the newest intact one (every step folder holds manifest.json: sizes and xxh3 checksums)."
    )
    on_save_error: str = _opt(
        "stop", "When a save fails (e.g. a full disk; its .partial folder is removed): stop the run (exit 1), or "
        "continue training without that checkpoint (the last step's save always stops).",
        choices=("stop", "continue"),
    )
    preempt_signals: list[str] = _opt(
        ["SIGTERM", "SIGUSR1"], "Signals that stop the run gracefully: the ranks agree on a step, save a checkpoint "
        "there and exit with status 75 (Slurm: #SBATCH --signal=USR1@90). Empty = the default actions."
    )
    preempt_grace_seconds: float = _opt(
        80.0, "After a preemption signal the run exits within this many seconds: with the checkpoint saved "
        "(status 75) or, if the save cannot finish in time, at once with the last good one intact (status 124)."
    )


@dataclass
class Metrics:
    """Logging."""

    log_freq: int = _opt(10, "Log metrics every this many steps.")
    enable_tensorboard: bool = _opt(False, "Also write TensorBoard logs.")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, relative to job.dump_folder.")
    enable_wandb: bool = _opt(
        False, "Also log to Weights & Biases (the wandb package; offline unless WANDB_MODE=online)."
    )
    wandb_project: str = _opt("titan-kernels", "Weights & Biases project (WANDB_PROJECT overrides).")
    save_wandb_folder: str = _opt("wandb", "Weights & Biases run folder, relative to job.dump_folder.")
    enable_color: bool = _opt(True, "Colored console output.")
    save_plot: bool = _opt(
        True, "At the end, draw metrics.jsonl (loss, validation loss, LR, tokens/s, memory) to dump_folder/metrics.png."
    )


@dataclass
class Validation:
    """Validation loss: the mean token loss on held-out text, every freq steps and at the end."""

    enable: bool = _opt(False, "Evaluate the validation loss and perplexity during training.")
    freq: int = _opt(100, "Evaluate every this many steps (and at the last step).")
    # Bounded by default: the whole held-out split took 36-66 s per evaluation against seconds per step.
    # torchtitan's dataclass default is -1, but its configs bound it: 10 in its debug model's config
    # (freq 5), 1200 in llama3_8b's; 10 batches cost about as much as 3-4 training steps.
    steps: int = _opt(10, "Batches per evaluation; -1 = the whole validation split (one pass).")
    dataset: str = _opt(
        "", "Validation dataset name, as training.dataset; empty (and no dataset_path) = a held-out part of the "
        "training source (see split_every)."
    )
    dataset_path: str = _opt("", "A local validation file or folder, as training.dataset_path; overrides dataset.")
    local_batch_size: int = _opt(-1, "Sequences per validation batch on each data-parallel rank; -1 = training's.")
    seq_len: int = _opt(-1, "Tokens per validation sequence; -1 = training.seq_len (it may not be longer).")
    split_every: int = _opt(
        50, "Without a validation dataset: every N-th document of the training source is held out for "
        "validation and never trained on (1 in 50 = 2%)."
    )
    sample_prompts: list[str] = _opt(
        [], "Prompts completed (greedy, KV cache) at each validation and at the end of training; printed and "
        "written to metrics.jsonl and TensorBoard as text. Empty (default) = none."
    )
    sample_max_new_tokens: int = _opt(48, "Tokens generated per sample prompt at most.")


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = _opt(False, "Record a torch.profiler trace every profile_freq steps.")
    profile_freq: int = _opt(10, "Profile the last profiler_active of every this many steps.")
    profiler_warmup: int = _opt(3, "Steps the profiler warms up (runs, records nothing) before the active ones.")
    profiler_active: int = _opt(1, "Steps recorded in each trace.")
    save_traces_folder: str = _opt(
        "profile_trace", "Trace folder, relative to job.dump_folder: iteration_<step>/rank<r>_trace.json (Chrome "
        "trace: chrome://tracing or Perfetto)."
    )
    include_validation: bool = _opt(
        False, "Trace the validation passes too; by default the profiler pauses while the validation runs."
    )
    enable_memory_snapshot: bool = _opt(
        False, "Record CUDA allocations and write a memory snapshot every profile_freq steps (and on out-of-memory)."
    )
    save_memory_snapshot_folder: str = _opt(
        "memory_snapshot", "Snapshot folder, relative to job.dump_folder: iteration_<step>/rank<r>_memory_snapshot.pickle "
        "(open with pytorch.org/memory_viz)."
    )


@dataclass
class ActivationCheckpoint:
    """Recompute activations in the backward pass to save memory."""

    mode: str = _opt(
        "none", "Activation checkpointing mode: none, full (recompute every block), selective (see "
        "selective_ac_option), offload (every block's saved activations to pinned host memory, back one block ahead "
        "in the backward), budget (each block kept, offloaded or recomputed to fit memory_budget_gib).",
        choices=("none", "full", "selective", "offload", "budget"))
    selective_ac_option: str = _opt(
        "2", "For selective: an integer N = every N-th layer; 'op' = per op, keeping matmul outputs."
    )
    per_layer: list[str] = _opt(
        [], "Per-layer overrides 'LAYERS:MODE' (comma-separated), LAYERS a layer id or a range a-b, MODE none, full, "
        "op or offload; e.g. '0-15:offload,16-31:full'. Layers not named follow mode.")
    memory_budget_gib: float = _opt(
        0.0, "mode budget: the activation memory per device (GiB) to fit; the last blocks are kept, earlier ones "
        "offloaded while PCIe keeps up with their compute, the rest recomputed (trainer/config/activation_policy.py).")


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = _opt(False, "Compile the components below with torch.compile.")
    components: list[str] = _opt(["model", "loss"], "What to compile: model, loss (comma-separated).")
    backend: str = _opt(
        "inductor", "torch.compile backend; aot_eager traces the same graphs without generating code.",
        choices=("inductor", "aot_eager", "eager"),
    )


@dataclass
class Kernels:
    """Which titan_kernels implementation runs."""

    backend: str = _opt(
        "auto",
        "Kernel backend passed to titan_kernels.use_backend.",
        choices=("auto", "reference", "triton", "cpu", "cuda"),
    )


@dataclass
class Float8:
    """Float8 training of the Linear layers (float8 GEMMs run at twice the bf16 rate on H100/H200)."""

    enable: bool = _opt(False, "Train the Linear layers with float8 GEMMs (forward, grad_input, grad_weight).")
    recipe: str = _opt(
        "tensorwise",
        "Scaling recipe (torchao's meanings): tensorwise (fastest), rowwise, rowwise_with_gw_hp "
        "(grad_weight in high precision).",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    impl: str = _opt(
        "titan", "Float8Linear implementation: titan (ours) or torchao (needs torchao installed).",
        choices=("titan", "torchao"),
    )
    filter_fqns: list[str] = _opt(
        ["output"], "Keep Linear layers whose name contains one of these in high precision (comma-separated)."
    )
    auto_filter_small_kgemms: bool = _opt(
        True, "Also keep in high precision the layers too small to gain from float8 (see trainer/float8.py)."
    )
    enable_fsdp_float8_all_gather: bool = _opt(
        False, "FSDP2 all-gathers weights in float8 (1 byte per element); tensorwise recipe only."
    )


@dataclass
class Comm:
    """Process-group timeouts and the step watchdog (torchtitan's [comm] keys)."""

    init_timeout_seconds: int = _opt(
        300, "Timeout of the process group's collectives until the first step is done (start-up, loading)."
    )
    train_timeout_seconds: int = _opt(
        100, "After the first step: the collectives' timeout, and the watchdog's: a step, validation or checkpoint "
        "save that makes no progress for this long writes every rank's Python stacks to "
        "<dump_folder>/stacks/ and exits 1, so that the launcher can restart the group. 0 = no watchdog."
    )


@dataclass
class FaultTolerance:
    """Replica groups that survive the loss of one another (torchft; torchtitan's experiment keys)."""

    enable: bool = _opt(
        False, "Train as one replica group of several, joined through a torchft Lighthouse (its address in "
        "TORCHFT_LIGHTHOUSE): every step commits through the quorum, a dead group is dropped and a restarted one "
        "recovers the live state from a peer. Needs the torchft package (pip install -e '.[ft]')."
    )
    replica_id: int = _opt(0, "This replica group's index, 0 .. group_size - 1.")
    group_size: int = _opt(0, "The number of replica groups (each a torchrun of its own).")
    min_replica_size: int = _opt(1, "The fewest replica groups that may commit a step.")
    process_group: str = _opt("gloo", "Backend between the replica groups.", choices=("gloo", "nccl"))
    process_group_timeout_ms: int = _opt(10000, "Timeout of a collective between replica groups, in milliseconds.")
    lighthouse_timeout_seconds: float = _opt(
        30.0, "How long to wait for the Lighthouse (TORCHFT_LIGHTHOUSE) to answer at start-up before the run stops "
        "with one line naming its address.")


@dataclass
class Flux:
    """Flux (``--model.name flux``): frozen encoders, image data, the rectified-flow training and the
    samples written at each validation. Read by ``trainer.models.flux`` only."""

    pipeline_path: str = _opt(
        "", "A local FluxPipeline folder (save_pretrained): its text_encoder (CLIP), text_encoder_2 (T5), vae "
        "and tokenizers are the frozen encoders unless t5_encoder / clip_encoder / autoencoder_path name others.")
    t5_encoder: str = _opt("", "A local T5EncoderModel folder (with its tokenizer); empty = a tiny random T5 built "
                           "from a config (debug flavor only).")
    clip_encoder: str = _opt("", "A local CLIPTextModel folder (with its tokenizer); empty = a tiny random CLIP "
                             "built from a config (debug flavor only).")
    autoencoder_path: str = _opt("", "A local diffusers AutoencoderKL folder (16 latent channels); empty = pixel-space "
                                 "2x2 patches (flavors with vae_scale 1: debugmodel).")
    encode_cache: str = _opt("", "A folder keeping the encoders' outputs (text encodings, image latents), computed "
                             "once and reused by later epochs and runs; empty = encode every time.")
    img_size: int = _opt(32, "Training images are resized and center-cropped to img_size x img_size pixels.")
    caption_dropout: float = _opt(0.1, "Probability of training a sample on the empty caption (classifier-free "
                                  "guidance).")
    guidance: float = _opt(3.5, "The guidance scale given to guidance-distilled flavors (flux-dev) in training and "
                           "sampling.")
    timestep_sampling: str = _opt("logit_normal", "Training timesteps: logit_normal (SD3 / FLUX.1) or uniform.",
                                  choices=("logit_normal", "uniform"))
    logit_mean: float = _opt(0.0, "Mean of the logit-normal timestep distribution.")
    logit_std: float = _opt(1.0, "Standard deviation of the logit-normal timestep distribution.")
    time_shift: bool = _opt(True, "Shift the timesteps towards noise by the image token count (FLUX.1's "
                            "resolution-dependent shift; sampling uses the same).")
    sample_steps: int = _opt(16, "Euler steps of the sample images written at each validation.")
    sample_count: int = _opt(4, "Sample images written at each validation (the first validation captions).")
    sample_cfg_scale: float = _opt(1.0, "True classifier-free guidance of the validation samples against the empty "
                                   "caption (1 = off; flavors without distilled guidance follow their captions "
                                   "better above 1).")
