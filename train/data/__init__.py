"""Data: the embedded stdlib corpus, its tokenizer, generic text sources, LM/prompt datasets.

Lightning data modules live in :mod:`train.data.datamodule` (not imported here, to keep
``import train.data`` free of Lightning).
"""

from train.data.corpus import DEFAULT_CORPUS_DIR, build_corpus, load_corpus, read_manifest
from train.data.lm import collate_left_pad, make_prompts, pack_sequences
from train.data.sources import DataSourceConfig, load_text_dataset
from train.data.tokenizer import load_or_train_tokenizer, load_tokenizer_file, train_tokenizer

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "DataSourceConfig",
    "build_corpus",
    "collate_left_pad",
    "load_corpus",
    "load_or_train_tokenizer",
    "load_text_dataset",
    "load_tokenizer_file",
    "make_prompts",
    "pack_sequences",
    "read_manifest",
    "train_tokenizer",
]
