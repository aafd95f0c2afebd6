"""The model families behind one interface: each family registers one ``ModelSpec``, and everything
that needs to know the families (the ``--model.name`` choices, ``--help``, the flavor lists and their
TOML files, the Hugging Face model types, ``trainer.convert``, the estimate and the planner) reads
this registry instead of naming a family.

A family is a folder ``trainer/models/<family>/``: its ``__init__.py`` defines ``SPEC`` (torch-free:
its args class and flavors), its model parts, its Hugging Face adapter (``hf.py``) and, where it
differs from the shared ones, its parallelize hooks. Adding a family means its folder, its TOMLs in
``trainer/configs/<family>/`` and one line in ``FAMILY_PACKAGES`` below. A family can also be
registered at run time (``register``; a test registers a toy one).

Torch-free at import (the config, the estimate and the planner load it): the parts that need torch
are named as ``"module:attribute"`` strings and imported when used (``ModelSpec.load``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

# The registry: one line per family, each a package whose ``SPEC`` is its ModelSpec.
FAMILY_PACKAGES = (
    "trainer.models.llama3",
    "trainer.models.qwen3",
    "trainer.models.deepseek_v3",
    "trainer.models.gpt_oss",
    "trainer.models.llama4",
    "trainer.models.flux",
)


@dataclass(frozen=True)
class ModelSpec:
    """A model family: what the trainer, the config and the Hugging Face conversion read of it.

    Attributes:
        name: the ``--model.name`` (e.g. ``llama3``); also the folder of its TOMLs (``trainer/configs/<name>/``).
        title: how messages name it (e.g. ``Llama 3``).
        args_cls: its hyperparameter dataclass (a ``trainer.models.common.args.ModelArgs`` subclass, torch-free).
        flavors: the published shapes, flavor name -> args (``vocab_size`` -1 = from the tokenizer).
        description: one line for ``--help``.
        build: ``"module:function"`` building the model, ``fn(args) -> nn.Module`` on the current
            device (``trainer.models.common.decoder:Transformer``, the shared decoder, by default).
        hf_adapter: ``"module:object"`` of its Hugging Face adapter (``trainer.hf.adapter.HFAdapter``),
            or None when the family has no Hugging Face counterpart.
        hf_model_types: the ``model_type`` values of config.json this family reads.
        parallelize: ``"module:function"`` replacing the shared ``parallelize_decoder``, or None.
        tensor_parallel: ``"module:function"`` ``fn(model, tp_mesh)`` that shards the family's modules
            outside the transformer blocks under tensor parallel (DeepSeek-V3's MTP modules), run
            after the shared plan; None when the blocks are all there is.
        generate: ``"module:function"`` of the family's own ``python -m trainer.generate``,
            ``fn(argv) -> exit code`` (the whole command line: the family parses its own sampling
            flags and the trainer's), for a family that is not a text decoder (Flux); its module also
            offers ``build_parser()`` (those flags). None = the decoder's KV-cache generation.
        task: ``"module:class"`` of what the family trains on and how (``trainer.task``: its batches,
            loss, validation; language modelling by default); each run makes its own instance.
    """

    name: str
    title: str
    args_cls: type
    flavors: Mapping[str, Any]
    description: str = ""
    build: str = "trainer.models.common.decoder:Transformer"
    hf_adapter: str | None = None
    hf_model_types: tuple[str, ...] = ()
    parallelize: str | None = None
    tensor_parallel: str | None = None
    generate: str | None = None
    task: str = "trainer.task:LanguageModelling"

    def load(self, what: str) -> Any:
        """Import the attribute ``what`` names (``"package.module:attribute"``)."""
        module, _, attr = what.partition(":")
        obj = importlib.import_module(module)
        return getattr(obj, attr) if attr else obj

    def adapter(self):
        """The family's Hugging Face adapter; raises ValueError if it has none."""
        if self.hf_adapter is None:
            raise ValueError(f"model.name: {self.name} has no Hugging Face counterpart")
        return self.load(self.hf_adapter)

    def flavor_args(self, flavor: str):
        """The args of ``flavor``; raises ValueError naming the known ones."""
        if flavor not in self.flavors:
            raise ValueError(f"flavor: expected one of {', '.join(self.flavors)} for {self.name}, got {flavor!r}")
        return self.flavors[flavor]


_SPECS: dict[str, ModelSpec] = {}
_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for package in FAMILY_PACKAGES:
        register(importlib.import_module(package).SPEC)


def register(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Add a family. Raises ValueError if its name (or one of its Hugging Face model types) is
    taken, unless ``replace``. Returns the spec."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec: expected a ModelSpec, got {type(spec).__name__}")
    if not replace:
        if spec.name in _SPECS:
            raise ValueError(f"model family {spec.name!r} is registered already")
        for other in _SPECS.values():
            taken = set(spec.hf_model_types) & set(other.hf_model_types)
            if taken:
                raise ValueError(f"model family {spec.name!r}: Hugging Face model_type {sorted(taken)[0]!r} "
                                 f"belongs to {other.name!r}")
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a family registered at run time (the built-in ones load again on the next lookup)."""
    _SPECS.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered family names, in registration order."""
    _load_builtin()
    return tuple(_SPECS)


def get(name: str) -> ModelSpec:
    """The spec of family ``name``; raises ValueError naming the known families."""
    _load_builtin()
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"model.name: expected one of {', '.join(_SPECS)}, got {name!r}")
    return spec


def spec_of(args) -> ModelSpec:
    """The spec whose args class ``args`` is an instance of (the most derived match)."""
    _load_builtin()
    for spec in _SPECS.values():
        if type(args) is spec.args_cls:
            return spec
    for spec in _SPECS.values():
        if isinstance(args, spec.args_cls):
            return spec
    raise ValueError(f"model args of type {type(args).__name__} belong to no registered family")


def for_hf_model_type(model_type: str) -> ModelSpec | None:
    """The family reading config.json's ``model_type``, or None."""
    _load_builtin()
    for spec in _SPECS.values():
        if model_type in spec.hf_model_types:
            return spec
    return None


def hf_model_types() -> dict[str, str]:
    """Every Hugging Face model_type we read -> its family."""
    _load_builtin()
    return {mt: spec.name for spec in _SPECS.values() for mt in spec.hf_model_types}


# ------------------------------------------------------------------------------------------------
# args of a run, records in checkpoints


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int, model_config=None):
    """The hyperparameters of ``flavor`` of family ``name`` for a tokenizer of ``vocab_size`` tokens
    and sequences up to ``max_seq_len``; the ``[model]`` config section (``model_config``) may
    adjust them (``ModelArgs.configure``: e.g. the MoE load balancing).

    A flavor with ``vocab_size = -1`` takes the tokenizer's; the others keep their published one and
    refuse a larger tokenizer. Raises ValueError: unknown family or flavor, a tokenizer too large.
    """
    spec = get(name)
    args = spec.flavor_args(flavor)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected an integer >= 1, got {vocab_size!r}")
    if args.vocab_size == -1:
        args = args.replace(vocab_size=vocab_size)
    elif vocab_size > args.vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {vocab_size} tokens but flavor {flavor!r} has an embedding "
                         f"of {args.vocab_size}; use the model's own tokenizer")
    args = args.replace(max_seq_len=max_seq_len)
    return args.configure(model_config) if model_config is not None else args


def family_of(args) -> str:
    """The family name of ``args``."""
    return spec_of(args).name


def args_record(args) -> dict:
    """The JSON-able fields of ``args`` plus its family (checkpoints record them)."""
    return {"model": family_of(args), **args.record()}


def args_from_record(fields: dict, family: str | None = None):
    """Rebuild the args of ``fields`` (``args_record``); ``family`` default llama3 (checkpoints
    written before other families existed did not name it). Raises ValueError for an unknown family."""
    fields = dict(fields)
    family = fields.pop("model", None) or family or "llama3"
    return get(family).args_cls.from_record(fields)


def build_model(args, device="meta"):
    """The model of ``args``'s family on ``device`` (default meta: no memory; call ``to_empty`` and
    ``init_weights`` next)."""
    import torch

    build = spec_of(args).load(spec_of(args).build)
    with torch.device(device):
        return build(args)
