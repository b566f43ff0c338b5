"""Per-pool tensor-parallel sizes: prefill and decode engines may use different TP."""

import pytest

from pdserve.cli import build_parser, serve_overrides
from pdserve.config import load_config
from pdserve.config.schema import PoolRole
from pdserve.errors import ConfigError

pytestmark = pytest.mark.unit


def test_pools_default_to_the_engine_tp_and_may_override_it():
    config = load_config(None, {"engine.tensor_parallel_size": 2, "pools.prefill.tensor_parallel_size": 1})
    assert config.tensor_parallel_size_of(PoolRole.PREFILL) == 1
    assert config.tensor_parallel_size_of(PoolRole.DECODE) == 2
    # What an engine of each pool sees: only `engine` is read by engines.
    assert config.for_pool(PoolRole.PREFILL).engine.tensor_parallel_size == 1
    assert config.for_pool(PoolRole.DECODE) is config


def test_a_pool_binds_its_cpu_engines_to_its_own_cores():
    # `--set pools.decode.cpu_threads=1` arrives as an int.
    config = load_config(None, {"engine.cpu_threads": "0-1", "pools.prefill.cpu_threads": "0",
                                "pools.decode.cpu_threads": 1})
    assert config.for_pool(PoolRole.PREFILL).engine.cpu_threads == "0"
    assert config.for_pool(PoolRole.DECODE).engine.cpu_threads == "1"
    assert config.for_pool(PoolRole.COLOCATED) is config  # no override: the engine-wide binding


def test_cli_flags_set_each_pool_tp():
    args = build_parser().parse_args(["serve", "--prefill-tp", "1", "--decode-tp", "2"])
    config = load_config(None, serve_overrides(args))
    assert config.tensor_parallel_size_of(PoolRole.PREFILL) == 1
    assert config.tensor_parallel_size_of(PoolRole.DECODE) == 2


def test_a_pool_tp_above_one_is_refused_on_cpu():
    with pytest.raises(ConfigError, match="pools.decode.tensor_parallel_size"):
        load_config(None, {"engine.device": "cpu", "pools.decode.tensor_parallel_size": 2})


def test_engine_actors_reserve_their_pool_tp_in_gpus():
    replicas = pytest.importorskip("pdserve.serving.replicas")
    config = load_config(
        None,
        {"engine.device": "cuda", "pools.prefill.tensor_parallel_size": 1, "pools.decode.tensor_parallel_size": 2},
    )
    assert replicas.actor_options(config, PoolRole.PREFILL, "p-0")["num_gpus"] == 1
    assert replicas.actor_options(config, PoolRole.DECODE, "d-0")["num_gpus"] == 2


def test_cores_are_split_evenly_and_contiguously_in_engine_order():
    from pdserve.serving.replicas import core_list, split_cores

    assert split_cores([0, 1], ["prefill-0", "decode-0"]) == {"prefill-0": "0", "decode-0": "1"}
    assert split_cores(range(8), ["p0", "d0", "d1"]) == {"p0": "0-2", "d0": "3-5", "d1": "6-7"}
    assert split_cores([0, 2, 4, 6], ["a", "b"]) == {"a": "0,2", "b": "4,6"}
    assert split_cores([0, 1], ["only"]) == {}  # one engine keeps every core
    assert split_cores([0, 1], ["a", "b", "c"]) == {}  # more engines than cores: no split
    assert core_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_local_cpu_engines_get_their_own_cores_unless_someone_chose(monkeypatch):
    from pdserve.serving import replicas

    monkeypatch.setattr(replicas.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpu = {"engine.device": "cpu", "mode": "disaggregated"}
    assert replicas.local_core_split(load_config(None, cpu)) == {"prefill-0": "0-1", "decode-0": "2-3"}
    assert replicas.local_core_split(load_config(None, {**cpu, "pools.decode.replicas": 3})) == {
        "prefill-0": "0", "decode-0": "1", "decode-1": "2", "decode-2": "3"}
    # Not split: cores chosen (engine- or pool-wide), switched off, a cluster, GPUs, the mock.
    for override in ({"engine.cpu_threads": "0-3"}, {"pools.decode.cpu_threads": "3"},
                     {"engine.split_cpu_cores": False}, {"ray.address": "auto"},
                     {"engine.device": "cuda"}, {"engine.kind": "mock"}):
        assert replicas.local_core_split(load_config(None, {**cpu, **override})) == {}, override
    # Colocated with one engine: nothing to split, it keeps every core.
    assert replicas.local_core_split(load_config(None, {"engine.device": "cpu", "mode": "colocated"})) == {}
