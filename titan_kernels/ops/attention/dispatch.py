"""Which attention backend runs a call: the automatic order per device, the overrides, and why a backend
cannot take a case. Capability answers are cached per case key, never probed on every call.

Backends (``ATTENTION_BACKENDS``) and what they take (sinks: every backend, as an epilogue on its
(out, lse), ``sinks.py``; the CPU paths' decomposition: ``blocks.py``):
  fa3, fa2        FlashAttention-3 / -2 libraries (``flash_lib``), CUDA, fp16/bf16. Windows and
                  soft-capping natively (both passes); FA3 chunks in its forward (seq_q == seq_k);
                  FA3's forward takes v's own head_dim (q/k (128, 192] with v (96, 128], or q/k <= 64),
                  its backward and FA2 do not; no LSE gradient.
  sdpa_cudnn      aten's cuDNN attention kernel with its LSE and backward op (``aten``), CUDA: full or
                  causal (seq_q == seq_k), v's own head_dim where torch's check accepts it.
  sdpa_flash      aten's flash kernel. CPU (``aten_cpu``): GQA, varlen by document, LSE gradient,
                  windows / chunks / bottom-right causal by query-block decomposition, v's own head_dim
                  by zero-padding; no soft-capping. CUDA's FA2: full or causal, equal head dims.
  triton          ours (``titan_kernels.triton.flash_attn``): every case on CUDA (windows and chunks
                  skip the blocks they mask out); CPU under TRITON_INTERPRET=1.
  sdpa_efficient  aten's memory-efficient (xFormers) kernel, CUDA, also float32: as sdpa_cudnn.
  blockwise       ours in PyTorch ops (``blockwise``), CPU: every case (soft-capping, v's own head_dim
                  natively), O(block * seq) memory.
  reference       float32 PyTorch math with full score matrices: the ground truth, only when asked for.

Automatic order (``ORDER``), fastest first:
  CPU:  sdpa_flash > blockwise. Measured on our 2-core AVX2 CPU (torch 2.13, fp32, forward + backward,
        2026-12-01): (b 8, s 256, h 16, d 16) causal 19 ms against 63 ms for the reference math and
        21 ms for SDPA through autograd; (b 2, s 1024, h 8, h_kv 2, d 64) 52 ms against 54 ms for
        SDPA through autograd (bench/bench_attention.py reproduces it). GQA runs natively in the
        kernel: at (2, 1024, 8 / 2 heads, 64) forward + backward it took 343 ms against 432 ms with
        K/V repeated and dK/dV summed (paired, on shared cores), so K/V are never repeated on the CPU.
        blockwise takes what sdpa_flash cannot (soft-capping). MLA's head dims (192 / 128) stay on
        sdpa_flash's zero-padding: measured 2.2x faster than blockwise's native head dims at
        (1, 1024, 8 heads) (bench/bench_attention_cpu.py, 2026-12-04, loaded machine).
  CUDA: fa3 > fa2 > sdpa_cudnn > sdpa_flash > triton > sdpa_efficient. Ordered by published H100 figures
        (FA3 ~600 TFLOP/s, cuDNN close to it on Hopper, FA2 ~350); ``bash bench/run_gpu.sh`` measures
        every backend at head_dim 128, seq 4k/8k, and the order follows its numbers. Windows and
        chunks fall to FlashAttention when installed, else Triton (aten's CUDA kernels take none).
No automatic choice keeps a (seq_q x seq_k) tensor for the backward: every backend in these orders
saves out and lse only. ``reference`` is never chosen automatically.

Overrides, strongest first: the ``backend=`` argument (a name above, or "cpu" / "cuda"), then
``titan_kernels.use_backend(...)``, then ``TITAN_KERNELS_BACKEND``. "cpu" and "cuda" mean the native
kernels of that device (CPU: sdpa_flash > blockwise; CUDA: fa3 > fa2 > sdpa_cudnn > sdpa_flash >
sdpa_efficient). An explicitly requested backend that cannot take the case raises RuntimeError with
the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titan_kernels import backend as _backend
from titan_kernels.attention_mask import AttentionArgs
from titan_kernels.ops._scaffold import Op
from titan_kernels.ops.attention import aten as _aten
from titan_kernels.ops.attention import blockwise as _blockwise
from titan_kernels.ops.attention.flash_lib import flash_bwd, flash_fwd, flash_lib
from titan_kernels.reference import attention as _ref

OP = "flash_attn"
flash_attn_def = Op(OP)  # its implementations are registered here, its bodies defined in op.py
ATTENTION_BACKENDS = ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "triton", "sdpa_efficient", "blockwise", "reference")

ORDER = {
    "cuda": ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "triton", "sdpa_efficient"),
    "cpu": ("sdpa_flash", "blockwise"),
}
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- the case to dispatch


@dataclass(eq=False)
class AttentionCase:
    """What a backend must take: shapes, dtype, device and mask of one call (seq_* are the maxima).
    The mask fields follow ``titan_kernels.attention_mask`` (right None: 0 when causal, else -1)."""

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
    head_dim_v: int | None = None  # v's head_dim; None: the same as q/k's
    left: int = -1
    right: int | None = None
    softcap: float = 0.0
    chunk: int = 0

    def __post_init__(self):
        if self.head_dim_v is None:
            self.head_dim_v = self.head_dim
        if self.right is None:
            self.right = 0 if self.causal else -1
        self.causal = self.right == 0

    @property
    def args(self) -> AttentionArgs:
        return AttentionArgs(1.0, self.left, self.right, self.softcap, self.chunk, self.seq_q, self.seq_k,
                             self.need_lse)

    def key(self) -> tuple:
        """Everything a capability answer depends on (not the batch or the exact lengths)."""
        return (self.device, self.dtype, self.head_dim, self.head_dim_v, self.args.kind(),
                (self.seq_q > self.seq_k) - (self.seq_q < self.seq_k), self.varlen, self.need_lse, self.backward,
                self.has_dlse, self.n_heads != self.n_kv_heads)


def case_key(q, k, v, cu_seqlens_q, a: AttentionArgs, backward=False, has_dlse=False) -> tuple:
    """``make_case(...).key()`` without building the case (it runs on every call: kept to one read of
    each tensor attribute)."""
    qs, ks = q.shape, k.shape
    if cu_seqlens_q is not None:
        seq_q, seq_k = int(a.max_q), int(a.max_k)
    else:
        seq_q, seq_k = qs[1], ks[1]
    return (q.device, q.dtype, qs[-1], v.shape[-1], a.key, (seq_q > seq_k) - (seq_q < seq_k),
            cu_seqlens_q is not None, a.return_lse, backward, has_dlse, qs[-2] != ks[-2])


def make_case(q, k, v, cu_seqlens_q, a: AttentionArgs, backward=False, has_dlse=False) -> AttentionCase:
    if cu_seqlens_q is not None:
        batch, seq_q, seq_k = cu_seqlens_q.shape[0] - 1, int(a.max_q), int(a.max_k)
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    return AttentionCase(
        q.device, q.dtype, batch, seq_q, seq_k, q.shape[-2], k.shape[-2], q.shape[-1], a.causal,
        cu_seqlens_q is not None, a.return_lse, backward, has_dlse, (q, k, v), v.shape[-1], a.left, a.right,
        a.softcap, a.chunk,
    )


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
    if case.head_dim_v != case.head_dim:
        why = _why_not_flash_lib_head_dim_v(kind, case)
        if why:
            return why
    if case.chunk > 0:
        why = _why_not_flash_lib_chunk(kind, case, lib)
        if why:
            return why
    if case.has_dlse:
        return "its backward takes no gradient for the LSE"
    return None  # windows and soft-capping: both libraries take them natively, forward and backward


def _why_not_flash_lib_chunk(kind: str, case: AttentionCase, lib) -> str | None:
    # FlashAttention-3's forward takes attention_chunk (hopper/flash_api.cpp); its backward has no such
    # argument, and its chunk alignment is ours only when seq_q == seq_k (dense).
    if kind == "fa2":
        return "FlashAttention-2 has no chunked attention"
    if case.backward:
        return "FlashAttention-3's backward takes no attention_chunk"
    if case.varlen or case.seq_q != case.seq_k:
        return "chunked attention on FlashAttention-3 only with seq_q == seq_k (dense), where its alignment is ours"
    if not lib.has_chunk:
        return "this FlashAttention-3 release takes no attention_chunk"
    return None


def _why_not_flash_lib_head_dim_v(kind: str, case: AttentionCase) -> str | None:
    # FlashAttention-3's forward (hopper/flash_api.cpp, mha_fwd) takes v's head_dim != q/k's for q/k in
    # (128, 192] with v in (96, 128] (DeepSeek-V3's 192/128), or q/k <= 64; its backward (mha_bwd) checks
    # v's shape against q's head_dim, so it takes equal head dims only. FlashAttention-2 checks equal
    # head dims in both passes.
    d, dv = case.head_dim, case.head_dim_v
    if kind == "fa2":
        return f"v's head_dim {dv} differs from q/k's {d}: FlashAttention-2 takes equal head dims only"
    if case.backward:
        return f"v's head_dim {dv} differs from q/k's {d}: FlashAttention-3's backward takes equal head dims only"
    if dv % 8 != 0:
        return f"v's head_dim {dv} is not a multiple of 8"
    if not ((128 < d <= 192 and 96 < dv <= 128) or d <= 64):
        return (f"v's head_dim {dv} differs from q/k's {d}: FlashAttention-3 takes that only for q/k in (128, 192] "
                "with v in (96, 128], or q/k <= 64")
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
    if case.softcap > 0:
        return "aten's attention kernels have no soft-capping"
    if dev == "cpu":
        # The CPU kernel takes every other case we validate (any head_dim, GQA, varlen, dlse); v's
        # head_dim different from q/k's by zero-padding (its only way), windows and chunks by
        # query-block decomposition (see aten.py).
        return None
    if case.left >= 0 or case.right > 0 or case.chunk > 0:
        return "aten's CUDA kernels take only full or causal masks (windows and chunks run on FlashAttention or Triton)"
    if case.varlen:
        return "aten's CUDA kernels are wired for dense batches only (varlen runs on triton or FlashAttention)"
    if case.causal and case.seq_q != case.seq_k:
        return "its causal mask is top-left aligned and takes no mask: seq_q != seq_k needs bottom-right"
    if case.has_dlse:
        return "its backward takes no gradient for the LSE"
    if name != "sdpa_efficient" and case.dtype not in _HALF:
        return f"takes float16/bfloat16, not {str(case.dtype).replace('torch.', '')}"
    if name == "sdpa_flash" and case.head_dim_v != case.head_dim:
        return f"v's head_dim {case.head_dim_v} differs from q/k's {case.head_dim}: its flash kernel takes equal ones only"
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
    try:
        import titan_kernels.triton.flash_attn  # noqa: F401  (asked once per case key)
    except ImportError as e:
        return f"titan_kernels.triton.flash_attn does not import: {e}"
    return None


# Capability answers per (backend, case key); the choices themselves are cached by titan_kernels.backend.
_answers: dict[tuple, str | None] = {}


def _compute_why_not(name: str, case: AttentionCase) -> str | None:
    if name == "reference":
        return None
    if name == "triton":
        return _why_not_triton(case)
    if name == "blockwise":
        return None if case.device.type == "cpu" else f"runs on CPU tensors, not {case.device.type}"
    if name in ("fa3", "fa2"):
        return _why_not_flash_lib(name, case)
    return _why_not_aten(name, case)


def why_not(name: str, case: AttentionCase) -> str | None:
    """Why backend ``name`` cannot run ``case``, or None when it can (cached per case key)."""
    k = (name, case.key())
    if k not in _answers:
        _answers[k] = _compute_why_not(name, case)
    return _answers[k]


def clear_caches() -> None:
    """Forget cached capability answers, choices and run-time failures (after installing a library, in tests)."""
    _answers.clear()
    _backend.clear_choices()
    flash_lib.cache_clear()


# ----------------------------------------------------------------------------- the registry


def _register() -> None:
    """Every attention backend as an implementation of titan op ``flash_attn`` (``Op.register``; family:
    reference, triton, or the device type of the native kernels), with the op's ``ORDER``."""
    def ask(name):
        return lambda device, case: why_not(name, case)

    reg = flash_attn_def.register
    reg("reference", (_ref.attention_fwd, _ref.attention_bwd), why_not=ask("reference"))
    flash_attn_def.register_triton("titan_kernels.triton.flash_attn", "attention_fwd", "attention_bwd",
                                   why_not=ask("triton"))
    for name in ("fa3", "fa2"):
        reg("cuda", (flash_fwd(name), flash_bwd(name)), name=name, why_not=ask(name))
    for (name, dev), fns in _aten.IMPLS.items():
        reg(dev, fns, name=name, why_not=ask(name))
    reg("cpu", (_blockwise.attention_fwd, _blockwise.attention_bwd), name="blockwise", why_not=ask("blockwise"))
    flash_attn_def.set_order(ORDER, hint="backend='reference' runs anything, with O(seq_q * seq_k) memory")


_register()


def impl(name: str, device_type: str):
    """(fwd, bwd) of backend ``name`` as registered for ``device_type``, both with the contract of
    ``titan_kernels.reference.attention`` (the adapters, called directly in tests and benchmarks)."""
    return _backend.implementation(OP, name, device_type).kernels


# ----------------------------------------------------------------------------- the choice

AttentionChoice = _backend.Choice


def choose_backend(case: AttentionCase, backend: str | None = None) -> AttentionChoice:
    """The backend that runs ``case``: ``backend`` (a name of ``ATTENTION_BACKENDS``, "cpu", "cuda" or
    None), else ``use_backend`` / ``TITAN_KERNELS_BACKEND``, else the automatic order; chosen by
    ``titan_kernels.backend.choose`` and cached per case key.

    Raises RuntimeError when an explicitly requested backend cannot take the case (with why), or when
    no automatic backend can.
    """
    return _backend.choose(OP, case.device, case.key(), case=case, backend=backend)


def mark_failed(choice: AttentionChoice, case: AttentionCase, error: BaseException) -> None:
    """Record that an automatically chosen backend raised for this kind of case; later calls skip it."""
    _backend.mark_failed(OP, choice, case.device, case.key(), error)
