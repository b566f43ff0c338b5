"""Integration tests share the session's embedded model (`embedded_checkpoint`, tests/conftest.py)."""
