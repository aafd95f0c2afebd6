"""Flux's frozen encoders: T5 (the text sequence), CLIP (the pooled text vector) and the autoencoder
(images <-> 16-channel latents), and the encode cache.

From local Hugging Face folders (``--flux.pipeline_path`` or ``--flux.t5_encoder`` /
``--flux.clip_encoder`` / ``--flux.autoencoder_path``): ``T5EncoderModel`` and ``CLIPTextModel``
through transformers, ``AutoencoderKL`` through diffusers, each with its tokenizer, prompts padded
as FluxPipeline pads them (T5 to ``max_txt_len`` tokens, CLIP to its 77) and every position attended.
Without folders (the debug flavor): tiny T5 and CLIP built from configs with fixed random weights
(seed 0, so a checkpoint samples later with the same encoders) over a byte-level tokenizer, and no
autoencoder: pixel-space 2x2 patches (``vae_scale`` 1).

The encoders never train: built in ``eval()``, ``requires_grad_(False)``, run under ``no_grad``,
outside the model (so outside the optimizer and the checkpoint). ``EncodeCache`` keeps their outputs
as safetensors files keyed by the encoder's identity and the input, so later epochs and runs reuse them.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

SHIFT_SCALE_DEFAULT = (0.1159, 0.3611)  # FLUX.1's autoencoder: shift_factor, scaling_factor


def _need(package: str):
    try:
        module = __import__(package)
    except ImportError:
        raise RuntimeError(f"Flux's encoders need the {package} package: pip install {package}") from None
    module.utils.logging.disable_progress_bar()  # a run's console keeps its own lines
    return module


class ByteTokenizer:
    """Captions -> (b, length) int64 ids: UTF-8 bytes + ``offset``, then ``eos``, padded with ``pad``
    (``bos`` first when given); for the tiny random encoders."""

    def __init__(self, length: int, offset: int, eos: int, pad: int, bos: int | None = None) -> None:
        self.length, self.offset, self.eos, self.pad, self.bos = length, offset, eos, pad, bos

    def __call__(self, captions: list[str]) -> torch.Tensor:
        out = torch.full((len(captions), self.length), self.pad, dtype=torch.int64)
        head = [] if self.bos is None else [self.bos]
        for row, text in enumerate(captions):
            ids = head + [b + self.offset for b in text.encode("utf-8")][: self.length - 1 - len(head)] + [self.eos]
            out[row, : len(ids)] = torch.tensor(ids)
        return out


class HFTokenizer:
    """A transformers tokenizer padding to ``length`` (truncating), as FluxPipeline calls it."""

    def __init__(self, tok, length: int) -> None:
        self.tok, self.length = tok, length

    def __call__(self, captions: list[str]) -> torch.Tensor:
        return self.tok(captions, padding="max_length", max_length=self.length, truncation=True,
                        return_tensors="pt").input_ids


def _tiny_t5(args):
    transformers = _need("transformers")
    cfg = transformers.T5Config(vocab_size=259, d_model=args.context_dim, d_kv=16, d_ff=2 * args.context_dim,
                                num_layers=2, num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.T5EncoderModel(cfg)
    return model, ByteTokenizer(args.max_txt_len, offset=3, eos=1, pad=0)


def _tiny_clip(args):
    transformers = _need("transformers")
    length = 40
    cfg = transformers.CLIPTextConfig(vocab_size=259, hidden_size=args.vec_dim, intermediate_size=2 * args.vec_dim,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=length,
                                      bos_token_id=256, eos_token_id=257, pad_token_id=258)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.CLIPTextModel(cfg)
    return model, ByteTokenizer(length, offset=0, eos=257, pad=258, bos=256)


def _tokenizer_of(folder: Path, sibling: str):
    transformers = _need("transformers")
    for where in (folder, folder.parent / sibling):
        if (where / "tokenizer_config.json").is_file() or (where / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(where)
    raise ValueError(f"{folder}: no tokenizer files in it or in {folder.parent / sibling}")


def _folders(f) -> dict[str, str]:
    """The encoder folders of a ``[flux]`` config: explicit ones, else the pipeline's subfolders."""
    base = Path(f.pipeline_path).expanduser() if f.pipeline_path else None
    pick = lambda own, sub: own or (str(base / sub) if base is not None and (base / sub).is_dir() else "")  # noqa: E731
    return {"t5": pick(f.t5_encoder, "text_encoder_2"), "clip": pick(f.clip_encoder, "text_encoder"),
            "vae": pick(f.autoencoder_path, "vae")}


class FluxEncoders:
    """The frozen encoders of a run of ``args`` (a FluxArgs) under the ``[flux]`` config ``f``, on
    ``device`` in ``dtype``. ``identity`` names them (cache keys). Raises ValueError, naming the
    config key, for encoders whose sizes do not fit the flavor or a missing folder a flavor needs."""

    def __init__(self, args, f, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.args, self.device, self.dtype = args, device, dtype
        folders = _folders(f)
        transformers = _need("transformers")
        if folders["t5"]:
            p = Path(folders["t5"])
            self.t5 = transformers.T5EncoderModel.from_pretrained(p)
            self.t5_tokenize = HFTokenizer(_tokenizer_of(p, "tokenizer_2"), args.max_txt_len)
            t5_id = f"t5:{p.resolve()}:{args.max_txt_len}"
        else:
            self.t5, self.t5_tokenize = _tiny_t5(args)
            t5_id = f"t5:tiny-v1:{args.context_dim}:{args.max_txt_len}"
        if folders["clip"]:
            p = Path(folders["clip"])
            self.clip = transformers.CLIPTextModel.from_pretrained(p)
            tok = _tokenizer_of(p, "tokenizer")
            self.clip_tokenize = HFTokenizer(tok, tok.model_max_length)
            clip_id = f"clip:{p.resolve()}"
        else:
            self.clip, self.clip_tokenize = _tiny_clip(args)
            clip_id = f"clip:tiny-v1:{args.vec_dim}"
        if self.t5.config.d_model != args.context_dim:
            raise ValueError(f"flux.t5_encoder: its d_model {self.t5.config.d_model} is not the flavor's context_dim "
                             f"{args.context_dim}")
        if self.clip.config.hidden_size != args.vec_dim:
            raise ValueError(f"flux.clip_encoder: its hidden_size {self.clip.config.hidden_size} is not the flavor's "
                             f"vec_dim {args.vec_dim}")
        self.vae = None
        if folders["vae"]:
            diffusers = _need("diffusers")
            self.vae = diffusers.AutoencoderKL.from_pretrained(folders["vae"])
            c = self.vae.config
            if c.latent_channels != args.latent_channels:
                raise ValueError(f"flux.autoencoder_path: {c.latent_channels} latent channels, the flavor has "
                                 f"{args.latent_channels}")
            self.vae_scale = 2 ** (len(c.block_out_channels) - 1)
            self.shift = c.shift_factor if c.shift_factor is not None else 0.0
            self.scale = c.scaling_factor
            vae_id = f"vae:{Path(folders['vae']).resolve()}"
        else:
            if args.vae_scale != 1:
                raise ValueError(f"flux.autoencoder_path: flavor with {args.latent_channels} latent channels needs an "
                                 "AutoencoderKL folder (or --flux.pipeline_path); only vae_scale 1 flavors "
                                 "(debugmodel) train on pixels")
            self.vae_scale, vae_id = 1, "pixels"
        for m in (self.t5, self.clip, self.vae):
            if m is not None:
                m.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.text_identity = f"{t5_id}|{clip_id}|{dtype}"
        self.image_identity = f"{vae_id}|{dtype}"

    def tokenize(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 ids (b, max_txt_len), CLIP ids (b, clip length)) int64 on the CPU."""
        return self.t5_tokenize(captions), self.clip_tokenize(captions)

    @torch.no_grad()
    def encode_text(self, t5_ids: torch.Tensor, clip_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 last hidden states (b, L, context_dim), CLIP pooled (b, vec_dim)) in the encoders' dtype."""
        txt = self.t5(t5_ids.to(self.device), output_hidden_states=False).last_hidden_state
        vec = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        return txt, vec

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(b, 3, H, W) in [-1, 1] -> latents (b, latent_channels, H / vae_scale, W / vae_scale):
        ``(mean of the posterior - shift) * scale``, or the pixels themselves without an autoencoder."""
        images = images.to(self.device, self.dtype)
        if self.vae is None:
            return images
        return (self.vae.encode(images).latent_dist.mode() - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> (b, 3, H, W) images (about [-1, 1]): ``vae.decode(z / scale + shift)``."""
        if self.vae is None:
            return latents
        z = latents.to(self.device, self.vae.dtype) / self.scale + self.shift
        return self.vae.decode(z, return_dict=False)[0]


class EncodeCache:
    """Encoder outputs on disk: ``get(kind, identity, key) -> dict | None`` and ``put(...)``, one
    safetensors file per (encoder identity, input) under ``folder/<kind>/``; writes are atomic (a
    temporary file renamed), so concurrent ranks and interrupted runs never leave a torn entry."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def _path(self, kind: str, identity: str, key: str) -> Path:
        h = hashlib.sha1(f"{identity}\0{key}".encode()).hexdigest()
        return self.folder / kind / h[:2] / f"{h}.safetensors"

    def get(self, kind: str, identity: str, key: str) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        p = self._path(kind, identity, key)
        if not p.is_file():
            self.misses += 1
            return None
        self.hits += 1
        return load_file(str(p))

    def put(self, kind: str, identity: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        p = self._path(kind, identity, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, p)
