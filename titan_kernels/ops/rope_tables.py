"""The cos/sin tables of rotary position embedding, ``rope_cos_sin``, with the long-context frequency
scalings in use: Llama 3.1's (``rope_type`` "llama3") and YaRN (``rope_type`` "yarn"; DeepSeek-V3,
GPT-OSS, Qwen), plus YaRN's softmax-scale correction ``yarn_mscale``.

Math:
  base        freq_i = theta ** (-2i / rotary_dim), i < rotary_dim / 2 (Su et al. 2021, RoFormer eq. 15).
  llama3      Meta's llama3 ``apply_scaling``: with wavelen = 2 pi / freq, frequencies of wavelength
              shorter than original / high_freq_factor are kept, longer than original / low_freq_factor
              divided by factor, and those between blended with smooth = (original / wavelen -
              low_freq_factor) / (high_freq_factor - low_freq_factor).
  yarn        Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
              as Hugging Face's ``_compute_yarn_parameters`` computes it: the dims whose rotations over
              ``original_max_position_embeddings`` lie between beta_slow and beta_fast blend linearly
              between interpolation (freq / factor) and extrapolation (freq); the correction range is
              floored/ceiled unless ``truncate`` is false. cos and sin are multiplied by the
              ``attention_factor`` (default mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
              both are given, else mscale(factor) = 0.1 ln(factor) + 1; eq. 21).

Angles position * freq are computed in float64 and rounded once at the end (a float32 angle at
position 1e5 would be off by about 1e-2 rad).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_REQUIRED = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def _check_int(value: object, arg: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{arg}: expected an int >= {minimum}, got {value}")
    return value


def _check_positive(value: object, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{arg}: expected a finite number > 0, got {value}")
    return float(value)


def rope_type(scaling: Mapping | None) -> str:
    """"default", "llama3" or "yarn" for a scaling dict (a dict without rope_type is Llama 3.1's)."""
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "llama3"))


def check_scaling(scaling: object) -> dict:
    """A validated copy of ``scaling``: Llama 3.1's keys, or ``rope_type="yarn"`` with YaRN's.

    Raises TypeError for a non-dict or non-number value, ValueError for missing / unknown keys, an
    unknown rope_type or out-of-range values.
    """
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling: expected a dict (Llama 3.1 or YaRN scaling) or None, got {type(scaling).__name__}")
    kind = rope_type(scaling)
    if kind == "yarn":
        extra = set(scaling) - set(YARN_REQUIRED) - set(YARN_OPTIONAL) - {"rope_type", "type", "rope_theta"}
        missing = [k for k in YARN_REQUIRED if k not in scaling]
        if extra or missing:
            raise ValueError(f"scaling: YaRN takes keys {YARN_REQUIRED + YARN_OPTIONAL}, got unknown {sorted(extra)}, "
                             f"missing {missing}")
        out: dict = {"rope_type": "yarn", "factor": _check_positive(scaling["factor"], "scaling['factor']"),
                     "original_max_position_embeddings": _check_int(scaling["original_max_position_embeddings"],
                                                                     "scaling['original_max_position_embeddings']", 1)}
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if scaling.get(key) is not None:
                out[key] = float(scaling[key]) if key in ("mscale", "mscale_all_dim") else \
                    _check_positive(scaling[key], f"scaling[{key!r}]")
        if "truncate" in scaling:
            if not isinstance(scaling["truncate"], bool):
                raise TypeError(f"scaling['truncate']: expected a bool, got {type(scaling['truncate']).__name__}")
            out["truncate"] = scaling["truncate"]
        return out
    if kind != "llama3":
        raise ValueError(f"scaling: rope_type {kind!r} is not implemented (expected 'llama3' or 'yarn')")
    extra = set(scaling) - set(LLAMA3_KEYS) - {"rope_type", "type"}
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if extra or missing:
        raise ValueError(f"scaling: expected keys {LLAMA3_KEYS} (Llama 3.1 scaling), got unknown {sorted(extra)}, "
                         f"missing {missing}")
    out = {key: _check_positive(scaling[key], f"scaling[{key!r}]") for key in LLAMA3_KEYS}
    # Equal factors (Llama 4 Scout: 1 and 1) leave no blended band: each frequency is kept or divided.
    if out["high_freq_factor"] < out["low_freq_factor"]:
        raise ValueError(
            f"scaling: expected high_freq_factor >= low_freq_factor, got {out['high_freq_factor']} < {out['low_freq_factor']}"
        )
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, eq. 21: ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(sc: Mapping) -> float:
    """The factor YaRN multiplies cos and sin by (module docstring)."""
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor, m, m_all = sc["factor"], sc.get("mscale"), sc.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


def _llama3_freqs(freqs: torch.Tensor, sc: Mapping) -> torch.Tensor:
    old_len = sc["original_max_position_embeddings"]
    low_wavelen = old_len / sc["low_freq_factor"]
    high_wavelen = old_len / sc["high_freq_factor"]
    wavelen = 2 * math.pi / freqs
    band = sc["high_freq_factor"] - sc["low_freq_factor"]
    smooth = (old_len / wavelen - sc["low_freq_factor"]) / band if band > 0 else torch.zeros_like(freqs)
    blended = (1 - smooth) * freqs / sc["factor"] + smooth * freqs
    return torch.where(wavelen < high_wavelen, freqs, torch.where(wavelen > low_wavelen, freqs / sc["factor"], blended))


def _yarn_freqs(freqs: torch.Tensor, sc: Mapping, rotary_dim: int, theta: float) -> torch.Tensor:
    factor, old_len = sc["factor"], sc["original_max_position_embeddings"]
    beta_fast, beta_slow = sc.get("beta_fast") or 32.0, sc.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=freqs.dtype, device=freqs.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return freqs / factor * (1 - extrapolation) + freqs * extrapolation


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float = 500000.0,
    scaling: Mapping | None = None,
    *,
    rotary_dim: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``apply_rotary_emb`` (module docstring for the math).

    Args:
        head_dim: size of a head (int >= 2).
        max_positions: number of table rows, i.e. positions 0..max_positions-1 (int >= 0).
        theta: RoPE base (500000 for Llama 3, 10000 for Llama 2).
        scaling: None; Llama 3.1's dict(factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings), e.g. dict(factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8192) (a Hugging Face
            ``rope_scaling`` with ``rope_type="llama3"`` is accepted as is); or YaRN's
            dict(rope_type="yarn", factor, original_max_position_embeddings, optional beta_fast (32),
            beta_slow (1), mscale, mscale_all_dim, attention_factor, truncate (True)).
        rotary_dim: number of rotated dims (even, 2 <= rotary_dim <= head_dim); default head_dim.
        device: where to build the tables (a "meta" device gives meta tensors).

    Returns:
        (cos, sin): float32 (max_positions, rotary_dim // 2); times YaRN's attention factor.

    Raises:
        TypeError: a non-int size, a non-number theta or scaling value, scaling not a dict.
        ValueError: head_dim < 2, max_positions < 0, odd rotary_dim or one outside [2, head_dim],
            theta not finite > 0, scaling keys missing/unknown, high_freq_factor < low_freq_factor,
            an unknown rope_type.
    """
    head_dim = _check_int(head_dim, "head_dim", 2)
    max_positions = _check_int(max_positions, "max_positions", 0)
    theta = _check_positive(theta, "theta")
    rotary_dim = head_dim if rotary_dim is None else _check_int(rotary_dim, "rotary_dim", 2)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected an even number <= head_dim = {head_dim}, got {rotary_dim}")
    f64 = dict(dtype=torch.float64, device=device)
    freqs = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, **f64) / rotary_dim)
    factor = 1.0
    if scaling is not None:
        sc = check_scaling(scaling)
        if sc.get("rope_type") == "yarn":
            freqs = _yarn_freqs(freqs, sc, rotary_dim, theta)
            factor = yarn_attention_factor(sc)
        else:
            freqs = _llama3_freqs(freqs, sc)
    angles = torch.outer(torch.arange(max_positions, **f64), freqs)
    return (angles.cos() * factor).to(torch.float32), (angles.sin() * factor).to(torch.float32)
