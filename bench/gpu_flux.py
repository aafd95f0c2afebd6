"""A Flux training step at FLUX.1-dev shapes on one GPU: part of bench/run_gpu.sh's train stage.

    python -m bench.gpu_flux FOLDER [--dry-run]

The transformer at flux-dev width (dim 3072, 24 heads of 128, rotary axes 16/56/56, T5 states of
4096, CLIP vector of 768, guidance embedding) cut to 2 double- and 4 single-stream blocks (the
whole 11.9e9-parameter model with AdamW does not fit one GPU), one 1024 x 1024 image per step:
4096 image tokens (64 channels: 16 latent channels in 2x2 patches) joined with 512 text tokens.
bf16 compute with FSDP2 on a one-GPU mesh (fp32 master weights, fp32 gradient reduction), fused
AdamW, the rectified-flow MSE on a fixed random batch (the encoders' outputs are the encode cache's
job, not timed here). Writes ``FOLDER/metrics.jsonl`` in the trainer's format (step, loss, tps,
mfu against the datasheet peak, memory_gib), so the train stage reads it like a trainer run.

``--dry-run`` (the CPU): dim 64, 2 heads of 32, 64 x 64 pixels at the same structure, float32, 3 steps.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch


def main(argv: list[str]) -> int:
    folder, dry = pathlib.Path(argv[0]), "--dry-run" in argv
    folder.mkdir(parents=True, exist_ok=True)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.observe.metrics import peak_flops
    from trainer.models.flux.args import FLUX_FLAVORS
    from trainer.models.flux.flow import image_ids, text_ids
    from trainer.registry import build_model
    from trainer.parallel.fsdp import apply_fsdp

    device = torch.device("cpu" if dry else "cuda")
    args = FLUX_FLAVORS["flux-dev"].replace(n_double_layers=2, n_single_layers=4)
    side, steps = 1024, 8  # pixels; steps (the first 2 warm up: Triton compiles)
    if dry:
        args = args.replace(dim=64, n_heads=2, head_dim=32, axes_dim=(8, 12, 12), context_dim=64, vec_dim=32,
                            max_txt_len=16)
        side, steps = 64, 3
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo" if dry else "nccl", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    model = build_model(args, "meta")
    bf16 = None if dry else torch.bfloat16
    apply_fsdp(model, mesh, param_dtype=bf16, reduce_dtype=None if dry else torch.float32)
    model.to_empty(device=device)
    model.init_weights(0)
    with torch.no_grad():  # weights that make every block work (the init zeroes the modulations)
        for name, p in model.named_parameters():
            if "mod.lin.weight" in name or "final_layer" in name:
                p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not dry)
    h = side // 16  # latent pixels / 2: patches per side
    n_img, n_txt = h * h, args.max_txt_len
    g = torch.Generator(device=device).manual_seed(0)
    batch = dict(img=torch.randn(1, n_img, args.in_channels, device=device, generator=g),
                 txt=torch.randn(1, n_txt, args.context_dim, device=device, generator=g),
                 vec=torch.randn(1, args.vec_dim, device=device, generator=g),
                 timesteps=torch.rand(1, device=device, generator=g), img_ids=image_ids(h, h, device),
                 txt_ids=text_ids(n_txt, device), guidance=torch.full((1,), 3.5, device=device))
    target = torch.randn(1, n_img, args.in_channels, device=device, generator=g)
    tokens = n_img + n_txt
    flops_per_step = args.flops_per_token(tokens) * tokens
    peak = None if dry else peak_flops(device)
    with open(folder / "metrics.jsonl", "w") as out:
        for step in range(1, steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = (model(**batch).float() - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()  # waits for the step
            dt = time.perf_counter() - t0
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            rec = {"step": step, "loss": value, "tps": tokens / dt, "step_s": dt, "memory_gib": mem,
                   "mfu": 100.0 * flops_per_step / dt / peak if peak else None, "flops_per_token":
                   args.flops_per_token(tokens), "params": args.num_params()}
            if step > 2 or dry:  # after warm-up (compilation); the dry run logs every step
                out.write(json.dumps(rec) + "\n")
            mfu = "" if rec["mfu"] is None else f"MFU {rec['mfu']:.1f}%  "
            print(f"flux step {step}: loss {value:.4f}  {dt * 1e3:.1f} ms  {tokens / dt:,.0f} tokens/s  {mfu}"
                  f"peak {mem:.1f} GiB", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
