"""The Hugging Face export is a model folder: transformers' AutoTokenizer and AutoModelForCausalLM
load it, the tokenizer gives our training ids, and the model our logits (short debugmodel runs on
the CPU; the shipped tests/data/tokenizer and the built-in byte-level tokenizer).
"""
import json
from pathlib import Path

import pytest
import torch

from trainer import train
from trainer.checkpoint.folder import load_weights, read_model_args
from trainer.config import parse_args
from trainer.convert import main as convert_main
from trainer.data import build_tokenizer
from trainer.hf import HFCheckpoint, load_into_model
from trainer.checkpoint.hf_convert import dcp_to_hf
from trainer.hf.tokenizer_files import byte_tokenizer_json
from trainer.registry import build_model
from tests.trainer.helpers import rel

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra (pip install -e .[test])")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning",
                                         "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]  # one intra-op thread (tests/trainer/conftest.py)
TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
# Spaces, a tab, newlines, digits, punctuation and non-ASCII letters (several bytes each).
TEXT = "The king speaks.\n\tNaïve café, Ünïcödé: 3 + 4 = 7!"


def _train(folder, *overrides):
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2",
            "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(folder), "--metrics.enable_color", "false",
            "--metrics.save_plot", "false", *overrides]
    assert train.main(parse_args(argv)) == 0


def _check_loads_as_our_model(out: Path, ours: torch.nn.Module, tokenizer_path: str) -> None:
    """AutoTokenizer gives our ids, AutoModelForCausalLM our logits (float32, 1e-5) and its greedy next token."""
    ours_tok = build_tokenizer(tokenizer_path or None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = ours_tok.encode(TEXT)
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.decode(ids) == TEXT
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (ours_tok.bos_id, ours_tok.eos_id)
    generation = json.loads((out / "generation_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for cfg in (generation, config):
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (ours_tok.bos_id, ours_tok.eos_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == ours_tok.eos_id
    x = torch.tensor([[ours_tok.bos_id, *ids[:20]]])
    with torch.no_grad():
        got, want = model(x).logits, ours(x)
        assert rel(got, want) < 1e-5
        new = model.generate(x, max_new_tokens=1, do_sample=False)[0, -1]
    assert int(new) == int(want[0, -1].argmax())


def _our_model(path, loader):
    args, _ = read_model_args(path)
    model = build_model(args, device="cpu")
    model.init_weights(0)
    loader(model)
    return model.eval()


def test_convert_ships_the_runs_tokenizer_folder(tmp_path):
    """tests/data/tokenizer is a ranked byte-level vocabulary without merges (applied with tiktoken in
    training): its tokenizer.json is written from the ranks, its other files are copied."""
    run = tmp_path / "run"
    _train(run, "--model.tokenizer_path", str(TOKENIZER), "--checkpoint.enable", "--checkpoint.interval", "2")
    step = run / "checkpoint" / "step-2"
    out = tmp_path / "hf"
    assert convert_main(["dcp-to-hf", str(step), str(out), "--tokenizer_path", str(TOKENIZER)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert (out / "tokenizer_config.json").read_bytes() == (TOKENIZER / "tokenizer_config.json").read_bytes()
    assert json.loads((out / "tokenizer.json").read_text())["model"]["merges"]  # the file's has none
    ours = _our_model(step, lambda m: load_weights(m, step))
    _check_loads_as_our_model(out, ours, str(TOKENIZER))


def test_last_save_in_hf_ships_the_byte_level_tokenizer(tmp_path):
    run = tmp_path / "run"
    _train(run, "--checkpoint.last_save_in_hf")
    out = run / "checkpoint" / "hf-step-2"
    # the byte-level tokenizer as tokenizer.json: one id per UTF-8 byte, BOS 256, EOS 257
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == list(TEXT.encode())
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, len(hf_tok)) == (256, 257, 258)
    ours = build_model(HFCheckpoint(out).args, device="cpu")
    ours.init_weights(0)
    load_into_model(ours, HFCheckpoint(out))  # the trained weights, in our model
    _check_loads_as_our_model(out, ours.eval(), "")


def test_convert_copies_a_tokenizers_json_and_says_when_there_is_none(tmp_path, capsys):
    run = tmp_path / "run"
    _train(run, "--checkpoint.enable", "--checkpoint.interval", "2")
    step = run / "checkpoint" / "step-2"
    # a tokenizer.json the tokenizers library applies as it is (the byte-level one, as a file): copied
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    byte_tokenizer_json().save(str(tok_dir / "my.json"))
    assert type(build_tokenizer(tok_dir / "my.json")).__name__ == "HFTokenizer"
    out = tmp_path / "copied"
    assert convert_main(["dcp-to-hf", str(step), str(out), "--tokenizer_path", str(tok_dir / "my.json")]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "my.json").read_bytes()
    ours = _our_model(step, lambda m: load_weights(m, step))
    _check_loads_as_our_model(out, ours, str(tok_dir / "my.json"))
    # none given: the command says so
    capsys.readouterr()
    assert convert_main(["dcp-to-hf", str(step), str(tmp_path / "plain")]) == 0
    assert not list((tmp_path / "plain").glob("tokenizer*")) and not (tmp_path / "plain" / "generation_config.json").exists()
    assert "no --tokenizer_path" in capsys.readouterr().out
    capsys.readouterr()
    assert convert_main(["dcp-to-hf", str(step), str(tmp_path / "bad"), "--tokenizer_path", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "--tokenizer_path: no such file" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
    # the trainer's export when the run's tokenizer is gone by the end: the weights, and a warning
    moved = dcp_to_hf(step, tmp_path / "moved", tokenizer_path=str(tmp_path / "gone.json"))
    assert (moved / "model.safetensors").is_file() and not (moved / "tokenizer.json").exists()
