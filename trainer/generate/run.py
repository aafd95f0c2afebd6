"""One ``python -m trainer.generate`` run of a text decoder: load the checkpoint and the tokenizer
(``trainer.generate.load``), tokenize the prompts (BOS first, as training), generate batch by batch
(``trainer.generate.loop``), stream, print or write JSON lines, report tokens/s."""
from __future__ import annotations

import contextlib
import json
import logging
import sys

from trainer.environment import destroy_distributed, env_int, init_distributed, resolve_compute_dtype, setup_logging

import torch

import titan_kernels
from trainer.errors import CheckpointError
from trainer.generate.load import load_tokenizer, materialize, resolve_source, source_args
from trainer.generate.loop import Timing, generate
from trainer.generate.sampler import SamplingParams
from trainer.registry import family_of

logger = logging.getLogger("trainer")


class Streamer:
    """Prints one row's text as its tokens come (``on_token``), holding back a partial UTF-8 character."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode([t for t in self.ids if t != self.tokenizer.eos_id])
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def finish(self, final: str) -> None:
        """End the stream with the final completion text (a stop string cut off is not taken back)."""
        if len(final) > self.shown:
            self.out.write(final[self.shown:])
        self.out.write("\n")
        self.out.flush()


def completion_text(tokenizer, ids: list[int], stops: list[str]) -> str:
    """The text of generated ``ids`` without EOS, cut before the first stop string."""
    text = tokenizer.decode([t for t in ids if t != tokenizer.eos_id])
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """BOS + the prompt's tokens, as the loader starts every training document."""
    return [[tokenizer.bos_id, *tokenizer.encode(p)] for p in prompts]


def _tp_mesh(config, world: int, device: torch.device):
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    tp = config.parallelism.tensor_parallel_degree
    if tp != world:
        raise ValueError(f"--parallelism.tensor_parallel_degree: generation splits the model over all {world} ranks "
                         f"(tensor parallel); pass {world}, got {tp}")
    init_distributed(world, env_int("RANK", 0), device, single_process_group=False)
    return init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))


def run_decoder(config, options) -> int:
    """Generate for ``options.prompt`` with the decoder ``config`` names (``trainer.generate.cli``)."""
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    setup_logging(rank)
    for handler in logger.handlers:  # stdout is the text (or --json's lines) alone: the log goes to stderr
        handler.setStream(sys.stderr)
    device = torch.device("cuda", env_int("LOCAL_RANK", 0)) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    lead = rank == 0
    mesh, need = None, options.max_new_tokens
    try:
        params = SamplingParams(options.temperature, options.top_k, options.top_p)
        source = resolve_source(config)
        tokenizer = load_tokenizer(config, source)
        prompts = encode_prompts(tokenizer, options.prompt)
        batches = [list(range(i, min(i + options.batch_size, len(prompts))))
                   for i in range(0, len(prompts), options.batch_size)]
        need = max(max(max(len(prompts[i]) for i in b) + options.max_new_tokens, sum(len(prompts[i]) for i in b))
                   for b in batches)
        args = source_args(config, source, tokenizer.vocab_size, need)
        family = getattr(options, "family", None)
        if family and family != family_of(args):  # the checkpoint's own family was used without a word
            raise ValueError(f"--model.name {family}: {source.what} holds a {family_of(args)} model; drop "
                             f"--model.name or pass --model.name {family_of(args)}")
        mesh = _tp_mesh(config, world, device)
        with contextlib.ExitStack() as stack:
            if config.kernels.backend != "auto":
                stack.enter_context(titan_kernels.use_backend(config.kernels.backend))
            model = materialize(args, device, resolve_compute_dtype(config, device), source, mesh)
            logger.info("generating from %s (%s, %s)", source.what, args.__class__.__name__,
                        str(next(model.parameters()).dtype).replace("torch.", ""))
            timing = Timing()
            generator = torch.Generator(device=device)
            generator.manual_seed(options.seed)
            eos = (tokenizer.eos_id,)
            for n, batch in enumerate(batches):
                streamer = Streamer(tokenizer) if n == 0 and lead and not (options.json or options.no_stream) else None
                if streamer is not None:
                    sys.stdout.write(options.prompt[batch[0]])
                    sys.stdout.flush()
                stops = options.stop

                def stop(row, ids, _stops=stops):
                    return bool(_stops) and any(s in tokenizer.decode(ids) for s in _stops)

                def on_token(row, token, _s=streamer):
                    if _s is not None and row == 0:
                        _s(token)

                results = generate(model, [prompts[i] for i in batch], options.max_new_tokens, params,
                                   eos_ids=eos, stop=stop if stops else None, on_token=on_token,
                                   generator=generator, timing=timing)
                for k, (i, res) in enumerate(zip(batch, results)):
                    text = completion_text(tokenizer, res.ids, stops)
                    if not lead:
                        continue
                    if options.json:
                        print(json.dumps({"prompt": options.prompt[i], "completion": text, "prompt_ids": res.prompt_ids,
                                          "ids": res.ids, "logprobs": res.logprobs, "finish": res.finish}), flush=True)
                    elif streamer is not None and k == 0:
                        streamer.finish(text)
                    else:
                        print(options.prompt[i] + text, flush=True)
            if lead:
                print(f"prefill: {timing.prefill_tokens} tokens in {timing.prefill_s:.2f}s "
                      f"({timing.prefill_tps:,.0f} tokens/s); decode: {timing.decode_tokens} tokens in "
                      f"{timing.decode_s:.2f}s ({timing.decode_tps:,.1f} tokens/s)", file=sys.stderr)
    except (CheckpointError, ValueError, OSError) as exc:
        if lead:
            print(f"python -m trainer.generate: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the rotary table and the KV cache are sized for the longest sequence
        if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
            raise
        if lead:
            print(f"python -m trainer.generate: error: --max_new_tokens {options.max_new_tokens}: out of memory for "
                  f"the KV cache and rotary table of sequences of up to {need:,} tokens (batches of "
                  f"{options.batch_size}); pass a smaller --max_new_tokens or --batch_size", file=sys.stderr)
        return 1
    finally:
        if world > 1:
            destroy_distributed(mesh)
    return 0
