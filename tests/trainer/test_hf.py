"""Hugging Face checkpoints (Llama 3): import and export give transformers' own logits; conversion CLI;
training from and to a Hugging Face folder; one-line errors for folders that are not (this) model.

transformers' ``LlamaForCausalLM`` is the reference: a random tiny one (all weights and norms random),
saved with ``save_pretrained`` in several shards with an index. Qwen3 and Qwen3-MoE folders:
test_hf_qwen3.py; GPT-OSS and DeepSeek-V3: their family's tests.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import train
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.folder import CheckpointError, load_weights, read_model_args
from trainer.config import ConfigError, parse_args
from trainer.convert import main as convert_main
from trainer.hf import INDEX, HFCheckpoint, HFCheckpointError, hf_config, load_into_model, parse_size
from trainer.checkpoint.hf_convert import dcp_to_hf, hf_to_dcp
from tests.trainer.helpers import cpu_model, rel
from tests.trainer.helpers import llama_model_args as model_args
from tests.trainer.hf_parity import TINY_LLAMA, first_batch, hf_llama, hf_loss, logits_of, one_line, save_hf

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra (pip install -e .[test])")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning",
                                         "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]  # one intra-op thread (tests/trainer/conftest.py)
REPO = Path(__file__).resolve().parents[2]


def _our_model(args, seed=0):
    model = cpu_model(args, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_import_of_a_sharded_hf_llama_gives_its_logits(tmp_path):
    hf = hf_llama(TINY_LLAMA)
    folder = save_hf(hf, tmp_path / "hf")
    assert (folder / INDEX).is_file() and len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    tokens = torch.randint(0, TINY_LLAMA.vocab_size, (2, 19))
    with torch.no_grad():
        want = hf(tokens).logits
    ckpt = HFCheckpoint(folder)
    assert ckpt.flavor == "custom" and ckpt.args.ffn_hidden_dim == TINY_LLAMA.ffn_hidden_dim
    ours = cpu_model(TINY_LLAMA, seed=123)
    assert load_into_model(ours, ckpt) == len(list(ours.parameters()))
    assert rel(logits_of(ours, tokens), want) < 1e-5
    # through a DCP checkpoint (hf-to-dcp), which records the model arguments read from config.json
    dcp_dir = hf_to_dcp(folder, tmp_path / "dcp")
    args, flavor = read_model_args(dcp_dir)
    assert flavor == "custom" and args.replace(max_seq_len=64) == TINY_LLAMA.replace(
        multiple_of=args.multiple_of, ffn_dim_multiplier=args.ffn_dim_multiplier)
    again = cpu_model(TINY_LLAMA, seed=7)
    load_weights(again, dcp_dir)
    assert rel(logits_of(again, tokens), want) < 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_our_logits(tmp_path, tied):
    args = TINY_LLAMA.replace(tie_word_embeddings=tied)
    ours = _our_model(args)
    dcp_dir = Checkpointer(tmp_path / "ckpt", ours, model_args=args, flavor="custom").save_seed()
    rc = convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max_shard_size", "50KB"])
    assert rc == 0 and dcp_dir.name == "step-0"
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "hf" / f).is_file() for f in files)
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.tie_word_embeddings is tied
    tokens = torch.randint(0, args.vocab_size, (3, 23))
    with torch.no_grad():
        got = hf(tokens).logits
    assert rel(got, logits_of(ours, tokens)) < 1e-5
    # and back: the exported folder imports to the same weights
    back = cpu_model(args, seed=5)
    load_into_model(back, HFCheckpoint(tmp_path / "hf"))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.state_dict().values()))


def test_a_second_export_into_the_folder_replaces_the_first(tmp_path):
    # 50 KB shards, then one file of other weights into the same folder: the old shards and index go
    # (transformers would read the index, our loader the single file), and the files get the usual mode.
    first, second = _our_model(TINY_LLAMA), _our_model(TINY_LLAMA)
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(0.5)
    for name, model in (("a", first), ("b", second)):
        Checkpointer(tmp_path / name, model, model_args=TINY_LLAMA, flavor="custom").save_seed()
    assert convert_main(["dcp-to-hf", str(tmp_path / "a"), str(tmp_path / "hf"), "--max_shard_size", "50KB"]) == 0
    assert (tmp_path / "hf" / INDEX).is_file()
    assert convert_main(["dcp-to-hf", str(tmp_path / "b"), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel(hf(tokens).logits, logits_of(second, tokens)) < 1e-5


def test_export_in_bfloat16_in_one_file(tmp_path):
    ours = _our_model(TINY_LLAMA)
    Checkpointer(tmp_path / "ckpt", ours, model_args=TINY_LLAMA).save_seed()
    out = dcp_to_hf(tmp_path / "ckpt" / "step-0", tmp_path / "hf", dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"]["rope_type"] == "llama3"
    hf = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    tokens = torch.randint(0, TINY_LLAMA.vocab_size, (1, 11))
    with torch.no_grad():
        assert rel(hf(tokens).logits, logits_of(ours, tokens)) < 2e-2


def test_bad_folders_give_one_line_errors(tmp_path):
    with pytest.raises(HFCheckpointError, match="no config.json"):
        HFCheckpoint(tmp_path)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(HFCheckpointError, match="not a checkpoint of a family we train .model_type 'gpt2'") as e:
        HFCheckpoint(tmp_path / "gpt2")
    assert one_line(str(e.value))
    # a config that says one shape, tensors of another
    folder = save_hf(hf_llama(TINY_LLAMA), tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] += 32
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"mlp.gate_proj.weight has shape \(192, 64\), expected \(224, 64\)"):
        hf_to_dcp(folder, tmp_path / "dcp")
    # no weights at all
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config(TINY_LLAMA)))
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        HFCheckpoint(tmp_path / "empty")
    # the CLI: exit 1 and one line, for both directions
    for argv in (["hf-to-dcp", str(tmp_path / "gpt2"), str(tmp_path / "x")],
                 ["dcp-to-hf", str(tmp_path / "gpt2"), str(tmp_path / "y")]):
        proc = subprocess.run([sys.executable, "-m", "trainer.convert", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and one_line(proc.stderr) and "error:" in proc.stderr, proc.stderr
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_shapes_that_do_not_match_the_flavor_are_refused(tmp_path):
    folder = save_hf(hf_llama(TINY_LLAMA), tmp_path / "hf")
    other = TINY_LLAMA.replace(dim=96, n_heads=4)
    model = cpu_model(other)
    ck = Checkpointer(tmp_path / "c", model, model_args=other, flavor="debugmodel")
    with pytest.raises(CheckpointError, match="shapes do not match flavor 'debugmodel': dim 64 vs 96") as e:
        ck.initial_load(folder, in_hf=True)
    assert one_line(str(e.value))
    # a DCP checkpoint of another model: refused by its recorded model arguments, before DCP's own errors
    Checkpointer(tmp_path / "tiny", _our_model(TINY_LLAMA), model_args=TINY_LLAMA, flavor="custom").save_seed()
    with pytest.raises(CheckpointError, match="shapes do not match") as e:
        ck.initial_load(tmp_path / "tiny")
    assert one_line(str(e.value))
    with pytest.raises(CheckpointError, match="initial_load_in_hf"):
        ck.initial_load(tmp_path / "hf")  # an HF folder given as DCP: says what to add


def _hf_debugmodel(tmp_path, seq_len=32):
    args = model_args("debugmodel", 258, seq_len)  # the built-in byte tokenizer's vocabulary
    hf = hf_llama(args, seed=3)
    hf.config.max_position_embeddings = 131072
    return args, hf, save_hf(hf, tmp_path / "hf-in", shard="2MB")


def _train(folder, *overrides):
    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2",
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
            "--metrics.enable_color", "false", *overrides]
    return train.main(parse_args(argv))


def test_train_from_and_to_hugging_face(tmp_path):
    args, hf, src = _hf_debugmodel(tmp_path)
    run = tmp_path / "run"
    rc = _train(run, "--checkpoint.initial_load_path", str(src), "--checkpoint.initial_load_in_hf",
                "--checkpoint.last_save_in_hf")
    assert rc == 0
    # step 1's loss is the Hugging Face model's loss on the first batch: training started from its weights
    batch = first_batch(parse_args(["--training.seq_len", "32", "--training.local_batch_size", "2"]))
    logits, want = hf_loss(hf, batch)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)
    # the final save is a Hugging Face folder that transformers loads; it holds the trained weights
    out = run / "checkpoint" / "hf-step-2"
    assert (out / "config.json").is_file() and not list((run / "checkpoint").glob(".*"))
    trained = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours = cpu_model(args)
    load_into_model(ours, HFCheckpoint(out))
    with torch.no_grad():
        got = trained(batch["input_ids"]).logits
    assert rel(got, logits_of(ours, batch["input_ids"])) < 1e-5 and rel(got, logits) > 1e-4


def test_train_refuses_an_hf_folder_of_another_shape(tmp_path, capsys):
    folder = save_hf(hf_llama(TINY_LLAMA), tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    rc = _train(tmp_path / "run", "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf")
    err = capsys.readouterr().err
    assert rc == 1 and "shapes do not match flavor 'debugmodel'" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ConfigError, match="initial_load_model_only"):
        parse_args(["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
                    "--checkpoint.initial_load_model_only", "false"])
    with pytest.raises(ConfigError, match="initial_load_path: no such folder"):
        parse_args(["--checkpoint.initial_load_path", str(tmp_path / "nope")])


@pytest.mark.slow  # 13 s; Hugging Face folders under a layout stay in the default run with EP 2
def test_hf_start_and_end_under_pp2_x_tp2_equal_one_process(tmp_path, tmp_path_factory):
    """The initial load keeps each rank's TP shard of the permuted rows; the final export gathers the
    pipeline stages: 4 ranks (PP 2 x TP 2) give the single-process losses and exported weights."""
    from tests.distributed.layouts import assert_same, reference, run_layouts

    _, _, src = _hf_debugmodel(tmp_path)
    hf_args = ["--checkpoint.initial_load_path", str(src), "--checkpoint.initial_load_in_hf",
               "--checkpoint.last_save_in_hf"]
    single = reference(tmp_path_factory, *hf_args)
    runs = run_layouts(4, {"pp2_tp2": [*hf_args, "--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.tensor_parallel_degree", "2",
                                       "--training.local_batch_size", "4"]}, tmp_path)
    assert_same(runs["pp2_tp2"], single)
    got = HFCheckpoint(tmp_path / "pp2_tp2" / "checkpoint" / "hf-step-5")
    ref_dir = next(tmp_path_factory.getbasetemp().glob("single-process-*/checkpoint/hf-step-5"))
    want = HFCheckpoint(ref_dir)
    for name in want.weight_map:
        a, b = got.tensor(name), want.tensor(name)
        assert rel(a, b) < 1e-4, name
