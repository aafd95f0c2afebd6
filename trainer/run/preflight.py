"""The checks of a run that need the model's arguments or the environment, made before the model is
built (``Trainer.setup`` calls :func:`preflight` once the args are known, from the flavor or from a
Hugging Face config.json): each failure is one line, all of them at once.

- options of the configuration the model does not use (``trainer.config.model_options``);
- ``--optimizer.groups`` rules that give Muon a vector (``trainer.optim.groups.rule_errors``: the
  parameter names and shapes of the model on the meta device);
- with ``--fault_tolerance.enable``, a Lighthouse that answers (``trainer.run.fault_tolerance``).
"""
from __future__ import annotations

import os

from trainer.config.cli import raise_all
from trainer.run.fault_tolerance import wait_for_lighthouse
from trainer.config.model_options import unused_option_errors
from trainer.optim.groups import rule_errors


def preflight(config, args) -> None:
    """Check ``config`` (a ``JobConfig``) against the model ``args`` and the environment.

    Raises:
        ConfigError: options the model does not use, group rules giving Muon a vector (every line).
        TrainingError: no Lighthouse answers within ``fault_tolerance.lighthouse_timeout_seconds``.
    """
    o = config.optimizer
    raise_all(unused_option_errors(config, args)
              + (rule_errors(args, o.name, o.weight_decay, list(o.groups)) if o.groups else []))
    if config.fault_tolerance.enable:
        wait_for_lighthouse(os.environ.get("TORCHFT_LIGHTHOUSE", ""), config.fault_tolerance.lighthouse_timeout_seconds)
