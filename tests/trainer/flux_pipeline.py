"""A tiny random diffusers FluxPipeline saved with ``save_pretrained`` (offline: word-level tokenizers
built here, tiny T5, CLIP, AutoencoderKL and transformer), for the Flux sampling tests."""
from __future__ import annotations

from pathlib import Path

import torch

WORDS = "a red green blue yellow square circle triangle at the top bottom left right in center".split()


def _tokenizer(folder: Path, specials: list[str], max_length: int, eos: str, pad: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos, pad_token=pad,
                                   model_max_length=max_length)
    fast.save_pretrained(folder)
    return fast


def save_tiny_pipeline(folder: Path, guidance: bool, seed: int = 0) -> Path:
    """A FluxPipeline folder: guidance-distilled (dynamic shift, as FLUX.1-dev) or not (no shift, as
    schnell); 16x16 images = 8x8 latents of 4 channels = 16 image tokens."""
    import diffusers
    import transformers

    torch.manual_seed(seed)
    specials = ["<pad>", "</s>", "<unk>"]
    clip_tok = _tokenizer(folder / "tokenizer", specials, 12, "</s>", "<pad>")
    t5_tok = _tokenizer(folder / "tokenizer_2", specials, 512, "</s>", "<pad>")
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=20, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=0))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tok), d_model=24, d_kv=8, d_ff=32, num_layers=2, num_heads=3, dropout_rate=0.0))
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=16, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
        use_post_quant_conv=False)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=guidance, axes_dims_rope=(4, 6, 6))
    with torch.no_grad():  # weights large enough that every block matters
        for p in transformer.parameters():
            p.normal_(0, 0.2)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0 if not guidance else 3.0, use_dynamic_shifting=guidance,
        base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    pipe = diffusers.FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
                                  text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(folder)
    return folder
