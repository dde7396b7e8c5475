"""draftsmith: train drafters for speculative decoding and prove what they are worth (README.md)."""

from train import paths as _paths  # noqa: F401 -- registers ${draftsmith_root:} for every config
