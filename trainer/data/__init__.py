"""Tokenizers, document sources and the stateful, packing data loader."""
from trainer.data.datasets import DocumentSource, EmbeddedCorpus, HuggingFaceDataset, LocalFiles, build_source
from trainer.data.loader import DataLoader, build_dataloader
from trainer.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DataLoader",
    "DocumentSource",
    "EmbeddedCorpus",
    "HuggingFaceDataset",
    "LocalFiles",
    "Tokenizer",
    "build_dataloader",
    "build_source",
    "build_tokenizer",
]
