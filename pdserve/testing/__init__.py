"""Test and simulation helpers that ship with pdserve: a mock engine, an in-process backend,
and a tiny tokenizer. Nothing here loads a model or needs Ray."""

from pdserve.testing.inprocess import InProcessBackend
from pdserve.testing.mock_engine import MockEngine
from pdserve.testing.tokenizer import save_tiny_model, tiny_tokenizer

__all__ = ["InProcessBackend", "MockEngine", "save_tiny_model", "tiny_tokenizer"]
