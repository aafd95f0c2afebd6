"""Tokenizers, document sources and the stateful, packing data loader (training and validation)."""
from trainer.data.datasets import DocumentSource, EmbeddedCorpus, HuggingFaceDataset, LocalFiles, build_source
from trainer.data.loader import DataLoader, build_dataloader, build_validation_loader
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
    "build_validation_loader",
]
