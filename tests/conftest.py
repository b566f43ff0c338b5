"""Shared test configuration. Markers are defined once, in pyproject.toml."""
