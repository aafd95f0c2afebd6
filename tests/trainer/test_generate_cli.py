"""``python -m trainer.generate`` and ``python -m trainer.eval`` on a run's own checkpoint folder: one
short training run (validation and a DCP checkpoint at its last step) is generated from and evaluated
with the run's own flags; ``trainer.eval`` gives the loss the run's validation logged (1e-5);
``--json`` lines, BOS first, stop strings, EOS, Hugging Face folders, and one-line errors."""
import json

import pytest
import torch

from trainer.eval import main as eval_main
from trainer.generate.cli import main as generate_main
from tests.trainer.helpers import train_records

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

RUN = ["--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2",
       "--validation.enable", "--validation.freq", "3", "--validation.steps", "2", "--validation.seq_len", "48",
       "--checkpoint.enable", "--checkpoint.interval", "3", "--training.dataset_path", "tests/data/tinyshakespeare.txt",
       "--validation.sample_prompts", "To be,KING", "--validation.sample_max_new_tokens", "6"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    torch.set_num_threads(1)
    records = train_records(folder, *RUN, "--metrics.enable_tensorboard")
    return folder, records


def _json_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_eval_equals_the_in_run_validation_loss(run, capsys):
    folder, records = run
    val = [r for r in records if "val_loss" in r][-1]
    assert eval_main([*RUN, "--job.dump_folder", str(folder), "--json", "--no_progress"]) == 0
    r = _json_lines(capsys)[0]
    assert abs(r["loss"] - val["val_loss"]) < 1e-5 * max(1.0, val["val_loss"])
    assert r["tokens"] == val.get("val_tokens", r["tokens"]) and r["batches"] == 2
    # the byte tokenizer: one token per byte but BOS/EOS, so bits per byte ~ loss / ln 2
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / 0.6931471805599453 * r["tokens"] / r["bytes"])
    assert r["bytes"] <= r["tokens"] and "step 3" in r["checkpoint"]


def test_eval_without_validation_enable_reads_the_held_out_split(run, capsys):
    """The README's ``python -m trainer.eval --job.dump_folder outputs --validation.steps 20``: no
    ``--validation.enable`` and no validation dataset still evaluates the training source's held-out part
    (it was refused as "unknown dataset ''"), giving the loss of the run that had validation on."""
    folder, _ = run
    flags = [a for a in RUN if a != "--validation.enable"]
    assert eval_main([*flags, "--job.dump_folder", str(folder), "--json", "--no_progress"]) == 0
    without = _json_lines(capsys)[0]
    assert eval_main([*RUN, "--job.dump_folder", str(folder), "--json", "--no_progress"]) == 0
    assert _json_lines(capsys)[0]["loss"] == without["loss"]


def test_json_stdout_is_json_lines_alone(run, capsys):
    """``--json`` promises one object per line on stdout, but the log line "[trainer] ... generating from
    ..." (and eval's) came first on stdout, breaking ``| jq``."""
    folder, _ = run
    assert generate_main(["--job.dump_folder", str(folder), "--prompt", "To be", "--prompt", "KING",
                          "--max_new_tokens", "3", "--json"]) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in out.out.splitlines()] == ["To be", "KING"]
    assert "generating from" in out.err
    assert eval_main([*RUN, "--job.dump_folder", str(folder), "--json", "--no_progress"]) == 0
    assert len([json.loads(line) for line in capsys.readouterr().out.splitlines()]) == 1


def test_validation_writes_the_sample_completions(run):
    folder, records = run
    samples = [r for r in records if "samples" in r]
    assert [r["step"] for r in samples] == [3]
    assert [s["prompt"] for s in samples[0]["samples"]] == ["To be", "KING"]
    assert all(isinstance(s["completion"], str) for s in samples[0]["samples"])
    tb = list(folder.glob("tb/**/events*"))
    assert tb and any(b"validation/samples" in f.read_bytes() for f in tb)


def test_sample_prompts_need_a_model_that_is_not_split():
    from tests.trainer.helpers import config_error

    assert "data parallel only" in config_error(["--validation.sample_prompts", "x",
                                                 "--parallelism.tensor_parallel_degree", "2"])
    assert "sample_max_new_tokens" in config_error(["--validation.sample_max_new_tokens", "0"])


def test_eval_prints_a_progress_bar_with_an_eta(run, capsys):
    folder, _ = run
    assert eval_main([*RUN, "--job.dump_folder", str(folder)]) == 0
    out = capsys.readouterr()
    assert "ETA" in out.err and "2/2" in out.err and "perplexity" in out.out


def test_generate_from_the_run_folder_with_the_training_flags(run, capsys):
    folder, _ = run
    argv = [*RUN, "--job.dump_folder", str(folder), "--prompt", "To be", "--prompt", "KING RICHARD:\n",
            "--max_new_tokens", "12", "--json"]
    assert generate_main(argv) == 0
    lines = _json_lines(capsys)
    assert [x["prompt"] for x in lines] == ["To be", "KING RICHARD:\n"]
    for x in lines:
        assert x["prompt_ids"][0] == 256 and x["prompt_ids"][1:] == list(x["prompt"].encode())  # BOS first
        assert len(x["ids"]) == len(x["logprobs"]) <= 12 and all(lp <= 0 for lp in x["logprobs"])
        assert x["finish"] in ("eos", "length") and (x["finish"] == "eos") == (x["ids"][-1] == 257)
    # batch size 1 and sampling at temperature 0 give the same tokens; a seed repeats a sampled run
    assert generate_main([*argv, "--batch_size", "1"]) == 0
    assert [x["ids"] for x in _json_lines(capsys)] == [x["ids"] for x in lines]
    sampled = [*argv, "--temperature", "1.0", "--top_k", "50", "--top_p", "0.9", "--seed", "3"]
    runs = []
    for _ in range(2):
        assert generate_main(sampled) == 0
        runs.append([x["ids"] for x in _json_lines(capsys)])
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_stop_strings_streaming_and_the_throughput_line(run, capsys):
    folder, _ = run
    base = [*RUN, "--job.dump_folder", str(folder), "--prompt", "To be", "--max_new_tokens", "16"]
    assert generate_main([*base, "--json"]) == 0
    full = _json_lines(capsys)[0]
    text = full["completion"]
    stop = text[3:5] if len(text) >= 5 else None
    if stop:
        assert generate_main([*base, "--json", "--stop", stop]) == 0
        cut = _json_lines(capsys)[0]
        assert cut["finish"] == "stop" and cut["completion"] == text[:text.find(stop)]
    assert generate_main(base) == 0
    out = capsys.readouterr()
    assert out.out == "To be" + text + "\n" and "tokens/s" in out.err and "prefill" in out.err  # the text alone


@pytest.mark.parametrize("argv, message", [
    (["--max_new_tokens", "0"], "--max_new_tokens: expected an integer >= 1"),
    (["--top_p", "1.5"], "--top_p: expected a number in"),
    (["--temperature", "inf"], "--temperature: expected a finite number >= 0"),
    (["--prompt", b"ab\xff".decode("utf-8", "surrogateescape")], "--prompt: expected UTF-8 text, got the byte 0xff at"),
    (["--prompt", "x", "--stop", b"\xfe".decode("utf-8", "surrogateescape")], "--stop: expected UTF-8 text"),
    (["--temperature", "nan"], "--temperature: expected a finite number >= 0"),
    (["--training.stpes", "3"], "did you mean --training.steps"),
    ([], "no prompt"),
])
def test_bad_options_are_one_line(argv, message, capsys, tmp_path):
    assert generate_main(["--job.dump_folder", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_stop_reads_the_shell_escapes_of_the_readme():
    """The README's ``--stop "\\n\\n"`` reaches argv as backslash-n twice (bash keeps it in double quotes):
    it never matched a blank line, so generation ran to --max_new_tokens past every paragraph."""
    from trainer.generate.cli import parse

    ns, _ = parse(["--stop", r"\n\n", "--stop", r"a\\nb", "--stop", r"\t|\q", "--stop", "é"])
    assert ns.stop == ["\n\n", "a\\nb", "\t|\\q", "é"]


def test_a_folder_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert generate_main(["--job.dump_folder", str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no checkpoint" in err and "\n" not in err
    assert eval_main(["--job.dump_folder", str(tmp_path)]) == 1


@pytest.mark.parametrize("where", ["step", "run"])
def test_a_damaged_metadata_file_is_one_line(tmp_path, capsys, where):
    """A step folder whose ``.metadata`` is not DCP's (truncated, overwritten) was a raw UnpicklingError
    traceback from trainer.generate and trainer.eval."""
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"junk\n")
    path = str(step if where == "step" else tmp_path / "checkpoint")
    assert generate_main(["--checkpoint.initial_load_path", path, "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainer.generate: error: ") and "cannot be read" in err and str(step) in err
    assert eval_main(["--checkpoint.initial_load_path", path, "--training.dataset_path",
                      "tests/data/tinyshakespeare.txt", "--no_progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainer.eval: error: ") and "cannot be read" in err


def test_truncated_weights_without_a_manifest_are_one_line(run, tmp_path, capsys):
    """A step folder without a manifest (loaded unverified) whose .distcp file is cut short: DCP's
    CheckpointException (a BaseException) escaped as a traceback of every rank."""
    import shutil

    folder, _ = run
    step = tmp_path / "step-3"
    shutil.copytree(folder / "checkpoint" / "step-3", step)
    (step / "manifest.json").unlink()
    for f in step.glob("*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(1000)
    assert generate_main(["--checkpoint.initial_load_path", str(step), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m trainer.generate: error: checkpoint {step}: its ") and "cannot be read" in err


def test_max_new_tokens_beyond_memory_is_one_line(run, capsys, monkeypatch):
    """--max_new_tokens 1000000000: the rotary table / KV cache allocation raised a RuntimeError traceback
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 32000000064 bytes")."""
    folder, _ = run
    import trainer.generate.run as run_module

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 32000000064 bytes. Error code 12")

    monkeypatch.setattr(run_module, "materialize", no_memory)
    assert generate_main(["--job.dump_folder", str(folder), "--prompt", "x", "--max_new_tokens", "1000000000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainer.generate: error: --max_new_tokens 1000000000: out of memory")
    assert "1,000,000,002 tokens" in err


def test_a_model_name_other_than_the_checkpoints_is_one_line(run, capsys):
    """--model.name qwen3 on a Llama 3 checkpoint generated from the Llama 3 model without a word."""
    folder, _ = run
    assert generate_main(["--job.dump_folder", str(folder), "--model.name", "qwen3", "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainer.generate: error: --model.name qwen3: step 3 of ")
    assert err.endswith("holds a llama3 model; drop --model.name or pass --model.name llama3")
    assert generate_main(["--job.dump_folder", str(folder), "--model.name=llama3", "--prompt", "x",
                          "--max_new_tokens", "2"]) == 0


def test_the_readme_generation_commands_are_valid(monkeypatch):
    """The README's ``-m trainer.generate`` / ``-m trainer.eval`` commands: every option exists and, where
    no placeholder (DIR, a file to bring) stands in, the whole command line parses."""
    import importlib
    import re
    import shlex
    from pathlib import Path

    from tests.test_readme import README, _blocks, _commands
    from trainer.config import all_keys, parse_args
    from trainer import registry
    from trainer.generate.cli import build_parser, family_of

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    found = 0
    for _, code in _blocks("bash"):
        for cmd in _commands(code):
            words = shlex.split(cmd)
            if "-m" not in words or words[words.index("-m") + 1] not in ("trainer.generate", "trainer.eval"):
                continue
            found += 1
            argv = words[words.index("-m") + 2:]
            parser = build_parser()
            family = family_of(argv)
            if family in registry.names() and registry.get(family).generate:  # its own flags (Flux)
                parser = importlib.import_module(registry.get(family).generate.partition(":")[0]).build_parser()
            ns, rest = parser.parse_known_args(argv)
            rest = [a for a in rest if a not in ("--no_progress", "--json")]
            for a in rest:
                if a.startswith("--"):
                    assert a[2:].split("=", 1)[0] in [*all_keys(), "flavor", "config"], cmd
            # placeholders, and the dump folder an earlier README command creates (outputs/...)
            if not any(re.fullmatch(r"[A-Z]+|\w+\.txt|outputs(/.*)?", a) for a in argv):
                parse_args(rest)
    assert found >= 5 and "python -m trainer.generate --prompt" in README


def test_the_newest_step_of_a_run_folder_is_read_dcp_or_hugging_face(tmp_path):
    from trainer.config import parse_args
    from trainer.generate.load import resolve_source

    ckpt = tmp_path / "checkpoint"
    for name, marker in (("step-2", ".metadata"), ("hf-step-3", "config.json"), ("step-5", None)):
        (ckpt / name).mkdir(parents=True)
        if marker:
            (ckpt / name / marker).write_text("{}")
    config = parse_args(["--job.dump_folder", str(tmp_path)])
    src = resolve_source(config)  # step-5 is incomplete (no .metadata): hf-step-3 is the newest
    assert (src.kind, src.path.name) == ("hf", "hf-step-3")
    (ckpt / "hf-step-3" / "config.json").unlink()
    assert resolve_source(config).path.name == "step-2"
    explicit = parse_args(["--checkpoint.initial_load_path", str(ckpt / "step-2")])
    assert resolve_source(explicit).kind == "dcp"


CALLS = []


def toy_sampler(argv) -> int:
    """A family's own sampler (what Flux plugs in): it gets the whole command line, its own flags too."""
    CALLS.append(tuple(argv))
    return 0


def test_a_family_that_is_not_a_decoder_brings_its_own_sampler():
    from tests.trainer.test_registry import ToyArgs
    from trainer import registry
    from trainer.registry import ModelSpec

    registry.register(ModelSpec(name="toyimage", title="Toy image", args_cls=ToyArgs, description="a test family",
                                flavors={"tiny": ToyArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)},
                                generate=f"{__name__}:toy_sampler"))
    try:
        argv = ["--model.name", "toyimage", "--flavor", "tiny", "--prompt", "a cat", "--num_inference_steps", "3"]
        assert generate_main(argv) == 0
    finally:
        registry.unregister("toyimage")
    assert CALLS == [tuple(argv)]


# Slow (a fresh training run, about 20 s on 2 shared cores): the main job's ending. By default the
# pieces are covered: the HF export and its BOS (test_hf_export_tokenizer.py), reading a run folder
# (above), greedy parity with transformers (test_generate.py).
@pytest.mark.slow
def test_the_main_job_leaves_a_folder_that_generate_and_transformers_load(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from trainer.__main__ import MAIN_JOB

    records = train_records(tmp_path, *MAIN_JOB, "--training.steps", "6", "--training.seq_len", "64")
    assert [s["prompt"] for r in records if "samples" in r for s in r["samples"]] == ["The module"]
    folder = tmp_path / "checkpoint" / "hf-step-6"
    capsys.readouterr()
    assert generate_main(["--job.dump_folder", str(tmp_path), "--prompt", "The module", "--max_new_tokens", "12",
                          "--json"]) == 0
    ours = _json_lines(capsys)[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    x = tok("The module", return_tensors="pt")
    assert x.input_ids[0].tolist() == ours["prompt_ids"]  # BOS first, as training and trainer.generate
    with torch.no_grad():
        out = hf.generate(**x, do_sample=False, max_new_tokens=12)
    assert out[0, x.input_ids.shape[1]:].tolist() == ours["ids"][:12]
