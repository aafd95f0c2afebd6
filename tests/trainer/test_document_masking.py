"""--training.document_masking: a packed document's outputs equal those of the same document run alone.

The Llama model runs its attention through ``titan_kernels.flash_attn`` (no mask) or, given
``position_ids``, ``flash_attn_varlen`` over the documents of the batch, whose boundaries come from
the positions the loader writes while packing (restarting at 0 at each document start), not from
searching the tokens for EOS. Checked here: logits and parameter gradients of a packed batch equal
those of its documents run one by one (reference and Triton backends); the boundaries of a real
packed batch (tinyshakespeare, the real tokenizer) are the row starts and the documents' first
tokens; ``forward_backward`` with ``document_masking`` gives the loss of the separate documents.
About 20 s.
"""
from __future__ import annotations

import pytest
import torch

import titan_kernels as tk
from trainer.data.datasets import LocalFiles
from trainer.data.loader import DataLoader
from trainer.data.tokenizer import build_tokenizer
from trainer.models.llama3.args import LLAMA31_ROPE_SCALING
from trainer.models.llama3.args import Llama3Args as ModelArgs
from trainer.registry import build_model
from trainer.models.common.losses import cross_entropy_loss
from trainer.models.common.attention import document_cu_seqlens
from trainer.step import forward_backward

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32,
                 rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=40)


def _model(args=ARGS, seed=3):
    m = build_model(args, device="meta")
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _packed(rows: list[list[int]], vocab: int):
    """Token rows made of documents of the given lengths, with positions restarting at each document."""
    docs = [[torch.randint(0, vocab, (n,)) for n in row] for row in rows]
    tokens = torch.stack([torch.cat(r) for r in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in r]) for r in docs])
    return docs, tokens, positions


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_equals_separate(backend):
    st = tk.available_backends("cpu")[backend]
    if not st.available:
        pytest.skip(f"{backend} cannot run on CPU tensors here: {st.reason}")
    model = _model()
    # Row 0 holds four documents (one of a single token), row 1 two; rows are 32 tokens.
    docs, tokens, positions = _packed([[9, 1, 14, 8], [20, 12]], ARGS.vocab_size)
    weights = torch.randn(*tokens.shape, ARGS.vocab_size)
    with tk.use_backend(backend):
        packed = model(tokens, positions)
        (packed * weights).sum().backward()
        g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        col = 0
        separate_loss = 0.0
        for r, row in enumerate(docs):
            col = 0
            for d in row:
                alone = model(d[None])
                assert _rel(packed[r:r + 1, col:col + len(d)], alone) < 1e-5, (backend, r, col)
                separate_loss = separate_loss + (alone * weights[r:r + 1, col:col + len(d)]).sum()
                col += len(d)
        separate_loss.backward()
    for n, p in model.named_parameters():
        assert _rel(g_packed[n], p.grad) < 1e-5, (backend, n)


def test_without_masking_documents_see_each_other():
    # The same packed tokens with position_ids=None are one causal sequence: later documents change.
    model = _model()
    docs, tokens, positions = _packed([[10, 10]], ARGS.vocab_size)
    masked, unmasked = model(tokens, positions), model(tokens)
    assert _rel(unmasked[:, :10], masked[:, :10]) < 1e-5  # the first document is the same either way
    assert _rel(unmasked[:, 10:], masked[:, 10:]) > 1e-2


def test_boundaries_come_from_the_packing(shared_data):
    tok = build_tokenizer(shared_data / "tokenizer" / "tokenizer.json")
    loader = DataLoader(LocalFiles(shared_data / "tinyshakespeare.txt"), tok, seq_len=64, local_batch_size=4)
    seen_inner_start = False
    for _ in range(6):
        batch = next(loader)
        ids, pos = batch["input_ids"], batch["position_ids"]
        cu = document_cu_seqlens(pos)
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == ids.numel()
        # Independently: a document starts at each row start and at each BOS the packing put in.
        starts = ids == tok.bos_id
        starts[:, 0] = True
        assert cu[:-1].tolist() == starts.flatten().nonzero().flatten().tolist()
        seen_inner_start |= bool(starts[:, 1:].any())
    assert seen_inner_start, "the batches should contain a document that starts inside a row"

    # On a real batch, every document's logits equal those of the document alone.
    args = ARGS.replace(vocab_size=tok.vocab_size, max_seq_len=64, dim=32, n_heads=2, n_kv_heads=1, n_layers=1)
    model = _model(args)
    ids, pos = batch["input_ids"][:2], batch["position_ids"][:2]
    out = model(ids, pos)
    cu = document_cu_seqlens(pos).tolist()
    flat_ids, flat_out = ids.flatten(), out.flatten(0, 1)
    for a, b in zip(cu[:-1], cu[1:]):
        assert _rel(flat_out[a:b], model(flat_ids[None, a:b])[0]) < 1e-5


def test_forward_backward_with_document_masking():
    # The train loop's flag: with it, the loss of a packed batch is the loss of its documents alone.
    model = _model()
    docs, tokens, positions = _packed([[6, 11, 15]], ARGS.vocab_size)
    labels = torch.randint(0, ARGS.vocab_size, tokens.shape)
    batch = {"input_ids": tokens, "labels": labels, "position_ids": positions}
    masked = forward_backward(model, cross_entropy_loss, [batch], torch.device("cpu"), document_masking=True)
    plain = forward_backward(model, cross_entropy_loss, [batch], torch.device("cpu"), document_masking=False)
    total, col = 0.0, 0
    for d in docs[0]:
        total += cross_entropy_loss(model(d[None]), labels[:, col:col + len(d)]).item()
        col += len(d)
    assert abs(masked.item() - total / tokens.numel()) < 1e-5 * abs(masked.item())
    assert abs(plain.item() - masked.item()) > 1e-4
