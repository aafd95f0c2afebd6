"""What the Hugging Face tests of every family share (test_hf.py, test_hf_qwen3.py, test_gpt_oss.py,
test_deepseek_v3.py): transformers' model of our args with random weights, saved and imported into
ours; logits, loss and gradients against it; the converter's round trip; transformers' loss on the
first training batch; one-line refusals of configs we cannot reproduce.

transformers is imported by the callers (``pytest.importorskip``) before these run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.convert import main as convert_main
from trainer.data import build_dataloader, build_tokenizer
from trainer.hf import HFCheckpoint, HFCheckpointError, args_from_hf_config, hf_config, load_into_model
from trainer.checkpoint.hf_convert import hf_to_dcp
from tests.trainer.helpers import cpu_model, rel, tiny_llama

_NOT_CONFIG_KEYS = ("architectures", "model_type", "torch_dtype")
# A Llama of awkward sizes: GQA (4 heads, 2 kv), an FFN width no flavor has, a vocabulary that is no power of two.
TINY_LLAMA = tiny_llama(dim=64, vocab_size=301, multiple_of=32, max_seq_len=64)


def one_line(msg: str) -> bool:
    return "\n" not in msg.strip() and "Traceback" not in msg


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """Our model's logits (its last hidden states times the output weight if forward returns hidden states)."""
    with torch.no_grad():
        out = model(tokens)
        if out.shape[-1] != model.args.vocab_size:
            w = model.tok_embeddings.weight if model.output is None else model.output.weight
            out = out @ w.t()
    return out


def save_hf(model, folder, shard: str = "60KB") -> Path:
    """``save_pretrained`` into ``folder`` in shards of at most ``shard``."""
    model.save_pretrained(folder, max_shard_size=shard)
    return Path(folder)


def hf_model(args, classes: tuple, seed: int, randomize: Callable, **config) -> torch.nn.Module:
    """transformers' model of ``args`` (its config from ``hf_config(args)``, eager attention): ``classes``
    is (config class, model class); ``randomize(model)`` sets its weights after ``torch.manual_seed(seed)``."""
    conf_cls, cls = classes
    cfg = {k: v for k, v in hf_config(args).items() if k not in _NOT_CONFIG_KEYS} | config
    torch.manual_seed(seed)
    model = cls(conf_cls(**cfg, attn_implementation="eager")).float()
    with torch.no_grad():
        randomize(model)
    return model


def hf_llama(args, seed: int = 0) -> torch.nn.Module:
    """A random transformers LlamaForCausalLM with the shapes of ``args`` (norms around 1, matrices small:
    every weight matters), in eval mode."""
    import transformers

    def randomize(model):
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if p.ndim == 1 else 0.0))

    return hf_model(args, (transformers.LlamaConfig, transformers.LlamaForCausalLM), seed, randomize).eval()


def hf_pair(args, classes: tuple, seed: int, tmp_path, randomize: Callable):
    """(transformers' model, ours, the HFCheckpoint): :func:`hf_model` saved and imported into ours."""
    hf = hf_model(args, classes, seed, randomize)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = HFCheckpoint(tmp_path / "hf")
    ours = cpu_model(ckpt.args)
    load_into_model(ours, ckpt)
    return hf, ours, ckpt


def assert_logits_loss_and_gradients_equal(hf, ours, ckpt, args) -> None:
    """Logits (float32 1e-5), the cross-entropy loss and every parameter's gradient (mapped through the
    family's adapter) of ``ours`` equal transformers' ``hf`` on random tokens."""
    tokens = torch.randint(0, args.vocab_size, (2, 19))
    labels = torch.randint(0, args.vocab_size, (2, 19))
    ours_logits, hf_logits = ours(tokens), hf(tokens).logits
    assert rel(ours_logits, hf_logits) < 1e-5
    loss_ours = F.cross_entropy(ours_logits.flatten(0, 1), labels.flatten())
    loss_hf = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
    assert loss_ours.item() == pytest.approx(loss_hf.item(), rel=1e-6)
    loss_ours.backward()
    loss_hf.backward()
    hf_grads = ckpt.adapter.from_hf({n: p.grad for n, p in hf.named_parameters()}, args)
    for name, p in ours.named_parameters():
        assert rel(p.grad, hf_grads[name]) < 1e-5, name


def assert_converter_round_trip(model, args, hf_class, tmp_path):
    """``model`` saved as a seed checkpoint, converted by ``python -m trainer.convert dcp-to-hf`` (40 KB
    shards), loads in ``hf_class`` with our logits, and converts back (``hf_to_dcp``) to the very same
    weights. Returns (the exported config.json, transformers' model)."""
    Checkpointer(tmp_path / "ckpt", model, model_args=args).save_seed()
    assert convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max_shard_size", "40KB"]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = hf_class.from_pretrained(tmp_path / "hf").float().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    with torch.no_grad():
        assert rel(hf(tokens).logits, model.eval()(tokens)) < 1e-5
    back = hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    again = cpu_model(args, seed=9)
    Checkpointer(tmp_path / "dcp-parent", again, model_args=args).initial_load(back, model_only=True)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    return cfg, hf


def assert_refused_in_one_line(cfg: dict, changes: list[tuple[dict, str]]) -> None:
    """Each change of config.json ``cfg`` is refused: an HFCheckpointError matching its message, one
    line naming the file."""
    for change, message in changes:
        with pytest.raises(HFCheckpointError, match=message) as e:
            args_from_hf_config({**cfg, **change}, "x/config.json")
        assert one_line(str(e.value)) and str(e.value).startswith("x/config.json: ")


def first_batch(config) -> dict[str, torch.Tensor]:
    """The first training batch of ``config`` (the built-in byte tokenizer), as rank 0 of one reads it."""
    return next(iter(build_dataloader(config, build_tokenizer(None), 0, 1)))


def hf_loss(hf, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(transformers' logits, its mean token loss) on ``batch``."""
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()


def assert_custom_flavor_round_trip(family: str, hf, args, hf_class, tmp_path, steps: int = 3) -> None:
    """``--flavor custom`` from ``hf`` saved with ``save_pretrained`` (``args``: what it describes):
    step 1's loss is transformers' on the first batch (seq 32, batch 2), the run trains ``steps``
    steps, and its ``last_save_in_hf`` folder loads in ``hf_class`` with the trained model's logits."""
    from trainer import train
    from trainer.config import parse_args

    hf.save_pretrained(tmp_path / "hf-in")
    argv = ["--model.name", family, "--flavor", "custom", "--model.moe_load_balance", "none",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
            "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--metrics.save_plot", "false", "--checkpoint.initial_load_path", str(tmp_path / "hf-in"),
            "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path / "run")]
    config = parse_args(argv)
    batch = first_batch(config)
    start, want = hf_loss(hf, batch)
    trainer = train.Trainer(config)
    try:
        assert trainer.setup() is True
        assert trainer.args == args.replace(max_seq_len=32, moe=args.moe.replace(load_balance="none"))
        assert float(trainer.train_step()) == pytest.approx(want, rel=1e-5)
        trainer.train()
        model = trainer.model.eval()
        model.return_hidden = False
        with torch.no_grad():
            ours = model(batch["input_ids"])
    finally:
        trainer.close()
    trained = hf_class.from_pretrained(tmp_path / "run" / "checkpoint" / f"hf-step-{steps}")
    with torch.no_grad():
        got = trained.float().eval()(batch["input_ids"]).logits
    assert rel(got, ours) < 1e-4 and rel(got, start) > 1e-2
