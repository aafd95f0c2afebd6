"""Options a model does not use are refused, not ignored (issue 30, items 5 and 12): every option of
``ModelArgs.OPTIONS`` given to a flavor that does not read it is one line at parse time (the flavor's
args) or before the model is built (``--flavor custom``: the config.json's); group rules that give
Muon a vector and QK-clip on a QK-norm model are configuration errors before the model is built."""
import pytest

from tests.trainer.helpers import config_error
from trainer import train
from trainer.config import ConfigError, JobConfig, parse_args
from trainer.hf import args_from_hf_config
from trainer import registry
from trainer.models.common.args import ModelArgs
from trainer.config.model_options import unused_option_errors
from trainer.optim.groups import settings

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# A value away from the default for each option only some models use.
GIVEN = {"model.moe_load_balance": "none", "model.moe_bias_update_rate": "0.01", "model.moe_aux_loss_coeff": "0.01",
         "parallelism.expert_parallel_degree": "2", "model.mtp_layers": "2", "training.mtp_loss_weight": "0.1",
         "optimizer.qk_clip_threshold": "50"}


def test_every_option_is_used_by_the_flavor_or_refused_in_one_line():
    assert set(GIVEN) == set(ModelArgs.OPTIONS)
    seen = {"used": 0, "refused": 0}
    for family in registry.names():
        for flavor in registry.get(family).flavors:
            if not flavor.startswith("debug"):
                continue
            for key, value in GIVEN.items():
                argv = ["--model.name", family, "--flavor", flavor, f"--{key}", value]
                if key == "parallelism.expert_parallel_degree":
                    argv += ["--parallelism.data_parallel_shard_degree", "2"]
                args = registry.get(family).flavor_args(flavor)
                try:
                    config = parse_args(argv)
                except ConfigError as exc:
                    msg = str(exc)
                    assert "\n" not in msg and msg.startswith(f"--{key}: {registry.get(family).title} {flavor} "), msg
                    assert "expected it unset" in msg, msg
                    seen["refused"] += 1
                    continue
                # Accepted: the model reads it (the option changes its args or is one of its features).
                uses, _ = ModelArgs.OPTIONS[key] if key not in type(args).OPTIONS else type(args).OPTIONS[key]
                assert uses(args.configure(config.model)), (family, flavor, key)
                seen["used"] += 1
    assert seen["used"] and seen["refused"]


@pytest.mark.parametrize("argv, message", [
    (["--model.mtp_layers", "2"], "--model.mtp_layers: Llama 3 debugmodel has no multi-token prediction modules"),
    (["--model.name", "qwen3", "--model.moe_load_balance", "aux_loss"],
     "--model.moe_load_balance: Qwen3 debugmodel has no mixture of experts; expected it unset ('bias'), got 'aux_loss'"),
    (["--model.name", "deepseek_v3", "--model.mtp_layers", "0", "--training.mtp_loss_weight", "0.1"],
     "--training.mtp_loss_weight: DeepSeek-V3 debugmodel has no multi-token prediction modules to weigh"),
    (["--model.name", "qwen3", "--optimizer.name", "muon", "--optimizer.qk_clip_threshold", "100"],
     "--optimizer.qk_clip_threshold: Qwen3 debugmodel has QK-norm"),
    (["--optimizer.groups", "norm: optimizer=muon"], "the norm parameters are vectors"),
    (["--optimizer.groups", "bias: optimizer=muon"], "the bias parameters are vectors"),
    (["--optimizer.qk_clip_threshold", "50", "--parallelism.context_parallel_degree", "2"],
     "--optimizer.qk_clip_threshold: expected none with parallelism.context_parallel_degree > 1"),
])
def test_refused_at_parse_time_in_one_line(argv, message):
    assert message in config_error(argv)


def test_a_glob_that_gives_muon_a_vector_fails_before_the_model_is_built(tmp_path):
    config = parse_args(["--optimizer.name", "muon", "--optimizer.groups", "layers.*: optimizer=muon",
                         "--training.seq_len", "32", "--job.dump_folder", str(tmp_path)])
    trainer = train.Trainer(config)
    with pytest.raises(ConfigError, match=r"--optimizer\.groups: Muon needs a matrix .* 'layers\.0\.attention_norm"):
        trainer.setup()
    assert trainer.model is None and trainer.loader is None  # neither the model nor the data was built


def test_a_custom_flavor_is_checked_against_its_config_json():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, "intermediate_size": 96}
    args, _ = args_from_hf_config(cfg, "x")
    config = JobConfig()
    config.model.mtp_layers = 2
    config.optimizer.qk_clip_threshold = 30.0
    assert unused_option_errors(config, args, "Llama custom") == [
        "--model.mtp_layers: Llama custom has no multi-token prediction modules (deepseek_v3 has); expected it unset "
        "(-1), got 2"]


def test_gpt_oss_expert_biases_stay_on_adamw_under_muon():
    args = registry.get("gpt_oss").flavors["debugmodel"].replace(vocab_size=64)
    model = registry.build_model(args, "meta")
    kinds = {s.name: (s.kind, s.optimizer) for _, s in settings(model, "muon", 0.1, [])}
    assert kinds["layers.0.feed_forward.experts.w1_bias"] == ("bias", "adamw")
    assert kinds["layers.0.feed_forward.experts.w1"] == ("expert", "muon")
