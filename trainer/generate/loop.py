"""The generation loop of a decoder: prefill the prompts without padding (packed into one row, or as
a batch when they have one length), then decode one
token per sequence per step from the KV caches (``trainer.generate.cache``), sampling outside the
model (``trainer.generate.sampler``).

The model is the training model itself (any family built on ``trainer.models.common.decoder.Transformer``,
also under tensor parallel): the loop only installs a cache in each attention layer and asks the
model for its final hidden states (``return_hidden``); the logits of the last position of each
sequence are computed from them, never those of the whole prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from trainer.generate.cache import CacheState
from trainer.generate.kinds import install_caches, remove_caches
from trainer.generate.sampler import SamplingParams, sample


@dataclass
class Completion:
    """One prompt's result: ``ids`` the generated tokens (EOS included when reached), ``logprobs``
    the natural-log probability of each under the model's distribution (before temperature, top-k
    and top-p), ``finish`` "eos", "stop" (a stop condition of the caller) or "length"."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"
    logits: list = field(default_factory=list)  # float32 (vocab,) per token, with ``record_logits``


@dataclass
class Timing:
    """Tokens and seconds of the prefill (prompt tokens) and of the decode (generated tokens after
    the first, which the prefill gives); ``clock`` reads the seconds (wall time; a benchmark on shared
    cores may pass ``time.process_time``, the CPU time this process spent)."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    clock: Callable[[], float] = time.perf_counter

    def add(self, other: "Timing") -> None:
        self.prefill_tokens += other.prefill_tokens
        self.prefill_s += other.prefill_s
        self.decode_tokens += other.decode_tokens
        self.decode_s += other.decode_s

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """float32 (rows, vocab) logits of final-norm ``hidden`` (rows, dim)."""
    w = model.output_weight()
    if hasattr(w, "full_tensor"):  # a tensor-parallel (vocab-split) output projection
        from torch.distributed.tensor import DTensor, Replicate

        # Each rank multiplies by its own vocabulary rows and the logits (rows x vocab) are gathered,
        # not the weight (vocab x dim: 2 GB a token for a 128k x 8k bf16 head).
        mesh = w.device_mesh
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return F.linear(hidden, w).full_tensor().float()
    return F.linear(hidden, w).float()


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = SamplingParams(), *,
             eos_ids: tuple[int, ...] = (), stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None, generator: torch.Generator | None = None,
             timing: Timing | None = None, record_logits: bool = False) -> list[Completion]:
    """Generate up to ``max_new_tokens`` tokens after each prompt (one batch).

    Args:
        model: a decoder (``trainer.models.common.decoder.Transformer`` or a family's subclass), materialized,
            any dtype; its ``args.max_seq_len`` must hold the packed prompts and the longest sequence.
        prompts: token ids, one list per prompt (each at least one token; the caller adds BOS).
        params: the sampling settings (temperature 0 = greedy).
        eos_ids: a sequence ends after generating one of them (it is included in ``ids``).
        stop: ``stop(row, ids) -> bool``, asked after each new token (e.g. a stop string found).
        on_token: ``on_token(row, token)``, called for every new token of an unfinished row (streaming).
        generator: the random generator of the draws (on the model's device).
        timing: accumulates the prefill and decode tokens and seconds.
        record_logits: keep each generated token's float32 logits in ``Completion.logits`` (tests).

    Returns one :class:`Completion` per prompt, in order.

    Raises ValueError for an empty prompt, max_new_tokens < 1 or sequences longer than the model's
    ``max_seq_len``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    lengths = [len(p) for p in prompts]
    device = next(model.parameters()).device
    capacity = max(lengths, default=0) + max_new_tokens
    limit = model.args.max_seq_len
    packed = sum(lengths) if len(set(lengths)) > 1 else 0  # prompts of one length prefill as a batch
    if capacity > limit or packed > limit:
        raise ValueError(f"max_seq_len: the model takes {limit} positions, but this batch needs "
                         f"{max(capacity, packed)} (longest prompt + max_new_tokens, and the packed prompts)")
    state = CacheState(lengths, capacity, device)
    out = [Completion(list(p)) for p in prompts]
    done = [False] * len(prompts)
    t = Timing(clock=timing.clock if timing is not None else time.perf_counter)
    was_hidden, was_training = model.return_hidden, model.training
    model.return_hidden = True
    model.eval()
    install_caches(model, state)
    try:
        _sync(device)
        t0 = t.clock()
        tokens, positions = state.prefill_inputs(prompts)
        hidden = model(tokens, positions)
        logits = _logits(model, state.last_positions(hidden))
        _sync(device)
        t.prefill_tokens, t.prefill_s = sum(lengths), t.clock() - t0
        state.start_decode()
        t0 = t.clock()
        for step in range(max_new_tokens):
            logprobs = torch.log_softmax(logits, dim=-1)
            nxt = sample(logits, params, generator)
            chosen = logprobs.gather(1, nxt[:, None])[:, 0]
            ids, lps = nxt.tolist(), chosen.tolist()
            for b, (tok, lp) in enumerate(zip(ids, lps)):
                if done[b]:
                    continue
                out[b].ids.append(tok)
                out[b].logprobs.append(lp)
                if record_logits:
                    out[b].logits.append(logits[b].clone())
                if on_token is not None:
                    on_token(b, tok)
                if tok in eos_ids:
                    done[b], out[b].finish = True, "eos"
                elif stop is not None and stop(b, out[b].ids):
                    done[b], out[b].finish = True, "stop"
            if all(done) or step == max_new_tokens - 1:
                break
            hidden = model(*state.decode_inputs(nxt))
            state.advance()
            logits = _logits(model, hidden[:, 0])
            t.decode_tokens += sum(not d for d in done)
        _sync(device)
        t.decode_s = t.clock() - t0
    finally:
        remove_caches(model)
        model.return_hidden = was_hidden
        model.train(was_training)
    if timing is not None:
        timing.add(t)
    return out
