"""Estimates before anything runs: memory per device (parameters, gradients, optimizer state,
activations), communication per step, the optimizer's state, step time and MFU, the fit check
(does a run fit this machine?) and the planner (``python -m trainer.plan``).

Torch-free: may import trainer.errors, trainer.config and trainer.registry; never torch, never
the model code.
"""
