"""Hugging Face checkpoints of Qwen3 dense and MoE: transformers' Qwen3ForCausalLM /
Qwen3MoeForCausalLM are the reference, random tiny ones (all weights, norms and router included)
built from transformers' own config classes and saved in several shards with an index: QK-norm,
head_dim != dim / n_heads, tied embeddings, per-expert and fused expert tensors, a dense first layer
(mlp_only_layers), normalised and raw top-k weights, top-1; the unsupported configs refused by name;
the balancing-bias warning; a debugmodel_moe run from and to a Qwen3-MoE folder; EP 2 import and
export. (Llama 3 and what all families share: test_hf.py.)
"""
import json

import pytest
import torch

from trainer import train
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.folder import CheckpointError, load_weights, read_model_args
from trainer.config import parse_args
from trainer.convert import main as convert_main
from trainer.hf import INDEX, HFCheckpoint, HFCheckpointError, args_from_hf_config, expected_shapes, hf_config
from trainer.hf import load_into_model
from trainer.checkpoint.hf_convert import dcp_to_hf, hf_to_dcp
from trainer.models.common.moe_args import MoEArgs
from trainer.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from trainer.registry import build_model
from tests.trainer.helpers import cpu_model, rel
from tests.trainer.hf_parity import TINY_LLAMA, first_batch, hf_llama, hf_loss, logits_of, one_line, save_hf

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra (pip install -e .[test])")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::UserWarning",
                                         "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]  # one intra-op thread (tests/trainer/conftest.py)

# Awkward sizes: head_dim 12 (not dim / n_heads = 8), GQA 4:2, 5 experts of 20, top-2, a dense first
# layer before two MoE layers (mlp_only_layers [0]), a vocabulary no power of two.
Q_DENSE = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, hidden_dim=40, vocab_size=67,
                    max_seq_len=32, tie_word_embeddings=True)
Q_MOE = Qwen3Args(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, hidden_dim=40, vocab_size=67,
                  max_seq_len=32, moe=MoEArgs(num_experts=5, top_k=2, hidden_dim=20), n_dense_layers=1)


def _qwen3_classes(moe: bool):
    if not (hasattr(transformers, "Qwen3ForCausalLM") and hasattr(transformers, "Qwen3MoeForCausalLM")):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3 / Qwen3-MoE classes (added in 4.51)")
    if moe:
        return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    return transformers.Qwen3Config, transformers.Qwen3ForCausalLM


def _randomize(model, seed: int):
    """Every weight random (matrices and fused experts ~N(0, 0.2), norms in [0.5, 1.5]): a wrong
    permutation, transpose or expert order shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name != "lm_head.weight" or not getattr(model.config, "tie_word_embeddings", False):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_qwen3(moe: bool, seed: int = 0, **overrides):
    """A random transformers Qwen3 / Qwen3-MoE model built from its own config class."""
    conf_cls, cls = _qwen3_classes(moe)
    kw = dict(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=3 if moe else 2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=32,
              rms_norm_eps=1e-6, tie_word_embeddings=not moe)
    if moe:
        kw.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True,
                  mlp_only_layers=[0], decoder_sparse_step=1)
    kw.update(overrides)
    conf = conf_cls(**kw)
    conf._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _randomize(cls(conf).float(), seed)


def _our_qwen3(args: Qwen3Args, seed: int = 0):
    """Our model with every weight random, norms included (not init_weights' ones)."""
    model = cpu_model(args, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("args", [Q_DENSE, Q_MOE, QWEN3_FLAVORS["30B-A3B"], QWEN3_FLAVORS["0.6B"],
                                  QWEN3_FLAVORS["debugmodel_moe"].replace(vocab_size=258),
                                  Q_MOE.replace(moe=MoEArgs(num_experts=5, top_k=2, hidden_dim=20, num_shared_experts=1)),
                                  TINY_LLAMA],
                         ids=["tiny-dense", "tiny-moe", "30B-A3B", "0.6B", "debugmodel_moe", "shared-experts", "llama"])
def test_expected_shapes_are_the_built_models(args):
    model = build_model(args, "meta")  # no memory
    assert list(expected_shapes(args).items()) == [(k, tuple(p.shape)) for k, p in model.named_parameters()]
    bufs = {k: tuple(b.shape) for k, b in model.state_dict().items() if k not in dict(model.named_parameters())}
    with_bufs = expected_shapes(args, buffers=True)
    assert {k: v for k, v in with_bufs.items() if k not in expected_shapes(args)} == bufs
    assert all(k.endswith("feed_forward.expert_bias") for k in bufs) and len(bufs) == getattr(args, "n_moe_layers", 0)


@pytest.mark.parametrize("flavor", list(QWEN3_FLAVORS))
def test_every_flavor_config_reads_back_as_that_flavor(flavor):
    args = QWEN3_FLAVORS[flavor]
    if args.vocab_size == -1:
        args = args.replace(vocab_size=258)
    cfg = json.loads(json.dumps(hf_config(args, torch.bfloat16)))
    assert cfg["model_type"] == ("qwen3_moe" if args.moe else "qwen3") and cfg["head_dim"] == args.head_dim
    back, name = args_from_hf_config(cfg)
    assert name == flavor and back == args


def test_the_published_30b_a3b_config_is_that_flavor():
    # Qwen/Qwen3-30B-A3B config.json (the fields that matter, as published)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
           "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
           "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
           "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_sliding_window": False, "vocab_size": 151936}
    args, flavor = args_from_hf_config(cfg)
    assert flavor == "30B-A3B" and args.max_seq_len == 40960 and args.moe.route_norm
    assert args == QWEN3_FLAVORS["30B-A3B"].replace(max_seq_len=40960)
    # transformers >= 5 writes num_local_experts (its attribute behind num_experts)
    cfg2 = {k: v for k, v in cfg.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert args_from_hf_config(cfg2) == (args, "30B-A3B")


@pytest.mark.parametrize("moe", [False, True], ids=["dense-tied", "moe"])
def test_qwen3_export_loads_in_transformers_with_our_logits_and_imports_back_equal(tmp_path, moe):
    args = Q_MOE if moe else Q_DENSE
    _qwen3_classes(moe)
    ours = _our_qwen3(args)
    Checkpointer(tmp_path / "ckpt", ours, model_args=args, flavor="custom").save_seed()
    rc = convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max_shard_size", "20KB"])
    assert rc == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    assert (cfg["head_dim"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == (12, 1e6, not moe)
    names = json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.1.self_attn.k_norm.weight" in names
    assert ("lm_head.weight" in names) is moe  # tied: transformers ties it on load
    if moe:
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["norm_topk_prob"],
                cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == (5, 2, 20, True, 1, [0])
        # per expert, as save_pretrained writes them; layer 0 is dense (mlp_only_layers)
        assert {f"model.layers.2.mlp.experts.4.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= set(names)
        assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
        assert not any("expert_bias" in n for n in names)
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    hf = cls.from_pretrained(tmp_path / "hf").float().eval()
    assert hf.config.tie_word_embeddings is (not moe)
    tokens = torch.randint(0, args.vocab_size, (3, 17))
    with torch.no_grad():
        assert rel(hf(tokens).logits, logits_of(ours, tokens)) < 1e-5
    # and back, by both readers: the same weights exactly
    ckpt = HFCheckpoint(tmp_path / "hf")
    assert ckpt.family == "qwen3" and ckpt.flavor == "custom" and ckpt.args == args
    back = cpu_model(args, seed=5)
    assert load_into_model(back, ckpt) == len(list(back.parameters()))
    want = ours.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items()), "round trip"
    dcp_dir = hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert read_model_args(dcp_dir) == (args, "custom")
    again = cpu_model(args, seed=9)
    load_weights(again, dcp_dir)  # strict: the expert_bias buffers are in the DCP folder too
    assert all(torch.equal(t, want[k]) for k, t in again.state_dict().items())


@pytest.mark.parametrize("moe, overrides", [(False, {}), (True, {}), (True, {"norm_topk_prob": False}),
                                            (True, {"num_experts_per_tok": 1, "norm_topk_prob": False})],
                         ids=["dense", "moe", "moe-unnormalised", "moe-top1"])
def test_import_of_transformers_qwen3_gives_its_logits(tmp_path, moe, overrides):
    hf = _hf_qwen3(moe, **overrides)
    folder = save_hf(hf, tmp_path / "hf", shard="30KB")
    assert (folder / INDEX).is_file()
    tokens = torch.randint(0, 67, (2, 19))
    with torch.no_grad():
        want = hf(tokens).logits
    ckpt = HFCheckpoint(folder)
    a = ckpt.args
    assert (ckpt.family, a.head_dim, a.qk_norm, a.tie_word_embeddings) == ("qwen3", 12, True, not moe)
    if moe:
        assert (a.moe.num_experts, a.moe.top_k, a.moe.hidden_dim, a.n_dense_layers) == (
            5, overrides.get("num_experts_per_tok", 2), 20, 1)
        assert a.moe.route_norm is overrides.get("norm_topk_prob", True)
    ours = cpu_model(a, seed=1)
    load_into_model(ours, ckpt)
    assert rel(logits_of(ours.eval(), tokens), want) < 1e-5


def test_import_reads_the_fused_expert_layout(tmp_path):
    """transformers >= 5 holds experts fused in memory (gate_up_proj (E, 2h, d), down_proj (E, d, h));
    a folder of those tensors (safetensors written from its state_dict) imports too."""
    from safetensors.torch import save_file

    hf = _hf_qwen3(True, seed=4)
    sd = hf.state_dict()
    if "model.layers.1.mlp.experts.gate_up_proj" not in sd:
        pytest.skip("this transformers keeps experts per expert in memory; the per-expert layout is tested above")
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "fused" / "model.safetensors"))
    hf.config.to_json_file(str(tmp_path / "fused" / "config.json"))
    tokens = torch.randint(0, 67, (2, 13))
    ckpt = HFCheckpoint(tmp_path / "fused")
    assert ckpt.names_of("layers.1.feed_forward.experts.w3") == ["model.layers.1.mlp.experts.gate_up_proj"]
    ours = cpu_model(ckpt.args, seed=2)
    load_into_model(ours, ckpt)
    with torch.no_grad():
        assert rel(logits_of(ours.eval(), tokens), hf(tokens).logits) < 1e-5


_MOE_CFG = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 67,
            "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 20, "norm_topk_prob": True}


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] is not supported \(only the first k layers"),
    ({"shared_expert_intermediate_size": 64}, "shared experts .* not supported"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok 1 with norm_topk_prob true is not supported"),
    ({"num_experts": 0}, "expected integers >= 1, got num_experts 0"),
    ({"use_sliding_window": True, "sliding_window": None}, "use_sliding_window needs an integer sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "without use_sliding_window"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' lacks an integer original_max"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope scaling type 'dynamic' is not supported"),
    ({"num_experts_per_tok": 6}, "MoEArgs.top_k: expected at most num_experts=5"),
], ids=lambda v: str(v)[:40])
def test_unsupported_qwen3_configs_are_refused_in_one_line(change, message):
    with pytest.raises(HFCheckpointError, match=message) as e:
        args_from_hf_config({**_MOE_CFG, **change}, "x/config.json")
    assert one_line(str(e.value)) and str(e.value).startswith("x/config.json: ")


@pytest.mark.parametrize("moe, what", [(MoEArgs(num_experts=5, top_k=2, hidden_dim=20, num_shared_experts=1),
                                        "num_shared_experts=1"),
                                       (MoEArgs(num_experts=5, top_k=2, hidden_dim=20, score_func="sigmoid"),
                                        "score_func='sigmoid'"),
                                       (MoEArgs(num_experts=5, top_k=2, hidden_dim=20, route_scale=2.5),
                                        "route_scale=2.5")], ids=["shared", "sigmoid", "scale"])
def test_export_of_what_hf_qwen3_moe_cannot_express_is_refused(tmp_path, capsys, moe, what):
    args = Q_MOE.replace(moe=moe)
    model = cpu_model(args)
    Checkpointer(tmp_path / "ckpt", model, model_args=args).save_seed()
    with pytest.raises(HFCheckpointError, match=f"Hugging Face Qwen3-MoE has softmax routing .*{what}"):
        dcp_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything was written
    capsys.readouterr()
    assert convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf2")]) == 1  # the CLI: exit 1
    err = capsys.readouterr().err
    assert one_line(err) and err.startswith("python -m trainer.convert: error: ") and what in err, err


def test_export_warns_that_hf_routes_without_our_balancing_bias(tmp_path, caplog):
    ours = _our_qwen3(Q_MOE)
    with torch.no_grad():
        ours.layers["2"].feed_forward.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.1, 0.0, 0.05]))
    Checkpointer(tmp_path / "ckpt", ours, model_args=Q_MOE).save_seed()
    with caplog.at_level("WARNING", logger="trainer"):
        dcp_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "1 MoE layer(s) have a non-zero load-balancing expert_bias (largest |bias| 0.3, " \
           "layers.2.feed_forward.expert_bias)" in msg
    back = cpu_model(Q_MOE)
    with torch.no_grad():
        back.layers["2"].feed_forward.expert_bias.fill_(1.0)
    load_into_model(back, HFCheckpoint(tmp_path / "hf"))
    assert torch.count_nonzero(back.layers["2"].feed_forward.expert_bias) == 0  # Hugging Face routes without it
    Checkpointer(tmp_path / "zero", back, model_args=Q_MOE).save_seed()  # a zero bias: no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):
        dcp_to_hf(tmp_path / "zero", tmp_path / "hf-zero")
    assert not caplog.records


def test_qwen3_folders_of_another_model_are_refused_with_the_difference(tmp_path):
    folder = save_hf(_hf_qwen3(True), tmp_path / "hf", shard="1MB")
    four = Q_MOE.replace(moe=Q_MOE.moe.replace(num_experts=4))
    model = cpu_model(four)
    ck = Checkpointer(tmp_path / "c", model, model_args=four, flavor="custom")
    with pytest.raises(CheckpointError, match="shapes do not match flavor 'custom': moe.num_experts 5 vs 4") as e:
        ck.initial_load(folder, in_hf=True)
    assert one_line(str(e.value))
    llama = save_hf(hf_llama(TINY_LLAMA), tmp_path / "llama")
    with pytest.raises(CheckpointError, match="shapes do not match flavor 'custom': family llama3 vs qwen3"):
        ck.initial_load(llama, in_hf=True)
    # a config that says 5 experts over tensors of 4: the tensor named, with both shapes
    cfg = json.loads((folder / "config.json").read_text())
    cfg["moe_intermediate_size"] = 24
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"tensor model.layers.1.mlp.experts.0.gate_proj.weight has shape "
                                                r"\(20, 32\), expected \(24, 32\)"):
        hf_to_dcp(folder, tmp_path / "dcp")
    # a missing expert matrix is named
    (tmp_path / "gap").mkdir()
    ckpt = HFCheckpoint(save_hf(_hf_qwen3(True), tmp_path / "gap" / "hf", shard="1MB"))
    del ckpt.weight_map["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(HFCheckpointError, match="tensor model.layers.2.mlp.experts.3.up_proj.weight is missing"):
        ckpt.check_names()


def test_train_qwen3_moe_from_and_to_hugging_face(tmp_path, monkeypatch, caplog):
    """--model.name qwen3 --flavor debugmodel_moe from a transformers Qwen3MoeForCausalLM folder to
    one: step 1's loss is transformers' loss on the first batch, the loss falls, and the exported
    folder loads in transformers with the trained model's logits (balancing off: expert_bias stays
    zero, so transformers routes as we do)."""
    from trainer.models.common.moe import moe_modules

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    # debugmodel_moe's shapes (trainer/models/qwen3/args.py), the byte tokenizer's vocabulary
    hf = _hf_qwen3(True, seed=6, vocab_size=258, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=32, max_position_embeddings=4096,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=[],
                   rope_theta=1e6)
    with torch.no_grad():  # matrices N(0, 0.02) as an initialised model: a loss near ln(258) that can fall
        for name, p in hf.named_parameters():
            if p.ndim > 1:
                p.mul_(0.1)
    src = save_hf(hf, tmp_path / "hf-in", shard="2MB")
    steps, lr = 6, "3e-3"
    argv = ["--model.name", "qwen3", "--flavor", "debugmodel_moe", "--model.moe_load_balance", "none",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
            "--optimizer.lr", lr, "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--metrics.enable_color", "false", "--metrics.save_plot", "false",
            "--checkpoint.initial_load_path", str(src), "--checkpoint.initial_load_in_hf",
            "--checkpoint.last_save_in_hf"]
    config = parse_args([*argv, "--job.dump_folder", str(tmp_path / "run")])
    batch = first_batch(config)
    start_logits, want = hf_loss(hf, batch)
    trainer = train.Trainer(config)
    try:
        with caplog.at_level("WARNING", logger="trainer"):
            assert trainer.setup() is True
        assert not [r for r in caplog.records if "not exactly the one saved" in r.getMessage()]  # same math
        first = float(trainer.train_step())
        assert first == pytest.approx(want, rel=1e-5)  # training started from transformers' weights
        trainer.train()
        model = trainer.model.eval()
        moes = moe_modules(model)
        assert len(moes) == 4 and all(torch.count_nonzero(m.expert_bias) == 0 for _, m in moes)
        ours = logits_of(model, batch["input_ids"])
    finally:
        trainer.close()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == steps and losses[0] == pytest.approx(first, rel=1e-6)
    assert max(losses[-2:]) < losses[0] - 1.0, losses
    out = tmp_path / "run" / "checkpoint" / f"hf-step-{steps}"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 2, 256)
    assert not list((tmp_path / "run" / "checkpoint").glob(".*"))  # no temporary export left
    trained = transformers.Qwen3MoeForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        got = trained(batch["input_ids"]).logits
    assert rel(got, ours) < 1e-4 and rel(got, start_logits) > 1e-2  # the trained weights, not the start


def _ep2_load_and_export(rank, world_size, hf_dir, out_dir):
    from torch.distributed.tensor import DTensor

    from trainer.parallel.expert_parallel import shard_experts
    from trainer.parallel.parallel_dims import ParallelDims

    ckpt = HFCheckpoint(hf_dir)
    args = ckpt.args
    mesh = ParallelDims(1, -1, world_size, ep=2).build_mesh("cpu")
    model = build_model(args, "meta")
    shard_experts(model, mesh, 2, 1)
    model.to_empty(device="cpu")
    model.init_weights(0)
    load_into_model(model, ckpt)
    whole = cpu_model(args, seed=1)
    load_into_model(whole, HFCheckpoint(hf_dir))
    want = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        if ".experts." in name:  # this rank's 2 of the 4 experts only
            assert isinstance(p, DTensor) and p.to_local().shape[0] == 2, name
            assert torch.equal(p.to_local(), want[name][2 * rank:2 * rank + 2]), name
        else:
            assert torch.equal(p, want[name]), name
    out = Checkpointer(out_dir, model, model_args=args, flavor="custom").export_hf(1)
    if rank == 0:
        got, src = HFCheckpoint(out), HFCheckpoint(hf_dir)
        assert set(got.weight_map) == set(src.weight_map)
        for name in src.weight_map:
            assert torch.equal(got.tensor(name), src.tensor(name)), name


def test_qwen3_moe_import_and_export_under_expert_parallel(tmp_path):
    """EP 2 (2 gloo ranks): each rank keeps its experts of the stacked (E, in, out) import, and the
    export gathers them back to the very tensors that were read."""
    from tests.distributed.launcher import run_distributed

    src = save_hf(_hf_qwen3(True, num_experts=4), tmp_path / "hf", shard="30KB")
    run_distributed(_ep2_load_and_export, 2, str(src), str(tmp_path / "out"))
