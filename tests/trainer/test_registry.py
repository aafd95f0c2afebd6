"""The model-family registry: a family registered in a few lines trains end to end; the config, --help,
the flavor lists, Hugging Face model types and the planner read the registry; records round-trip;
FLOPs count the attention score entries that run."""
import json
from dataclasses import dataclass

import pytest
import torch

from trainer import train
from trainer.config import ConfigError, help_text, parse_args
from trainer import registry
from trainer.models.common.args import ModelArgs, attention_entries
from trainer.registry import ModelSpec

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]


# A whole new family: its args (the shared decoder's typed interface plus its own FFN width) and one
# registry call. No other file of the trainer changes.
@dataclass(frozen=True)
class ToyArgs(ModelArgs):
    hidden_dim: int = 48

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


@pytest.fixture
def toy_family():
    spec = registry.register(ModelSpec(name="toy", title="Toy", args_cls=ToyArgs, description="a test family",
                                       flavors={"tiny": ToyArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)}))
    yield spec
    registry.unregister("toy")


def test_a_toy_family_registered_in_a_few_lines_trains(toy_family, tmp_path):
    config = parse_args(["--model.name", "toy", "--flavor", "tiny", "--training.steps", "4", "--training.seq_len", "32",
                         "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--metrics.save_plot", "false",
                         "--job.dump_folder", str(tmp_path)])
    assert train.main(config) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_the_config_and_help_read_the_registry(toy_family):
    assert "toy" in registry.names()
    assert "      toy: tiny\n" in help_text()
    with pytest.raises(ConfigError, match="--model.name: expected one of llama3, qwen3.*toy, got 'toi'"):
        parse_args(["--model.name", "toi"])


def test_registry_errors_and_lookups():
    assert registry.for_hf_model_type("qwen3_moe").name == "qwen3"
    assert registry.for_hf_model_type("gpt2") is None
    with pytest.raises(ValueError, match="model.name: expected one of"):
        registry.get("nope")
    with pytest.raises(ValueError, match="is registered already"):
        registry.register(registry.get("llama3"))
    spec = registry.get("qwen3")
    with pytest.raises(ValueError, match="Hugging Face model_type 'qwen3' belongs to 'qwen3'"):
        registry.register(ModelSpec(name="qwen3b", title="x", args_cls=ToyArgs, flavors={}, hf_model_types=("qwen3",)))
    assert spec.flavor_args("8B").dim == 4096
    with pytest.raises(ValueError, match="flavor: expected one of .* for qwen3, got '9B'"):
        spec.flavor_args("9B")


@pytest.mark.parametrize("family, flavor", [("llama3", "8B"), ("qwen3", "30B-A3B"), ("llama3", "debugmodel")])
def test_args_records_round_trip(family, flavor):
    args = registry.model_args(family, flavor, 258 if flavor == "debugmodel" else 1000, 64)
    back = registry.args_from_record(json.loads(json.dumps(registry.args_record(args))))
    assert back == args and type(back) is type(args)
    # a derived head_dim stays derived: a wider copy re-derives it
    assert back.replace(dim=2 * args.dim).head_dim == (2 * args.dim) // args.n_heads or args.head_dim != \
        args.dim // args.n_heads


def test_unknown_record_fields_are_refused():
    rec = registry.args_record(registry.model_args("llama3", "debugmodel", 258, 64))
    rec["warp_drive"] = 1
    with pytest.raises(ValueError, match="unknown fields warp_drive"):
        registry.args_from_record(rec)


def _count(seq, window=-1, chunk=0):
    i = torch.arange(seq).unsqueeze(1)
    j = torch.arange(seq).unsqueeze(0)
    visible = j <= i
    if window > 0:
        visible &= j > i - window
    if chunk > 0:
        visible &= (i // chunk) == (j // chunk)
    return int(visible.sum())


@pytest.mark.parametrize("seq, window, chunk", [(1, -1, 0), (17, -1, 0), (100, 7, 0), (100, 1, 0), (100, 150, 0),
                                                (129, 128, 0), (100, 0, 16), (100, 5, 16), (64, -1, 64), (10, -1, 3)])
def test_attention_entries_match_a_direct_count_of_the_mask(seq, window, chunk):
    assert attention_entries(seq, True, window, chunk) == _count(seq, window, chunk)


def test_sliding_window_layers_count_their_own_entries():
    full = registry.model_args("qwen3", "debugmodel", 258, 4096)
    sliding = full.replace(layer_types=("sliding_attention",) * full.n_layers, sliding_window=128)
    per_entry = 6 * full.n_heads * (full.qk_head_dim + full.v_head_dim)
    assert sliding.attention_flops_per_token(4096) == full.n_layers * per_entry * _count(4096, 128) / 4096
    assert full.attention_flops_per_token(4096) == full.n_layers * per_entry * _count(4096) / 4096
    assert sliding.flops_per_token(4096) < full.flops_per_token(4096)
