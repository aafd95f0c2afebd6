"""Which attention backend runs a call: the automatic order per device, the overrides, and why a backend
cannot take a case. Capability answers are cached per case key, never probed on every call.

Backends (``ATTENTION_BACKENDS``):
  fa3, fa2        FlashAttention-3 / -2 libraries (``flash_lib``), CUDA, fp16/bf16.
  sdpa_cudnn      aten's cuDNN attention kernel with its LSE and backward op (``aten``), CUDA.
  sdpa_flash      aten's flash kernel: the CPU one (GQA, varlen by document, LSE gradient) or CUDA's FA2.
  triton          ours (``titan_kernels.triton.flash_attn``): every case on CUDA; CPU under TRITON_INTERPRET=1.
  sdpa_efficient  aten's memory-efficient (xFormers) kernel, CUDA, also float32.
  reference       float32 PyTorch math with full score matrices: the ground truth, only when asked for.

Automatic order, fastest first:
  CPU:  sdpa_flash. Measured on our 2-core AVX2 CPU (torch 2.13, fp32, forward + backward, 2026-12-01):
        (b 8, s 256, h 16, d 16) causal 19 ms against 63 ms for the reference math and 21 ms for SDPA
        through autograd; (b 2, s 1024, h 8, h_kv 2, d 64) 52 ms against 54 ms for SDPA through autograd
        (bench/bench_attention.py reproduces it). GQA runs natively in the kernel: at (2, 1024,
        8 / 2 heads, 64) forward + backward it took 343 ms against 432 ms with K/V repeated and dK/dV
        summed (paired, on shared cores), so K/V are never repeated on the CPU.
  CUDA: fa3 > fa2 > sdpa_cudnn > sdpa_flash > triton > sdpa_efficient. Ordered by published H100 figures
        (FA3 ~600 TFLOP/s, cuDNN close to it on Hopper, FA2 ~350); ``bash bench/run_gpu.sh`` measures
        every backend at head_dim 128, seq 4k/8k, and the order follows its numbers.
No automatic choice keeps a (seq_q x seq_k) tensor for the backward: every backend in these orders
saves out and lse only. ``reference`` is never chosen automatically.

Overrides, strongest first: the ``backend=`` argument (a name above, or "cpu" / "cuda"), then
``titan_kernels.use_backend(...)``, then ``TITAN_KERNELS_BACKEND``. "cpu" and "cuda" mean the native
kernels of that device (CPU: sdpa_flash; CUDA: fa3 > fa2 > sdpa_cudnn > sdpa_flash > sdpa_efficient).
An explicitly requested backend that cannot take the case raises RuntimeError with the reason.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from titan_kernels import backend as _backend
from titan_kernels.ops.attention import aten as _aten
from titan_kernels.ops.attention.flash_lib import flash_bwd, flash_fwd, flash_lib
from titan_kernels.reference import attention as _ref

OP = "flash_attn"
ATTENTION_BACKENDS = ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "triton", "sdpa_efficient", "reference")

AUTO_ORDER = {
    "cuda": ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "triton", "sdpa_efficient"),
    "cpu": ("sdpa_flash",),
}
GENERIC = {
    "cuda": ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"),
    "cpu": ("sdpa_flash",),
}
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- the case to dispatch


@dataclass(eq=False)
class AttentionCase:
    """What a backend must take: shapes, dtype and device of one call (seq_* are the maxima)."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    seq_q: int
    seq_k: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    varlen: bool
    need_lse: bool = False
    backward: bool = False
    has_dlse: bool = False
    tensors: tuple = field(default=(), repr=False)  # (q, k, v): torch's own SDPA checks, once per key

    def key(self) -> tuple:
        """Everything a capability answer depends on (not the batch or the exact lengths)."""
        shape = (self.seq_q > self.seq_k) - (self.seq_q < self.seq_k)  # -1, 0, 1
        return (self.device.type, self.device.index, self.dtype, self.head_dim, self.causal, shape, self.varlen,
                self.need_lse, self.backward, self.has_dlse, self.n_heads != self.n_kv_heads)


def make_case(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, need_lse, backward=False, has_dlse=False):
    if cu_seqlens_q is not None:
        batch, seq_q, seq_k = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    return AttentionCase(
        q.device, q.dtype, batch, seq_q, seq_k, q.shape[-2], k.shape[-2], q.shape[-1], bool(causal),
        cu_seqlens_q is not None, bool(need_lse), backward, has_dlse, (q, k, v),
    )


@dataclass(frozen=True)
class AttentionChoice:
    """The backend that runs an attention call, why, and why the ones before it were skipped."""

    backend: str
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()
    explicit: bool = False

    def __str__(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- capabilities


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _sm(cap) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _why_not_flash_lib(kind: str, case: AttentionCase) -> str | None:
    if case.device.type != "cuda":
        return f"runs on CUDA tensors, not {case.device.type}"
    lib, why = flash_lib(kind)
    if lib is None:
        return why
    cap = _cuda_capability(case.device)
    if kind == "fa3" and cap != (9, 0):
        return f"FlashAttention-3 runs on sm_90, this device is {_sm(cap)}"
    if kind == "fa2" and cap < (8, 0):
        return f"FlashAttention-2 needs sm_80 or newer, this device is {_sm(cap)}"
    if case.dtype not in _HALF:
        return f"takes float16/bfloat16, not {str(case.dtype).replace('torch.', '')}"
    if case.head_dim % 8 != 0:
        return f"head_dim {case.head_dim} is not a multiple of 8"
    if case.has_dlse:
        return "its backward takes no gradient for the LSE"
    return None


def _sdpa_can_use(name: str, case: AttentionCase) -> bool:
    """torch's own test of whether an SDPA kernel runs these CUDA inputs (asked once per case key)."""
    if not case.tensors:  # a synthetic case (attention_backend on shapes only): the rules above decide
        return True
    q, k, v = case.tensors
    params = torch.backends.cuda.SDPAParams(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0.0, case.causal, case.n_heads != case.n_kv_heads
    )
    test = {
        "sdpa_cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "sdpa_flash": torch.backends.cuda.can_use_flash_attention,
        "sdpa_efficient": torch.backends.cuda.can_use_efficient_attention,
    }[name]
    return bool(test(params, False))


def _why_not_aten(name: str, case: AttentionCase) -> str | None:
    dev = case.device.type
    if (name, dev) not in _aten.IMPLS:
        return f"aten has no {name.removeprefix('sdpa_')} attention kernel for {dev} tensors"
    if dev == "cpu":
        return None  # the CPU kernel takes every case we validate (any head_dim, GQA, varlen, dlse)
    if case.varlen:
        return "aten's CUDA kernels are wired for dense batches only (varlen runs on triton or FlashAttention)"
    if case.causal and case.seq_q != case.seq_k:
        return "its causal mask is top-left aligned and takes no mask: seq_q != seq_k needs bottom-right"
    if case.has_dlse:
        return "its backward takes no gradient for the LSE"
    if name != "sdpa_efficient" and case.dtype not in _HALF:
        return f"takes float16/bfloat16, not {str(case.dtype).replace('torch.', '')}"
    if name == "sdpa_flash" and _cuda_capability(case.device) < (8, 0):
        return f"needs sm_80 or newer, this device is {_sm(_cuda_capability(case.device))}"
    if not _sdpa_can_use(name, case):
        kind = {"sdpa_cudnn": "cudnn", "sdpa_flash": "flash", "sdpa_efficient": "efficient"}[name]
        return f"torch.backends.cuda.can_use_{kind}_attention rejects these inputs"
    return None


def _why_not_triton(case: AttentionCase) -> str | None:
    st = _backend.backend_status("triton", case.device)
    if not st.available:
        return st.reason
    if "triton" not in _backend.implemented_backends(OP):
        return "titan_kernels.triton.flash_attn failed to import"
    return None


# Capability answers per (backend, case key), and backends that raised at run time in auto mode.
_answers: dict[tuple, str | None] = {}
_failed: dict[tuple, str] = {}


def _compute_why_not(name: str, case: AttentionCase) -> str | None:
    if name == "reference":
        return None
    if name == "triton":
        return _why_not_triton(case)
    if name in ("fa3", "fa2"):
        return _why_not_flash_lib(name, case)
    return _why_not_aten(name, case)


def why_not(name: str, case: AttentionCase) -> str | None:
    """Why backend ``name`` cannot run ``case``, or None when it can (cached per case key)."""
    k = (name, case.key())
    failed = _failed.get(k)
    if failed is not None:
        return failed
    if k not in _answers:
        _answers[k] = _compute_why_not(name, case)
    return _answers[k]


def clear_caches() -> None:
    """Forget cached capability answers and run-time failures (after installing a library, in tests)."""
    _answers.clear()
    _failed.clear()
    _choices.clear()
    flash_lib.cache_clear()


def mark_failed(name: str, case: AttentionCase, error: BaseException) -> None:
    """Record that an automatically chosen backend raised for this kind of case; later calls skip it."""
    why = f"raised at run time: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    _failed[(name, case.key())] = why
    _choices.clear()
    warnings.warn(f"titan flash_attn: backend {name!r} {why}; falling back to the next backend for such calls",
                  RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------- implementations


def impl(name: str, device_type: str):
    """(fwd, bwd) of backend ``name`` for ``device_type``, both with the contract of
    ``titan_kernels.reference.attention``."""
    if name in ("reference", "triton"):
        return _backend._impls[OP][name]
    if name in ("fa3", "fa2"):
        return flash_fwd(name), flash_bwd(name)
    return _aten.IMPLS[(name, device_type)]


_backend.register_impl(OP, "reference", (_ref.attention_fwd, _ref.attention_bwd))


def _register_triton() -> None:
    try:
        from titan_kernels.triton import flash_attn as _tri
    except ImportError:  # triton not installed: the backend reports itself unavailable
        return
    _backend.register_impl(OP, "triton", (_tri.attention_fwd, _tri.attention_bwd))


_register_triton()


# ----------------------------------------------------------------------------- the choice


def _requested(backend: str | None) -> tuple[str | None, str]:
    if backend:
        return backend, f"requested by backend={backend!r}"
    name = _backend.requested_backend()
    if name is None:
        return None, ""
    return name, f"requested by use_backend({name!r}) or {_backend.ENV_VAR}"


_choices: dict[tuple, AttentionChoice] = {}


def choose_backend(case: AttentionCase, backend: str | None = None) -> AttentionChoice:
    """The backend that runs ``case``: ``backend`` (a name of ``ATTENTION_BACKENDS``, "cpu", "cuda" or
    None), else ``use_backend`` / ``TITAN_KERNELS_BACKEND``, else the automatic order.

    Raises RuntimeError when an explicitly requested backend cannot take the case (with why), or when
    no automatic backend can.
    """
    name, why_requested = _requested(backend)
    ck = (name, case.key())
    hit = _choices.get(ck)
    if hit is not None:
        return hit
    dev = case.device.type
    if name is None:
        chain, explicit = AUTO_ORDER.get(dev, ()), False
    elif name in GENERIC:
        if dev != name:
            raise RuntimeError(f"backend {name!r} runs on {name} tensors, got {dev} tensors ({why_requested})")
        chain, explicit = GENERIC[name], True
    else:
        chain, explicit = (name,), True
    skipped = []
    for cand in chain:
        why = why_not(cand, case)
        if why is None:
            if explicit:
                reason = why_requested
            elif skipped:
                reason = f"first backend of the {dev} order that takes this case"
            else:
                reason = f"first backend of the {dev} order"
            choice = _choices[ck] = AttentionChoice(cand, reason, tuple(skipped), explicit)
            return choice
        skipped.append((cand, why))
    detail = "; ".join(f"{n}: {w}" for n, w in skipped) or f"no backend is ordered for {dev} tensors"
    if name is None:
        raise RuntimeError(f"no attention backend can run this case on {dev} ({detail}); "
                           "backend='reference' runs anything, with O(seq_q * seq_k) memory")
    raise RuntimeError(f"backend {name!r} cannot run this attention ({why_requested}): {detail}")
