"""Hugging Face configs whose layers mix sliding-window and full attention load and give transformers'
logits: Qwen3 with ``use_sliding_window`` (the layers from ``max_window_layers`` sliding, or an explicit
``layer_types``) and Qwen3-MoE (every layer sliding), windows shorter than the sequence; exported
back, they keep their layer types."""
import pytest
import torch

from trainer.hf import HFCheckpoint, hf_config, load_into_model
from trainer.registry import build_model

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (the [test] extra)")
pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _hf(moe: bool, **overrides):
    kw = dict(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6,
              use_sliding_window=True, sliding_window=5, attn_implementation="eager")
    if moe:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True)
    kw.update(overrides)
    conf_cls, cls = ((transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM) if moe
                     else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    torch.manual_seed(1)
    model = cls(conf_cls(**kw)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("moe, overrides, types", [
    (False, {"max_window_layers": 1}, ("full_attention", "sliding_attention", "sliding_attention")),
    (False, {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     ("sliding_attention", "full_attention", "sliding_attention")),
    (True, {}, ("sliding_attention",) * 3),
], ids=["max_window_layers", "layer_types", "moe"])
def test_sliding_window_configs_give_transformers_logits(tmp_path, moe, overrides, types):
    hf = _hf(moe, **overrides)
    hf.save_pretrained(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.args.layer_types == types and ckpt.args.sliding_window == 5
    ours = build_model(ckpt.args, "cpu")
    ours.init_weights(0)
    load_into_model(ours, ckpt)
    tokens = torch.randint(0, 67, (2, 21))
    with torch.no_grad():
        assert _rel(ours.eval()(tokens), hf(tokens).logits) < 1e-5
    cfg = hf_config(ckpt.args)  # and back: the same layer types
    assert cfg["use_sliding_window"] and cfg["sliding_window"] == 5
    assert cfg.get("layer_types", list(types)) == list(types)
