"""What a run shows: metrics (console line, JSONL, TensorBoard, W&B), plots (metrics.png,
``python -m trainer.plot``), profiling windows and the run's start-up lines.

May import: trainer.errors, trainer.config, trainer.registry; not the training loop.
"""
