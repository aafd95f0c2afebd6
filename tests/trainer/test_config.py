"""Config parsing: defaults, flavor TOML files, overrides, boolean flags, errors and --help."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from trainer import __main__ as cli
from trainer.config import (
    CONFIG_DIR,
    ConfigError,
    JobConfig,
    all_keys,
    available_flavors,
    parse_args,
    validate_config,
)
from tests.trainer.helpers import config_error

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


# ---- defaults and flavors ------------------------------------------------------------------------


def test_every_flavor_has_a_toml_file():
    assert set(available_flavors()) == set(FLAVORS)
    assert available_flavors()[0] == "debugmodel"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flavor_file_loads_and_validates(flavor):
    config = parse_args(["--flavor", flavor])
    assert config.model.flavor == flavor
    assert config.training.steps >= 1 and config.training.seq_len >= 1
    # --flavor is short for --model.flavor
    assert parse_args(["--model.flavor", flavor]).to_dict() == config.to_dict()


def test_default_run_is_the_debugmodel():
    config = parse_args([])
    assert config.model.flavor == "debugmodel"
    assert config.model.tokenizer_path == ""
    assert config.training.dataset == "pydoc"
    assert config.training.dataset_path == ""
    assert (config.training.local_batch_size, config.training.seq_len) == (8, 256)
    assert config.training.global_batch_size == -1


def test_agreed_defaults_of_the_dataclasses():
    c = JobConfig()
    assert c.job.dump_folder == "./outputs" and c.job.print_config is False
    assert (c.model.name, c.model.flavor) == ("llama3", "debugmodel")
    assert (c.training.local_batch_size, c.training.global_batch_size, c.training.seq_len) == (8, -1, 256)
    assert (c.training.max_norm, c.training.seed, c.training.dtype) == (1.0, 42, "auto")
    assert (c.training.mixed_precision_param, c.training.mixed_precision_reduce) == ("bfloat16", "float32")
    assert (c.training.document_masking, c.training.gc_freq) == (False, 50)
    assert (c.optimizer.name, c.optimizer.lr, c.optimizer.beta1, c.optimizer.beta2) == ("AdamW", 8e-4, 0.9, 0.95)
    assert (c.optimizer.eps, c.optimizer.weight_decay, c.optimizer.implementation) == (1e-8, 0.1, "auto")
    assert (c.lr_scheduler.decay_ratio, c.lr_scheduler.decay_type, c.lr_scheduler.min_lr_factor) == (None, "linear", 0.1)
    assert (c.parallelism.data_parallel_replicate_degree, c.parallelism.data_parallel_shard_degree) == (1, -1)
    ck = c.checkpoint
    assert (ck.enable, ck.folder, ck.interval, ck.keep_latest_k, ck.async_mode) == (False, "checkpoint", 500, 0, "disabled")
    assert (ck.load_step, ck.model_weights_only, ck.export_dtype, ck.create_seed_checkpoint) == (-1, False, "float32", False)
    m = c.metrics
    assert (m.log_freq, m.enable_tensorboard, m.save_tb_folder, m.enable_color) == (10, False, "tb", True)
    assert (c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option) == ("none", "2")
    assert (c.compile.enable, c.compile.components) == (False, ["model", "loss"])
    assert c.kernels.backend == "auto"
    validate_config(c)


def test_list_default_is_not_shared_between_instances():
    a, b = JobConfig(), JobConfig()
    a.compile.components.append("x")
    assert b.compile.components == ["model", "loss"]


# ---- overrides -----------------------------------------------------------------------------------


def test_overrides_of_each_type():
    c = parse_args([
        "--training.steps", "17",
        "--optimizer.lr=3e-4",
        "--training.dataset", "c4",
        "--lr_scheduler.decay_ratio", "0.25",
        "--lr_scheduler.decay_type", "wsd",
        "--compile.components", "model",
        "--checkpoint.load_step", "-1",
        "--training.local-batch-size", "3",
    ])
    assert c.training.steps == 17 and isinstance(c.training.steps, int)
    assert c.optimizer.lr == 3e-4 and isinstance(c.optimizer.lr, float)
    assert c.training.dataset == "c4"
    assert c.lr_scheduler.decay_ratio == 0.25 and c.lr_scheduler.decay_type == "wsd"
    assert c.compile.components == ["model"]
    assert c.checkpoint.load_step == -1
    assert c.training.local_batch_size == 3


def test_float_key_accepts_an_integer_and_optional_accepts_none():
    c = parse_args(["--training.max_norm", "2", "--lr_scheduler.decay_ratio", "none"])
    assert c.training.max_norm == 2.0 and isinstance(c.training.max_norm, float)
    assert c.lr_scheduler.decay_ratio is None


def test_command_line_overrides_the_flavor_file():
    base = parse_args(["--flavor", "8B"])
    c = parse_args(["--flavor", "8B", "--training.steps", "5"])
    assert c.training.steps == 5
    assert c.optimizer.lr == base.optimizer.lr  # the rest still from 8B.toml
    # the last occurrence of a key wins
    assert parse_args(["--training.steps", "5", "--training.steps", "6"]).training.steps == 6


def test_config_file_replaces_the_flavor_file_and_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[training]\nsteps = 7\nseq_len = 33\n[optimizer]\nlr = 1\n[model]\nflavor = "1B"\n')
    c = parse_args(["--config", str(path), "--training.seq_len", "65"])
    assert c.training.steps == 7 and c.training.seq_len == 65
    assert c.optimizer.lr == 1.0 and isinstance(c.optimizer.lr, float)
    assert c.model.flavor == "1B"
    # keys absent from the file keep the dataclass defaults, not debugmodel.toml's
    assert c.lr_scheduler.warmup_steps == JobConfig().lr_scheduler.warmup_steps
    assert c.job.description == ""
    # --flavor after --config overrides only the flavor name
    assert parse_args(["--config", str(path), "--flavor", "3B"]).model.flavor == "3B"


def test_to_toml_round_trips(tmp_path):
    c = parse_args(["--flavor", "70B", "--training.steps", "11", "--lr_scheduler.decay_ratio", "0.5",
                    "--job.description", 'quote " and \\ backslash'])
    path = tmp_path / "dump.toml"
    path.write_text(c.to_toml())
    assert parse_args(["--config", str(path)]).to_dict() == c.to_dict()
    c2 = parse_args([])
    path.write_text(c2.to_toml())  # decay_ratio None is written as a comment and read back as None
    assert parse_args(["--config", str(path)]).to_dict() == c2.to_dict()


def test_to_dict_has_every_section():
    d = parse_args([]).to_dict()
    assert list(d) == ["job", "model", "training", "optimizer", "lr_scheduler", "parallelism", "checkpoint",
                       "metrics", "validation", "profiling", "activation_checkpoint", "compile", "kernels", "float8",
                       "comm", "fault_tolerance", "flux"]
    assert sorted(f"{s}.{k}" for s in d for k in d[s]) == sorted(all_keys())


# ---- boolean flags -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "--training.steps", "3"], True),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable", "False"], False),
        (["--checkpoint.enable", "0"], False),
        (["--checkpoint.enable", "1"], True),
        (["--checkpoint.enable", "no"], False),
        (["--checkpoint.enable", "on"], True),
        (["--checkpoint.enable=false"], False),
        (["--checkpoint.enable", "--checkpoint.enable", "false"], False),
    ],
)
def test_boolean_flag_forms(argv, expected):
    assert parse_args(argv).checkpoint.enable is expected


def test_bare_flag_turns_off_a_true_default():
    assert parse_args([]).metrics.enable_color is True
    assert parse_args(["--metrics.enable_color", "false"]).metrics.enable_color is False


# ---- errors --------------------------------------------------------------------------------------


def test_misspelled_key_suggests_the_closest():
    assert "did you mean --training.steps?" in config_error(["--training.stpes", "3"])
    assert "--training.stpes" in config_error(["--training.stpes", "3"])
    assert "did you mean --optimizer.lr?" in config_error(["--optimiser.lr", "3"])
    assert "did you mean --checkpoint.keep_latest_k?" in config_error(["--checkpoint.keep_last_k", "2"])


def test_key_without_section_suggests_the_sectioned_key():
    assert "did you mean --training.seq_len?" in config_error(["--seq_len", "128"])
    assert "did you mean --model.tokenizer_path?" in config_error(["--tokenizer_path", "x"])


def test_key_in_the_wrong_section_suggests_the_right_section():
    assert "did you mean --optimizer.lr?" in config_error(["--training.lr", "1"])
    assert "did you mean --lr_scheduler.warmup_steps?" in config_error(["--optimizer.warmup_steps", "3"])
    assert "did you mean --training.seq_len?" in config_error(["--model.seq_len", "3"])


def test_unrelated_key_points_to_help():
    msg = config_error(["--zzzzqqq", "1"])
    assert "--zzzzqqq" in msg and "--help" in msg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--training.steps", "ten"], "--training.steps: expected an integer, got 'ten'"),
        (["--training.steps", "1.5"], "--training.steps: expected an integer, got '1.5'"),
        (["--optimizer.lr", "fast"], "--optimizer.lr: expected a number, got 'fast'"),
        (["--checkpoint.enable", "maybe"], "--checkpoint.enable: expected true/false, got 'maybe'"),
        (["--lr_scheduler.decay_ratio", "half"], "--lr_scheduler.decay_ratio: expected none or a number"),
        (["--training.steps"], "--training.steps: missing value (expected an integer)"),
        (["--training.steps", "--optimizer.lr", "1"], "--training.steps: missing value"),
        (["--config"], "--config: missing value"),
        (["steps=3"], "unexpected argument 'steps=3'"),
    ],
)
def test_wrong_type_or_missing_value_names_the_key(argv, needle):
    assert needle in config_error(argv)


def test_bad_choice_lists_the_choices_and_suggests():
    msg = config_error(["--lr_scheduler.decay_type", "cosin"])
    assert "--lr_scheduler.decay_type" in msg and "linear, cosine, wsd" in msg and "did you mean 'cosine'?" in msg
    msg = config_error(["--flavor", "8b"])
    assert "--model.flavor" in msg and "did you mean '8B'?" in msg
    assert "--checkpoint.async_mode" in config_error(["--checkpoint.async_mode", "sometimes"])
    assert "--kernels.backend" in config_error(["--kernels.backend", "tpu"])
    assert "--compile.components" in config_error(["--compile.components", "model,optimizer"])


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.steps", "0"], "--training.steps"),
        (["--training.local_batch_size", "0"], "--training.local_batch_size"),
        (["--training.global_batch_size", "0"], "--training.global_batch_size"),
        (["--training.global_batch_size", "12"], "--training.global_batch_size"),  # not a multiple of 8
        (["--training.seq_len", "-5"], "--training.seq_len"),
        (["--training.max_norm", "0"], "--training.max_norm"),
        (["--training.max_norm", "nan"], "--training.max_norm"),
        (["--optimizer.lr", "-1e-3"], "--optimizer.lr"),
        (["--optimizer.lr", "inf"], "--optimizer.lr"),
        (["--optimizer.beta2", "1.0"], "--optimizer.beta2"),
        (["--optimizer.eps", "0"], "--optimizer.eps"),
        (["--lr_scheduler.warmup_steps", "-1"], "--lr_scheduler.warmup_steps"),
        (["--lr_scheduler.min_lr_factor", "1.5"], "--lr_scheduler.min_lr_factor"),
        (["--lr_scheduler.decay_ratio", "2"], "--lr_scheduler.decay_ratio"),
        (["--parallelism.data_parallel_shard_degree", "0"], "--parallelism.data_parallel_shard_degree"),
        (["--parallelism.data_parallel_replicate_degree", "-1"], "--parallelism.data_parallel_replicate_degree"),
        (["--checkpoint.interval", "0"], "--checkpoint.interval"),
        (["--checkpoint.keep_latest_k", "-2"], "--checkpoint.keep_latest_k"),
        (["--checkpoint.load_step", "-3"], "--checkpoint.load_step"),
        (["--metrics.log_freq", "0"], "--metrics.log_freq"),
        (["--activation_checkpoint.selective_ac_option", "sometimes"], "--activation_checkpoint.selective_ac_option"),
        (["--training.dataset_path", "/no/such/file.txt"], "--training.dataset_path"),
        (["--model.tokenizer_path", "/no/such/tokenizer.json"], "--model.tokenizer_path"),
    ],
)
def test_invalid_values_name_the_key(argv, key):
    msg = config_error(argv)
    assert msg.startswith(key + ":"), msg
    assert "expected" in msg or "no such" in msg


def test_validate_checks_the_types_of_a_config_built_in_code():
    c = JobConfig()
    c.training.steps = "10"
    with pytest.raises(ConfigError, match=r"--training.steps: expected an integer, got '10' \(str\)"):
        validate_config(c)
    c = JobConfig()
    c.checkpoint.enable = 1
    with pytest.raises(ConfigError, match="--checkpoint.enable: expected true/false"):
        validate_config(c)
    c = JobConfig()
    c.optimizer.lr = 1  # an int where a float belongs is fine
    validate_config(c)


def test_toml_errors(tmp_path):
    cases = {
        "[training]\nstpes = 3\n": "did you mean --training.steps?",
        "[trainng]\nsteps = 3\n": "did you mean [training]?",
        '[training]\nsteps = "3"\n': "training.steps: expected an integer, got '3' (str)",
        "[checkpoint]\nenable = 1\n": "checkpoint.enable: expected true/false",
        "[training]\nsteps = 3.5\n": "training.steps: expected an integer",
        "[compile]\ncomponents = [1]\n": "compile.components: expected a comma-separated list",
        "[training\nsteps = 3\n": "not valid TOML",
        "training = 3\n": "expected a [training] table",
    }
    for i, (text, needle) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(text)
        msg = config_error(["--config", str(path)])
        assert needle in msg, (text, msg)
        assert msg.startswith(path.name), msg
    assert "file not found" in config_error(["--config", str(tmp_path / "missing.toml")])


def test_grad_accum_steps():
    c = parse_args(["--training.local_batch_size", "2", "--training.global_batch_size", "8"])
    assert c.grad_accum_steps(1) == 4
    assert c.grad_accum_steps(2) == 2
    assert c.grad_accum_steps(4) == 1
    with pytest.raises(ConfigError, match="--training.global_batch_size: 8 is not a multiple of .* = 6"):
        c.grad_accum_steps(3)
    assert parse_args([]).grad_accum_steps(8) == 1  # -1: one micro-batch per rank


# ---- help and the command line ----------------------------------------------------------------


def test_help_lists_every_key_with_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key in all_keys():
        assert f"--{key} (default: " in out, key
    assert "--training.steps (default: 200)" in out  # debugmodel.toml's value
    assert "Number of optimizer steps." in out
    assert "--flavor" in out and "--config" in out
    # help for another flavor shows that flavor's defaults
    with pytest.raises(SystemExit):
        parse_args(["--flavor", "8B", "-h"])
    assert "--training.seq_len (default: 8192)" in capsys.readouterr().out


def test_cli_main_returns_2_with_one_lineconfig_error(capsys):
    assert cli.main(["--training.stpes", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean --training.steps?" in err


def test_cli_main_runs_the_trainer_and_passes_its_exit_code(monkeypatch, capsys):
    import types

    seen = []

    def fake_train_main(config):
        seen.append(config)
        if config.training.steps == 2:
            raise ConfigError("--training.global_batch_size: 8 is not a multiple of 3")
        if config.training.steps == 3:
            raise KeyboardInterrupt
        return 7

    monkeypatch.setitem(sys.modules, "trainer.train", types.SimpleNamespace(main=fake_train_main))
    assert cli.main(["--training.steps", "5", "--job.print_config"]) == 7
    assert seen[-1].training.steps == 5
    out = capsys.readouterr().out
    assert "[training]" in out and "steps = 5" in out  # print_config prints the TOML
    assert cli.main(["--training.steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "python -m trainer: error: --training.global_batch_size: 8 is not a multiple of 3")
    assert cli.main(["--training.steps", "3"]) == 130


def test_python_m_trainer_help_and_errors_are_fast_and_torch_free():
    run = dict(capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    start = time.perf_counter()
    help_run = subprocess.run([sys.executable, "-m", "trainer", "--help"], **run)
    bad_run = subprocess.run([sys.executable, "-m", "trainer", "--training.steps", "x"], **run)
    elapsed = time.perf_counter() - start
    assert help_run.returncode == 0 and "--training.steps" in help_run.stdout
    assert bad_run.returncode == 2
    assert bad_run.stderr.strip().count("\n") == 0 and "Traceback" not in bad_run.stderr
    assert "--training.steps: expected an integer, got 'x'" in bad_run.stderr
    assert elapsed < 20, f"--help and a config error took {elapsed:.1f}s (torch should not be imported)"
    probe = subprocess.run([sys.executable, "-c", "import sys, trainer.config; print('torch' in sys.modules)"], **run)
    assert probe.stdout.strip() == "False"


def test_config_dir_is_inside_the_package():
    assert CONFIG_DIR.name == "configs" and (CONFIG_DIR / "llama3" / "debugmodel.toml").is_file()


def test_a_config_error_under_torchrun_is_printed_by_rank_0_alone(monkeypatch, capsys):
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["--training.stpes", "3"]) == 2
        err = capsys.readouterr().err
        assert ("did you mean --training.steps?" in err) is printed and len(err.splitlines()) == int(printed)
