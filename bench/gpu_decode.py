"""The decode timing of bench/run_gpu.sh's headline stage (group ``decode``): our KV-cache generation
loop (``trainer.generate.loop``) at Llama 3 8B's shapes (dim 4096, 32 / 8 heads of 128, FFN 14336,
vocab 128256; cut to ``LAYERS`` layers to fit the stage's time, as the train stage cuts it), bf16,
greedy, at batch 1 and 32, as a fraction of the memory-bandwidth limit.

Decode is memory-bound: a step reads every weight once (for the whole batch) and every sequence's
cached keys and values. The floor of a step is those bytes over the device copy bandwidth measured in
the same run (``bench.common.copy_bandwidth``: read + write bytes of a 1 GiB copy per second); the
fraction reported is floor / measured step time (1.0 = at the bandwidth limit).

``--dry-run`` (the CPU): a debug-size model, a few tokens, the same code path.
"""
from __future__ import annotations

import time

import torch

LAYERS = 4
PROMPT, NEW = 512, 64


def _model(dry: bool, device: torch.device):
    from trainer.models.llama3.args import LLAMA3_FLAVORS
    from trainer.registry import build_model

    if dry:
        args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=258, n_layers=2, max_seq_len=256)
    else:
        args = LLAMA3_FLAVORS["8B"].replace(n_layers=LAYERS, max_seq_len=PROMPT * 32 + NEW + 8)
    model = build_model(args, device=device)
    model.init_weights(0)
    dtype = torch.float32 if dry else torch.bfloat16
    return model.to(dtype).eval(), args, dtype


def decode_timing(deadline: float, notes: list[str], dry: bool) -> dict:
    """Decode tokens/s and share of the bandwidth limit at batch 1 and 32 (module docstring)."""
    from bench import common
    from trainer.generate.loop import Timing, generate

    device = common.device()
    prompt, new = (8, 4) if dry else (PROMPT, NEW)
    model, args, dtype = _model(dry, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = common.copy_bandwidth()
    out = {"shape": f"Llama 3 8B x {args.n_layers} layers, {str(dtype).replace('torch.', '')}, prompt {prompt}, "
                    f"{new} new tokens", "weight_GB": weight_bytes / 1e9, "copy_bandwidth_GBps": bandwidth / 1e9,
           "rows": []}
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in (1, 32):
        if time.perf_counter() > deadline:
            notes.append(f"decode: batch {batch} skipped (the group's time ran out)")
            continue
        prompts = torch.randint(0, args.vocab_size, (batch, prompt), generator=gen, device=device).tolist()
        generate(model, prompts, 2)  # warm-up: kernels chosen, caches allocated once
        t = Timing()
        generate(model, prompts, new, timing=t)
        steps = new - 1
        step_s = t.decode_s / steps
        mean_len = prompt + new / 2
        cache_bytes = 2 * batch * mean_len * args.kv_heads * args.head_dim * args.n_layers * model.output_weight().element_size()
        floor_s = (weight_bytes + cache_bytes) / bandwidth
        row = {"batch": batch, "decode_tokens_per_s": batch * steps / t.decode_s, "step_ms": step_s * 1e3,
               "floor_ms": floor_s * 1e3, "fraction_of_bandwidth_limit": floor_s / step_s,
               "prefill_tokens_per_s": t.prefill_tps}
        out["rows"].append(row)
        notes.append(f"decode batch {batch}: {row['decode_tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.2f} ms per "
                     f"step against a floor of {row['floor_ms']:.2f} ms (weights {weight_bytes / 1e9:.2f} GB + cache "
                     f"{cache_bytes / 1e9:.2f} GB at {bandwidth / 1e9:,.0f} GB/s): "
                     f"{row['fraction_of_bandwidth_limit']:.0%} of the bandwidth limit; prefill "
                     f"{row['prefill_tokens_per_s']:,.0f} tokens/s")
    del model
    return out
