"""Test helpers that ship with pdserve: an in-process backend and a tiny tokenizer. Nothing here
loads a model or needs Ray, and no production module imports this package (the mock engine is
an engine kind: pdserve.engine.mock_engine)."""

from pdserve.testing.inprocess import InProcessBackend
from pdserve.testing.tokenizer import save_tiny_model, tiny_tokenizer

__all__ = ["InProcessBackend", "save_tiny_model", "tiny_tokenizer"]
