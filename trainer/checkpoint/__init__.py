"""Checkpoints: the DCP checkpointer (save, load, resume), reading a run folder's steps, manifests
(a checksum per file: what "damaged" means), lineage (which run a checkpoint came from) and
publishing (the atomic rename of a finished step).

May import: trainer.errors, trainer.config, trainer.run (signals), trainer.hf, trainer.registry,
torch.distributed.checkpoint. Not the training loop.
"""
