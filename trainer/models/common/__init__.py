"""The decoder parts the families share: the typed args base (ModelArgs, MoE args), attention,
feed-forward, MoE, the decoder block and Transformer, and the losses.

May import: titan_kernels' public API, trainer.errors; never a family folder or trainer.registry.
"""
