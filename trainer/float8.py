"""Float8 training: replace the model's ``nn.Linear`` layers by float8 ones, ours or torchao's.

``--float8.impl titan`` uses ``titan_kernels.nn.Float8Linear``; ``--float8.impl torchao`` uses
``torchao.float8`` (an optional dependency: ``pip install torchao``), so the same run can be
compared side by side. Both get the same recipe and the same filter:

* ``--float8.filter_fqns``: layers whose name contains one of these strings stay in high precision
  (default ``output``: the vocabulary projection feeds the loss directly);
* ``--float8.auto_filter_small_kgemms``: also keep layers too small to gain (the cost model of
  ``titan_kernels.nn.float8.too_small_for_float8``: N·K / (N + K) under 1024 for tensorwise, 2048
  for the rowwise recipes; Llama 3 8B's FFN and wq/wo pass, its 1024-wide wk/wv do not, every
  layer of the debugmodel is filtered).

The recipes, their configs (``Float8LinearConfig``), the module, the conversion and the filter are
``titan_kernels.nn``'s; this module maps the ``[float8]`` keys (torchtitan's) onto them, picks ours
or torchao's, and converts the MoE experts.

Mixture-of-experts models: the routed experts (``trainer.models.common.moe.GroupedExperts``, three grouped
GEMMs) run on ``titan_kernels.fp8_grouped_mm`` with ``--float8.impl titan``, under the same two
filters (the size filter on each expert's dim x hidden GEMM shape). Their recipe follows
``--float8.recipe`` (``EXPERT_RECIPE``): ``rowwise_with_gw_hp`` keeps the weight gradient in high
precision, ``rowwise`` and ``tensorwise`` put all three GEMMs in float8 with rowwise scales (the grouped
op has no tensorwise variant: one scale per expert would not factor out of a grouped kernel's tile
any better than a row's, and rowwise is torchao's float8 MoE recipe). The router gates stay in high
precision whatever the filters say (a float8 router flips top-k choices, and the router reads its
weight directly). With ``--float8.impl torchao`` the experts stay in high precision (logged). By the
cost model above, Qwen3-30B-A3B's experts (2048 x 768: N·K/(N+K) = 559) are kept in high precision by
the automatic filter; ``--float8.auto_filter_small_kgemms false`` converts them.

Conversion happens on the meta device, before activation checkpointing, compile and FSDP2
(DESIGN.md section 4). MFU stays against the bf16 dense peak, as torchtitan reports it, and the log
says so.
"""
from __future__ import annotations

import logging

from torch import nn

from titan_kernels.nn.float8 import convert_to_float8, module_filter, too_small_for_float8

logger = logging.getLogger("trainer")

# --float8.recipe -> the recipe of the routed experts' titan_kernels.fp8_grouped_mm (module docstring).
EXPERT_RECIPE = {"tensorwise": "rowwise", "rowwise": "rowwise", "rowwise_with_gw_hp": "rowwise_with_gw_hp"}


def _torchao_convert(model: nn.Module, recipe: str, all_gather: bool, fn) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError(
            f"--float8.impl torchao: torchao is not installed or failed to import ({exc}); "
            "install it with `pip install torchao` (or the titan-kernels[float8] extra), or use --float8.impl titan"
        ) from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise (checked in config)
    convert_to_float8_training(model, config=config, module_filter_fn=fn)


def convert_experts_to_float8(model: nn.Module, cfg) -> list[str]:
    """Set ``float8_recipe`` on the routed experts of ``model`` that pass the filters of ``cfg``
    (``EXPERT_RECIPE[cfg.recipe]``; impl titan only). Returns their names."""
    from trainer.models.common.moe import GroupedExperts

    experts = {fqn: m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}
    if not experts:
        return []
    if cfg.impl != "titan":
        logger.info("float8 (%s): the %d MoE expert groups stay in high precision (titan_kernels.fp8_grouped_mm "
                    "runs with --float8.impl titan)", cfg.impl, len(experts))
        return []
    recipe = EXPERT_RECIPE[cfg.recipe]
    chosen = []
    for fqn, m in experts.items():
        dim, hidden = m.w1.shape[1], m.w1.shape[2]
        if any(f and f in fqn for f in cfg.filter_fqns):
            continue
        if cfg.auto_filter_small_kgemms and too_small_for_float8(dim, hidden, recipe):
            continue
        m.float8_recipe = recipe
        chosen.append(fqn)
    logger.info("float8 (titan): %d of %d MoE expert groups on fp8_grouped_mm (recipe %s), %d kept in high "
                "precision%s", len(chosen), len(experts), recipe, len(experts) - len(chosen),
                " (auto filter of small layers)" if len(chosen) < len(experts) and cfg.auto_filter_small_kgemms else "")
    return chosen


def convert_model_to_float8(model: nn.Module, cfg) -> list[str]:
    """Convert ``model``'s Linear layers in place per the ``[float8]`` config section ``cfg``
    (enable, recipe, impl, filter_fqns, auto_filter_small_kgemms, enable_fsdp_float8_all_gather),
    and its MoE routed experts (``convert_experts_to_float8``); MoE router gates stay as they are.

    Returns the names of the converted layers and expert groups. Raises RuntimeError when ``impl`` is
    torchao and it cannot be imported.
    """
    from trainer.models.common.moe import Router

    gates = {f"{fqn}.gate" if fqn else "gate" for fqn, m in model.named_modules() if isinstance(m, Router)}
    size_and_name = module_filter(cfg.filter_fqns, cfg.auto_filter_small_kgemms, cfg.recipe)

    def keep(mod: nn.Module, fqn: str) -> bool:
        return fqn not in gates and size_and_name(mod, fqn)

    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = [fqn for fqn, m in linears.items() if keep(m, fqn)]
    if cfg.impl == "torchao":
        _torchao_convert(model, cfg.recipe, cfg.enable_fsdp_float8_all_gather, keep)
    else:
        convert_to_float8(model, cfg.recipe, keep, enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather)
    skipped = len(linears) - len(chosen)
    logger.info(
        "float8 (%s, recipe %s%s): %d of %d Linear layers converted, %d kept in high precision "
        "(filter_fqns %s%s)", cfg.impl, cfg.recipe,
        ", float8 FSDP2 all-gather" if cfg.enable_fsdp_float8_all_gather else "", len(chosen), len(linears), skipped,
        cfg.filter_fqns, ", auto filter of small layers" if cfg.auto_filter_small_kgemms else "")
    experts = convert_experts_to_float8(model, cfg)
    if not chosen and not experts:
        logger.warning("float8: no Linear layer was converted; all were filtered (see --float8.filter_fqns and "
                       "--float8.auto_filter_small_kgemms)")
    logger.info("float8: MFU is reported against the bf16 dense peak (the float8 peak is twice that)")
    return chosen + experts
