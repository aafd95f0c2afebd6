"""Float8Linear under FSDP2 on 2 gloo CPU ranks, with and without the float8 all-gather.

With ``enable_fsdp_float8_all_gather``: every weight travels as 1-byte e4m3 codes (uint8 on the
wire), scaled by the amax of the whole weight (all-reduced over the ranks), so the forward is
bit-equal to the unsharded Float8Linear; the module sees a Float8AllGatheredWeight; gradients
equal the average of the unsharded ones; an uneven shard (7 rows on 2 ranks) is padded; three
AdamW steps keep every rank equal to a single-process model trained on the same global batch.
Without it, plain FSDP2 of Float8Linear does the same in high precision (slow). Slow
(``pytest -m slow tests/distributed/test_fsdp_float8.py``, about a minute): the float8 all-gather
with each layer under torch.compile(fullgraph=True) trains like the single-process model.
"""
from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed


def _check(rank: int, world: int, fp8_all_gather: bool, compiled: bool = False) -> None:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import titan_kernels as tk  # noqa: F401  (registers the ops and DTensor rules)
    from titan_kernels.nn.float8_all_gather import Float8AllGatheredWeight, WeightWithFloat8AllGather
    from titan_kernels.nn import convert_to_float8

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(48, 7, bias=False), nn.ReLU(), nn.Linear(7, 32), nn.ReLU(), nn.Linear(32, 16))

    ref = convert_to_float8(make(), "tensorwise")
    model = convert_to_float8(make(), "tensorwise", enable_fsdp_float8_all_gather=fp8_all_gather)
    mesh = init_device_mesh("cpu", (world,))
    if compiled:  # per layer and before sharding, as the trainer compiles per block
        # Three layer shapes share Float8Linear.forward's code object: one graph each (and its
        # weight-shape variants) exceeds the default limit of 8.
        torch._dynamo.config.recompile_limit = 64
        for i in (0, 2, 4):
            model[i].compile(fullgraph=True, dynamic=False)
    for m in (model[0], model[2], model[4], model):
        fully_shard(m, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo lacks AVG / PREMUL_SUM

    sent, seen = [], []
    if fp8_all_gather:
        assert isinstance(model[0].weight.to_local(), WeightWithFloat8AllGather)
        real = WeightWithFloat8AllGather.fsdp_pre_all_gather

        def spy(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads the signature
            out = real(self, mesh, outer_size, outer_stride, module, mp_policy)
            sent.append((out[0][0].dtype, out[0][0].numel(), self._tensor.numel()))
            return out

        WeightWithFloat8AllGather.fsdp_pre_all_gather = spy
    for i in (0, 2, 4):
        model[i].register_forward_pre_hook(lambda mod, inp: seen.append(type(mod.weight)))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for step in range(3):
        xs = torch.randn(world, 5, 48) * (step + 1)
        y = model(xs[rank])
        y_ref = ref(xs[rank])
        if fp8_all_gather and not compiled:
            # The same codes and scale as quantizing the whole weight: bit-equal outputs.
            assert torch.equal(y, y_ref), (step, (y - y_ref).abs().max())
        else:
            torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        y.square().mean().backward()
        ref.zero_grad()
        sum(ref(x).square().mean() for x in xs).backward()  # FSDP averages over ranks: divide below
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad / world, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        opt.zero_grad()
        for q in ref.parameters():
            q.grad /= world
        opt_ref.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor().detach(), q.detach(), rtol=1e-5, atol=1e-6)

    if fp8_all_gather:
        assert seen and all(t is Float8AllGatheredWeight for t in seen), set(seen)
        # 1 byte per element on the wire, padded to ceil(rows / world) rows for the 7-row weight.
        assert sent and all(dtype == torch.uint8 for dtype, _, _ in sent)
        assert (torch.uint8, 4 * 48, 48 * (3 if rank == 1 else 4)) in sent
        assert isinstance(model[0].weight.to_local(), WeightWithFloat8AllGather)  # survives optimizer steps
    else:
        assert all(t is nn.Parameter for t in seen)


def test_fsdp2_float8_all_gather():
    run_distributed(_check, 2, True)


@pytest.mark.slow  # ~7 s (2 ranks); by default the same FSDP2 + float8 linear steps with the float8 all-gather
def test_fsdp2_float8_linear_high_precision_all_gather():
    run_distributed(_check, 2, False)


@pytest.mark.slow
def test_fsdp2_float8_all_gather_compiled():
    run_distributed(_check, 2, True, True)
