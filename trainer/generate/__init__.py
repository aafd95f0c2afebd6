"""Generation from a checkpoint (DESIGN.md section 4b): ``python -m trainer.generate`` (``cli``,
``run``), the loading of a trained model (``load``), KV caches per attention layer kind (``cache``,
``mla_cache``), sampling (``sampler``), the loop (``loop``) and tensor parallel generation
(``tensor_parallel``). ``python -m trainer.eval`` measures a checkpoint (``trainer.eval``)."""
