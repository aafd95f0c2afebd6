"""torchtitan's configuration keys: every key of torchtitan 0.3.0 (tests/data/torchtitan_0.3.0_keys.json,
read from its source, see tests/data/README.md) is ours, an alias of ours or refused with a reason;
the keys with a meaning of their own (--job.config_file, --model.converters, --model.hf_assets_path,
--parallelism.fsdp_reshard_after_forward, --debug.*) do what torchtitan's do; did-you-mean stays close."""
from __future__ import annotations

import json
import pathlib

import pytest

from trainer.config import ConfigError, all_keys, parse_args
from trainer.config import torchtitan_keys as tk
from trainer.config.cli import resolve_key
from tests.trainer.helpers import config_error

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
TOKENIZER = DATA / "tokenizer"
TORCHTITAN_030 = json.loads((DATA / "torchtitan_0.3.0_keys.json").read_text())["keys"]
# Every key of the releases 0.1.0 .. 0.2.2 (scripts/torchtitan_keys.py on each wheel), with its releases.
TORCHTITAN_EARLIER = json.loads((DATA / "torchtitan_earlier_keys.json").read_text())["keys"]
# Keys of torchtitan's earlier JobConfig that a torchtitan user's command line or TOML file may hold.
EARLIER = ("job.config_file", "model.converters", "model.hf_assets_path", "model.tokenizer_path", "model.name",
           "model.flavor", "job.dump_folder", "job.print_config", "float8.recipe_name", "float8.filter_fqns",
           "float8.enable_fsdp_float8_all_gather")


def test_the_key_list_is_torchtitan_0_3_0s():
    # The file is the whole tree, not a few sections: the sections 0.3.0 has and a count near its 108.
    sections = {k.split(".")[0] for k in TORCHTITAN_030 if "." in k}
    assert {"training", "parallelism", "checkpoint", "comm", "debug", "profiler", "validator", "metrics",
            "lr_scheduler", "optimizer", "compile", "activation_checkpoint", "dataloader"} <= sections
    assert {"dump_folder", "hf_assets_path"} <= set(TORCHTITAN_030)
    assert len(TORCHTITAN_030) >= 100


@pytest.mark.parametrize("name", sorted(set(TORCHTITAN_030) | set(EARLIER) | set(TORCHTITAN_EARLIER)))
def test_every_torchtitan_key_is_known_aliased_or_refused_with_a_reason(name):
    if name == tk.CONFIG_FILE_KEY:
        return  # the TOML file itself: test_job_config_file_reads_the_toml_file
    ours = set(all_keys())
    try:
        section, key, negated = resolve_key(name)
    except ConfigError as exc:
        msg = str(exc)
        assert name in tk.REFUSED, f"--{name} is neither accepted nor refused with a reason: {msg}"
        assert msg.startswith(f"--{name}: not applicable here: ") and len(msg) > len(name) + 30, msg
        assert "\n" not in msg
        return
    target = f"{section}.{key}"
    assert target in ours
    if name != target:
        assert tk.ALIASES.get(name) == target or tk.NEGATED.get(name) == target
    if negated:
        assert isinstance(getattr(getattr(parse_args([]), section), key), bool)


def test_the_tables_name_only_torchtitan_keys_and_ours():
    known = set(TORCHTITAN_030) | set(EARLIER) | set(TORCHTITAN_EARLIER)
    ours = set(all_keys())
    for table in (tk.ALIASES, tk.NEGATED, tk.REFUSED):
        assert set(table) <= known, set(table) - known
        assert not set(table) & ours  # an alias never shadows a key of ours
    assert set(tk.ALIASES.values()) | set(tk.NEGATED.values()) | set(tk.NEAR.values()) <= ours
    assert all(reason and "\n" not in reason for reason in tk.REFUSED.values())


def test_aliases_set_our_key_on_the_command_line():
    c = parse_args(["--debug.seed", "3", "--debug.deterministic", "--dump_folder", "/tmp/tt-out",
                    "--metrics.disable_color_printing", "--profiler.profile_freq", "7",
                    "--validator.enable", "--validator.steps", "5", "--checkpoint.enable", "--checkpoint.last_save_model_only",
                    "--compile.enable_async_tensor_parallel", "false"])
    assert (c.training.seed, c.training.deterministic, c.job.dump_folder) == (3, True, "/tmp/tt-out")
    assert c.metrics.enable_color is False
    assert c.profiling.profile_freq == 7
    assert (c.validation.enable, c.validation.steps) == (True, 5)
    assert c.checkpoint.model_weights_only is True
    assert c.parallelism.enable_async_tensor_parallel is False
    assert parse_args(["--float8.recipe_name", "rowwise"]).float8.recipe == "rowwise"
    assert parse_args(["--metrics.disable_color_printing", "false"]).metrics.enable_color is True
    # A bad value names the option as given.
    assert "--debug.seed: expected an integer" in config_error(["--debug.seed", "x"])


def test_refused_keys_say_why_in_one_line():
    msg = config_error(["--comm.trace_buf_size", "0"])
    assert msg.startswith("--comm.trace_buf_size: not applicable here: ")
    # FSDP2 CPU offload is ours now, with torchtitan's name and meaning (trainer/parallel/cpu_offload.py).
    assert parse_args(["--training.enable_cpu_offload"]).training.enable_cpu_offload is True


def test_job_config_file_reads_the_toml_file(tmp_path):
    path = tmp_path / "tt.toml"
    # A torchtitan-style file: its section names, a top-level key and a nested table.
    path.write_text(
        f'dump_folder = "{tmp_path}"\nhf_assets_path = "{TOKENIZER}"\n'
        "[training]\nsteps = 7\n[debug]\nseed = 5\ndeterministic = true\n"
        "[validator]\nenable = true\n[validator.dataloader]\ndataset = \"pydoc\"\n"
        "[metrics]\ndisable_color_printing = true\n[model]\nconverters = [\"float8\"]\n"
    )
    for argv in (["--job.config_file", str(path)], [f"--job.config_file={path}"], ["--config", str(path)]):
        c = parse_args(argv)
        assert (c.training.steps, c.training.seed, c.training.deterministic) == (7, 5, True)
        assert c.job.dump_folder == str(tmp_path)
        assert c.validation.enable and c.validation.dataset == "pydoc"
        assert c.metrics.enable_color is False
        assert c.float8.enable and c.model.tokenizer_path == str(TOKENIZER)
    assert "--config: file not found" in config_error(["--job.config_file", str(tmp_path / "none.toml")])


def test_toml_refusals_name_the_file_and_key(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text("[comm]\ntrace_buf_size = 0\n")
    assert config_error(["--config", str(path)]).startswith("tt.toml: --comm.trace_buf_size: not applicable here: ")
    path.write_text(f'[job]\nconfig_file = "{path}"\n')
    assert "tt.toml: job.config_file: the TOML file is given on the command line" in config_error(["--config", str(path)])
    path.write_text("[debug]\nseeed = 1\n")
    assert config_error(["--config", str(path)]) == "tt.toml: unknown option --debug.seeed; did you mean --debug.seed?"
    path.write_text("[nonsense]\nx = 1\n")
    assert "tt.toml: unknown section [nonsense]" in config_error(["--config", str(path)])


def test_model_converters_float8_turns_on_float8():
    assert parse_args([]).float8.enable is False
    c = parse_args(["--model.converters", "float8"])
    assert c.model.converters == ["float8"] and c.float8.enable is True
    assert config_error(["--model.converters", "float8,mx"]) == (
        "--model.converters: unknown converter 'mx'; known: float8, quantize.linear.float8")


def test_hf_assets_path_gives_the_tokenizer_and_the_weights_folder(tmp_path):
    c = parse_args(["--model.hf_assets_path", str(TOKENIZER)])
    assert c.model.tokenizer_path == str(TOKENIZER)
    assert c.checkpoint.initial_load_path == ""  # the weights only with initial_load_in_hf
    # An explicit tokenizer wins; torchtitan's top-level spelling is the same key.
    c = parse_args(["--hf_assets_path", str(TOKENIZER), "--model.tokenizer_path", str(TOKENIZER / "tokenizer.json")])
    assert c.model.hf_assets_path == str(TOKENIZER)
    assert c.model.tokenizer_path == str(TOKENIZER / "tokenizer.json")
    c = parse_args(["--model.hf_assets_path", str(TOKENIZER), "--checkpoint.initial_load_in_hf"])
    assert c.checkpoint.initial_load_path == str(TOKENIZER)
    assert config_error(["--model.hf_assets_path", str(tmp_path / "none")]) == (
        f"--model.hf_assets_path: no such folder: {str(tmp_path / 'none')!r}")


def test_fsdp_reshard_after_forward_maps_to_fully_shard(monkeypatch):
    from torch import nn

    from trainer.parallel import fsdp

    assert parse_args([]).parallelism.fsdp_reshard_after_forward == "default"
    assert parse_args(["--parallelism.fsdp_reshard_after_forward", "never"]).parallelism.fsdp_reshard_after_forward \
        == "never"
    assert "expected one of default, always, never" in config_error(["--parallelism.fsdp_reshard_after_forward", "x"])
    assert [fsdp.reshard_after_forward(p, pp) for p in ("default", "always", "never") for pp in (False, True)] == [
        True, False, True, True, False, False]
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        fsdp.reshard_after_forward("sometimes", False)

    # apply_fsdp hands the value to every block's fully_shard; the root stays gathered.
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, **kw: calls.append((type(m).__name__, kw["reshard_after_forward"])))
    monkeypatch.setattr(fsdp.dist, "get_backend", lambda group: "nccl")

    class Mesh:
        def get_group(self, i):
            return None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})

    for value in (True, False):
        calls.clear()
        fsdp.apply_fsdp(Model(), Mesh(), reshard_after_forward=value)
        assert calls == [("Linear", value), ("Linear", value), ("Model", False)]


def test_did_you_mean_suggests_only_close_meanings():
    # torchtitan's names of other versions: the key of the same meaning, not the nearest spelling.
    assert config_error(["--metrics.enable_color_printing"]).endswith("did you mean --metrics.enable_color?")
    assert config_error(["--training.enable_float8_linear"]).endswith("did you mean --float8.enable?")
    # Misspelled torchtitan keys suggest the torchtitan key, which works.
    assert config_error(["--debug.seeed", "1"]).endswith("did you mean --debug.seed?")
    assert config_error(["--model.converter", "float8"]).endswith("did you mean --model.converters?")
    # A key that means nothing close is not matched on a similar-looking one.
    for argv in (["--model.norm_type", "rms"], ["--memory_estimation.verbose"], ["--training.gc_debugging"]):
        assert config_error(argv).endswith("see --help for the list of options"), argv
    # Values are matched whole: '70B' is not '1.7B' (a dot in a value is no section).
    assert "did you mean" not in config_error(["--model.name", "qwen3", "--flavor", "70B"])
    assert config_error(["--model.name", "qwen3", "--flavor", "1.7b"]).endswith("(did you mean '1.7B'?)")


def test_estimates_follow_fsdp_reshard_after_forward():
    from trainer.estimate.memory import Layout, estimate_memory, model_costs
    from trainer.estimate.comm import communication_per_step
    from trainer.models.llama3.args import Llama3Args

    costs = model_costs(Llama3Args(dim=96, n_layers=5, n_heads=4, n_kv_heads=2, vocab_size=130, multiple_of=16,
                                   max_seq_len=64))
    layout = Layout(dp_shard=4)

    def gathered(**kw) -> float:
        colls = communication_per_step(costs, layout, 2, 64, **kw)
        return next(c.bytes_per_call for c in colls if c.op == "all-gather")

    blocks = costs.n_layers * costs.block_params
    root = costs.total_params - blocks
    ring, cb = 3 / 4, 2
    # Resharded blocks are gathered in the forward and again in the backward; kept ones once.
    assert gathered() == pytest.approx(ring * cb * (2 * blocks + root), rel=1e-12)
    assert gathered(reshard_after_forward=True) == gathered()
    assert gathered(reshard_after_forward=False) == pytest.approx(ring * cb * (blocks + root), rel=1e-12)
    # Kept gathered, every block's parameters are held from forward to backward: more working memory.
    default = estimate_memory(costs, layout, 2, 64)
    kept = estimate_memory(costs, layout, 2, 64, reshard_after_forward=False)
    blk = costs.gathered_block_params()
    assert kept.working - default.working == pytest.approx((costs.n_layers - 2) * blk * 2, rel=1e-9)


def test_hf_assets_path_describes_a_custom_flavor(tmp_path):
    # torchtitan's way to start from a Hugging Face folder: the one folder gives the tokenizer, the
    # config.json the custom flavor is built from, and the weights.
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    c = parse_args(["--flavor", "custom", "--model.hf_assets_path", str(tmp_path), "--checkpoint.initial_load_in_hf"])
    assert c.checkpoint.initial_load_path == str(tmp_path) and c.model.tokenizer_path == str(tmp_path)
    assert "custom builds the model a Hugging Face folder describes" in config_error(
        ["--flavor", "custom", "--model.hf_assets_path", str(tmp_path)])


def test_a_toml_reports_every_error_at_once(tmp_path):
    path = tmp_path / "tt.toml"
    # A torchtitan 0.2 file with four problems: an unknown section, a refused key, a wrong type, a bad value.
    path.write_text('[job]\ndump_folder = "x"\n[memory_estimationx]\nenable = true\n'
                    '[float8]\nprecompute_float8_dynamic_scale_for_fsdp = true\n'
                    '[training]\nsteps = 0\nlocal_batch_size = "8"\n[optimizer]\nlr = -1.0\n')
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)])
    lines = str(info.value).splitlines()
    assert lines[0] == "5 configuration errors:", lines
    body = "\n".join(lines[1:])
    for part in ("tt.toml: unknown section [memory_estimationx]",
                 "tt.toml: --float8.precompute_float8_dynamic_scale_for_fsdp: not applicable here: ",
                 "tt.toml: training.local_batch_size: expected an integer, got '8'",
                 "--training.steps: expected an integer >= 1, got 0", "--optimizer.lr: expected a finite value > 0"):
        assert part in body, (part, body)
    # The command line's errors come together with the file's.
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path), "--training.stpes", "5", "--comm.trace_buf_size", "0"])
    lines = str(info.value).splitlines()
    assert lines[0] == "7 configuration errors:" and "did you mean --training.steps?" in str(info.value), lines
    # A folder given as the file is one line.
    assert config_error(["--job.config_file", str(tmp_path)]) == (
        f"--config: expected a TOML file, got the folder {str(tmp_path)!r}")


def test_earlier_releases_keys_and_tables_are_read(tmp_path):
    path = tmp_path / "tt.toml"
    # torchtitan 0.1 / 0.2 spellings of our keys, and the 0.2 converter name.
    path.write_text('[checkpoint]\nenable_checkpoint = true\nlast_save_model_weights_only = true\n'
                    '[training]\ncompile = true\n[lr_scheduler]\nlr_min = 0.2\n'
                    '[model]\nconverters = ["quantize.linear.float8"]\n'
                    '[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    c = parse_args(["--config", str(path)])
    assert c.checkpoint.enable and c.checkpoint.model_weights_only and c.compile.enable
    assert c.lr_scheduler.min_lr_factor == 0.2 and c.float8.enable and c.float8.recipe == "rowwise"
    path.write_text("[validation.dataloader]\nnum_workers = 2\n")
    assert config_error(["--config", str(path)]).startswith(
        "tt.toml: --validation.dataloader.num_workers: not applicable here: the data loader reads in the training")
    assert {"0.1.0", "0.2.2"} <= {v for vs in TORCHTITAN_EARLIER.values() for v in vs}
    assert TORCHTITAN_EARLIER["float8.precompute_float8_dynamic_scale_for_fsdp"] == ["0.1.0"]


def test_c4_test_is_the_sample_we_ship():
    from trainer.data.datasets import SAMPLES, build_source

    source = build_source("c4_test")
    docs = list(source.iter_from(0))
    assert len(docs) == 100 and all(len(d) >= 1000 for d in docs)
    assert docs[0].startswith("First Citizen:")  # public-domain text (tests/data/tinyshakespeare.txt)
    assert SAMPLES["c4_test"].stat().st_size < 200_000
    assert parse_args(["--training.dataset", "c4_test"]).training.dataset == "c4_test"


def test_a_bad_value_is_reported_once_not_again_for_the_default_put_back():
    # Collecting every error puts a bad key back to its default and validates again; the budget's
    # default (0) is itself refused in budget mode, which must not come out as a second error about
    # a value the user did not give.
    with pytest.raises(ConfigError) as info:
        parse_args(["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget_gib", "-1",
                    "--optimizer.lr", "-3"])
    lines = str(info.value).splitlines()
    assert lines[0] == "2 configuration errors:", lines
    assert "--activation_checkpoint.memory_budget_gib: expected a finite value >= 0, got -1.0" in lines[2], lines
    assert "got 0" not in str(info.value)
