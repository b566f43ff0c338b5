import json

import pytest
from pydantic import ValidationError

from pdserve.cli import build_parser, serve_overrides
from pdserve.config import ServingMode, config_json_schema, load_config, parse_set_options
from pdserve.errors import ConfigError

pytestmark = pytest.mark.unit


def test_defaults_are_one_prefill_one_decode_on_the_embedded_model():
    config = load_config()
    assert config.mode is ServingMode.DISAGGREGATED
    assert config.model.source == "embedded"
    assert (config.pools.prefill.replicas, config.pools.decode.replicas) == (1, 1)
    assert config.kv.transport == "grpc"
    assert config.api.port == 8000


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("api:\n  port: 9000\n  host: 0.0.0.0\nengine:\n  max_num_seqs: 8\n")
    config = load_config(path, {"api.port": 9100})
    assert config.api.port == 9100  # the override wins
    assert config.api.host == "0.0.0.0"
    assert config.engine.max_num_seqs == 8


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"api.port": 70000}, "api.port"),
        ({"engine.max_num_seqs": 0}, "engine.max_num_seqs"),
        ({"engine.gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization"),
        ({"engine.kind": "tgi"}, "engine.kind"),
        ({"mode": "both"}, "mode"),
        ({"api.portt": 1}, "api.portt"),
        ({"mode": "colocated", "pools.colocated.replicas": 0}, "pools.colocated.replicas"),
        ({"mode": "disaggregated", "pools.decode.replicas": 0}, "pools.decode.replicas"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_cross_field_rule_tp_on_cpu():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(None, {"engine.device": "cpu", "engine.tensor_parallel_size": 2})


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        config.api.port = 1  # type: ignore[misc]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("api: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_set_options_parse_yaml_scalars():
    assert parse_set_options(["engine.max_num_seqs=32", "ray.address=auto", "a.b="]) == {
        "engine.max_num_seqs": 32, "ray.address": "auto", "a.b": None,
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_options(["novalue"])


def test_cli_flags_map_onto_config_paths(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--port", "8123", "--model", str(tmp_path), "--engine", "mock",
         "--replicas", "2", "--set", "engine.max_num_seqs=4"])
    config = load_config(None, serve_overrides(args))
    assert config.api.port == 8123
    assert config.model.source == str(tmp_path)
    assert config.engine.kind == "mock"
    assert config.pools.colocated.replicas == 2
    assert config.engine.max_num_seqs == 4


def test_json_schema_has_descriptions():
    schema = json.loads(config_json_schema())
    api = schema["$defs"]["ApiConfig"]["properties"]
    assert "description" in api["port"]


def test_adaptive_disaggregation_from_the_cli_and_its_requirements():
    args = build_parser().parse_args(
        ["serve", "--engine", "mock", "--mode", "disaggregated", "--adaptive", "--ttft-ms", "500",
         "--tpot-ms", "20"])
    assert load_config(None, serve_overrides(args)).scheduler.overflow_ttft_share == 0.5
    args = build_parser().parse_args(
        ["serve", "--engine", "mock", "--mode", "disaggregated", "--adaptive", "0.8",
         "--ttft-ms", "500", "--tpot-ms", "20"])
    assert load_config(None, serve_overrides(args)).scheduler.overflow_ttft_share == 0.8
    for flags in (["--mode", "colocated", "--ttft-ms", "500", "--tpot-ms", "20"],
                  ["--mode", "disaggregated"]):
        args = build_parser().parse_args(["serve", "--engine", "mock", "--adaptive", *flags])
        with pytest.raises(Exception, match="overflow_ttft_share"):
            load_config(None, serve_overrides(args))
