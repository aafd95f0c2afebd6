"""What each transformer block does with its activations: keep them, recompute them, or offload them
to host memory. Torch-free: the trainer (``trainer.parallel.activation_checkpoint``), the memory
estimate and the planner read the same per-layer list.

Per-layer modes:
  none     keep everything autograd saves (``trainer.estimate.memory.block_values_per_token(..., "none")``)
  op       selective per-op checkpointing (matmul and attention outputs kept)
  full     keep the block input, recompute the rest in the backward (+1/3 of the block's FLOPs)
  offload  every saved activation goes to pinned host memory in the forward and comes back one block
           ahead in the backward: 2 x the block's kept bytes over PCIe per micro-batch, hidden while the
           copy of one block takes no longer than the forward compute of the next
           (``trainer.parallel.activation_offload``)

``--activation_checkpoint.per_layer '0-15:offload,16-31:full'`` sets modes by layer;
``--activation_checkpoint.mode budget`` derives them (:func:`budget_modes`), as torchtitan's
keep/recompute/offload proposal does: the last blocks (the first the backward needs) are kept while the
budget allows; of the others, as many as PCIe can carry are offloaded (spread evenly among them) and
the rest recomputed. Timing: a block's copy back overlaps the backward of the block after it (about
2x its forward; prefetch one block ahead), so an offloaded block costs max(0, copy - 2 x forward),
against a recomputed one's forward; the copies out queue behind the forward, so all the offloaded
blocks' copies must fit the whole forward (n_offload x copy <= n_layers x forward).
"""
from __future__ import annotations

from dataclasses import dataclass

LAYER_MODES = ("none", "op", "full", "offload")
# Blocks of device memory offload needs besides the kept ones: the block being copied back for the
# backward (prefetched one ahead) and the one the backward is consuming.
OFFLOAD_STAGING_BLOCKS = 2


def parse_per_layer(rules: list[str], n_layers: int | None = None, key: str = "activation_checkpoint.per_layer"
                    ) -> dict[int, str]:
    """``['0-15:offload', '16:full']`` -> ``{layer id: mode}``.

    Raises:
        ValueError: a rule not ``LAYERS:MODE``, a mode not in ``LAYER_MODES``, a bad or reversed range,
            a layer in two rules, or (with ``n_layers``) a layer id >= n_layers; the message names ``key``.
    """
    out: dict[int, str] = {}
    rule_of: dict[int, str] = {}
    for rule in rules:
        layers, colon, mode = (x.strip() for x in rule.partition(":"))
        if not colon or not layers or not mode:
            raise ValueError(f"--{key}: expected 'LAYERS:MODE' (e.g. '0-15:offload'), got {rule!r}")
        if mode not in LAYER_MODES:
            raise ValueError(f"--{key}: expected a mode of {', '.join(LAYER_MODES)} in {rule!r}, got {mode!r}")
        lo, dash, hi = layers.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--{key}: expected a layer id or a range a-b in {rule!r}, got {layers!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"--{key}: the range {layers!r} in {rule!r} is reversed")
        if n_layers is not None and last >= n_layers:
            raise ValueError(f"--{key}: layer {last} in {rule!r} does not exist (the model has {n_layers} layers)")
        for i in range(first, last + 1):
            if i in rule_of:  # the later rule silently won: say which two disagree or repeat
                raise ValueError(f"--{key}: layer {i} is in both {rule_of[i]!r} and {rule!r}; give each layer one "
                                 f"mode")
            out[i], rule_of[i] = mode, rule
    return out


def base_mode(mode: str, selective_ac_option: str, layer_id: int) -> str:
    """The per-layer mode of ``--activation_checkpoint.mode`` for layer ``layer_id`` (not budget)."""
    if mode in ("none", "full", "offload"):
        return mode
    if mode == "selective":
        if selective_ac_option == "op":
            return "op"
        return "full" if layer_id % int(selective_ac_option) == 0 else "none"
    raise ValueError(f"activation_checkpoint.mode: expected none, full, selective or offload, got {mode!r}")


@dataclass(frozen=True)
class BlockCosts:
    """What :func:`budget_modes` weighs for one block of one micro-batch.

    keep_bytes: device bytes the block keeps without recomputation; full_bytes: with full AC (its
    input); forward_s: its forward compute time (the recomputation's cost, and the window a copy
    hides in); pcie_bytes_per_s: host-device bandwidth per direction (effective).
    """

    keep_bytes: float
    full_bytes: float
    forward_s: float
    pcie_bytes_per_s: float

    @property
    def copy_s(self) -> float:
        return self.keep_bytes / self.pcie_bytes_per_s

    @property
    def offload_exposed_s(self) -> float:
        """Time an offloaded block adds: its copy back beyond the backward of the block after it."""
        return max(0.0, self.copy_s - 2 * self.forward_s)

    @property
    def cheaper_to_offload(self) -> bool:
        return self.offload_exposed_s <= self.forward_s

    def max_offloaded(self, n_layers: int) -> int:
        """How many blocks' copies out fit behind the forward of ``n_layers`` blocks (0 when offloading
        a block costs more than recomputing it)."""
        if not self.cheaper_to_offload:
            return 0
        return n_layers if self.copy_s <= 0 else min(n_layers, int(n_layers * self.forward_s / self.copy_s))


def memory_of(modes: list[str], c: BlockCosts, op_bytes: float = 0.0) -> float:
    """Device bytes of the activations of blocks in ``modes`` (one micro-batch): kept blocks whole,
    checkpointed blocks their input, offloaded ones nothing but ``OFFLOAD_STAGING_BLOCKS`` blocks of
    staging, and one recomputed block alive at a time in the backward."""
    kept = sum(c.keep_bytes if m == "none" else op_bytes if m == "op" else c.full_bytes if m == "full" else 0.0
               for m in modes)
    staging = OFFLOAD_STAGING_BLOCKS * c.keep_bytes if "offload" in modes else 0.0
    recompute = c.keep_bytes if "full" in modes else 0.0
    return kept + max(staging, recompute)


def budget_modes(n_layers: int, budget_bytes: float, c: BlockCosts) -> list[str]:
    """The per-layer modes that fit ``budget_bytes`` of activations at the least time (module docstring).

    The most blocks are kept, from the last one backwards, for which :func:`memory_of` stays within
    the budget; of the others ``BlockCosts.max_offloaded`` are offloaded (evenly spread) and the rest
    recomputed (if offloading's staging does not fit, recomputing all of them is tried).

    Raises:
        ValueError: ``budget_bytes`` below what the cheapest modes need (the message gives that minimum).
    """
    if n_layers < 1:
        raise ValueError(f"n_layers: expected an integer >= 1, got {n_layers}")
    max_off = c.max_offloaded(n_layers)
    for allow_offload in (True, False):  # offloading needs staging: recomputing may fit where it does not
        for kept in range(n_layers, -1, -1):  # the most blocks kept that fit (staging makes it non-monotonic)
            rest = n_layers - kept
            k = min(rest, max_off) if allow_offload else 0
            # k of the rest offloaded, spread evenly so that their copies interleave with compute
            modes = ["offload" if (i + 1) * k // max(rest, 1) > i * k // max(rest, 1) else "full"
                     for i in range(rest)] + ["none"] * kept
            if memory_of(modes, c) <= budget_bytes:
                return modes
    least = memory_of(["full"] * n_layers, c)
    raise ValueError(f"--activation_checkpoint.memory_budget_gib: {budget_bytes / 2**30:.3g} GiB is below the "
                     f"least the activations need ({least / 2**30:.3g} GiB with every block recomputed)")


def describe(modes: list[str]) -> str:
    """``['offload', 'offload', 'none']`` -> ``'0-1:offload,2:none'`` (the per_layer syntax)."""
    out, start = [], 0
    for i in range(1, len(modes) + 1):
        if i == len(modes) or modes[i] != modes[start]:
            span = str(start) if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{span}:{modes[start]}")
            start = i
    return ",".join(out)
