"""The run's guards: one run per dump folder (the folder lock), the run history, signals
(preemption), the hang watchdog, fault injection for tests, and replica-group fault tolerance
(torchft).

May import: trainer.errors, trainer.config, trainer.environment; not the training loop.
"""
