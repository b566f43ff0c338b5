"""Loading the configuration: YAML file first, then command-line overrides.

Overrides are dotted paths into the tree (`api.port=8001`); the CLI maps its flags (`--port`)
onto the same paths, so a flag and a YAML key can never disagree on meaning. Validation
happens once, on the merged result, and errors name the offending field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pdserve.config.schema import ApiConfig, PdserveConfig
from pdserve.errors import ConfigError


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(config: PdserveConfig) -> None:
    """Log as api.log_level says, one format for every pdserve process (server, controller,
    ingress replicas)."""
    logging.basicConfig(level=config.api.log_level.upper(), format=LOG_FORMAT)


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> PdserveConfig:
    """Build the validated config from an optional YAML file and dotted-path overrides."""
    tree: dict[str, Any] = _read_yaml(Path(path).expanduser()) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return PdserveConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def parse_set_options(items: Iterable[str]) -> dict[str, Any]:
    """Turn `--set a.b=value` strings into overrides; values are parsed as YAML scalars."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE with a dotted key, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(raw) if raw else None
    return overrides


def load_api_keys(api: ApiConfig) -> tuple[str, ...]:
    """The API keys of `api.api_keys` and of `api.api_key_file` (one a line; blank lines and
    '#' comments skipped). Errors name the file and the line, never a key."""
    keys = list(api.api_keys)
    if api.api_key_file is not None:
        path = api.api_key_file.expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"api.api_key_file {path}: {e.strerror or e}") from None
        for number, line in enumerate(lines, 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
                raise ConfigError(f"api.api_key_file {path} line {number}: a key must be printable "
                                  "ASCII without whitespace")
            keys.append(key)
        if len(keys) == len(api.api_keys):
            raise ConfigError(f"api.api_key_file {path} holds no key")
    return tuple(keys)


def config_json_schema() -> str:
    """The JSON schema of the whole tree (field descriptions included), for editors and docs."""
    return json.dumps(PdserveConfig.model_json_schema(), indent=2)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        lines.append(f"{where}: {item['msg']}")
    return "invalid configuration: " + "; ".join(lines)
