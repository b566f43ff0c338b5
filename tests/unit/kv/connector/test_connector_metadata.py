"""The connector's typed values, config, KV layout and version shims."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch
from connector_fakes import remote_params

from pdserve.config.schema import PdserveConfig
from pdserve.engine import vllm_engine
from pdserve.engine.spec import EngineSpec
from pdserve.errors import ConfigError
from pdserve.kv.connector import compat
from pdserve.kv.connector.config import ConnectorConfig, kv_transfer_config
from pdserve.kv.connector.layout import build_layout, build_regions, find_block_dim
from pdserve.kv.connector.metadata import (
    KVPin,
    KVPull,
    RemotePrefill,
    RemoteRelease,
    StepPlan,
    WorkerEndpoint,
)
from pdserve.kv.connector.worker_side import NetworkTransports
from pdserve.kv.transport import nccl

pytestmark = pytest.mark.unit


# ---- kv_transfer_params ----------------------------------------------------------------------


def test_transfer_params_survive_the_trip_through_the_frontend_as_json() -> None:
    remote = RemotePrefill("engine-p", "req-1-abc", "10.0.0.1:5000", (4, 9, 2), 300, "nccl")
    params = json.loads(json.dumps(remote.to_params()))

    assert RemotePrefill.from_params(params) == remote
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert "remote_tp_addresses" not in params


def test_transfer_params_ignore_keys_vllm_adds() -> None:
    params = {**remote_params(200), "remote_prefill_cached_tokens": 128}
    assert RemotePrefill.from_params(params).num_prompt_tokens == 200


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_address", 5000),
        ("remote_request_id", None),
        ("remote_block_ids", [1, -2]),
        ("remote_block_ids", [1, True]),
        ("num_prompt_tokens", "300"),
        ("num_prompt_tokens", 0),
        ("transport", None),
        ("remote_tp_addresses", "h:1"),
    ],
)
def test_malformed_transfer_params_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        RemotePrefill.from_params({**remote_params(200), key: value})


def test_a_step_plan_survives_vllms_pickling_between_processes() -> None:
    remote = RemotePrefill.from_params(remote_params(300))
    plan = StepPlan(
        drops=("a",),
        pins=(KVPin("b", (1, 2)),),
        confirms=(KVPin("c", (3,)),),
        pulls=(KVPull("d", remote, (40, 41, 42), (7, 8, 9)),),
        releases=(RemoteRelease(remote),),
        num_scheduled_tokens=12,
    )
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert not plan.is_empty and StepPlan().is_empty
    endpoint = WorkerEndpoint(0, "h:1", "grpc", "e")
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint


# ---- config -----------------------------------------------------------------------------------


def test_kv_transfer_config_builds_what_vllm_expects() -> None:
    config = kv_transfer_config(
        "decode", "nccl", "s3cret", lease_s=10, failure_policy="fail", host="10.1.2.3"
    )

    assert config == {
        "kv_connector": "PdserveConnector",
        "kv_connector_module_path": "pdserve.kv.connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "transport": "nccl",
            "cluster_token": "s3cret",
            "lease_s": 10,
            "failure_policy": "fail",
            "host": "10.1.2.3",
            "port": 0,
            "pull_timeout_s": 60.0,
        },
    }
    parsed = ConnectorConfig.from_vllm(SimpleNamespace(**config))
    assert parsed.is_consumer and not parsed.is_producer and parsed.lease_s == 10


def test_the_step_wait_is_on_by_default_and_can_be_turned_off() -> None:
    default = kv_transfer_config("decode", "nccl", "t")
    assert ConnectorConfig.from_vllm(SimpleNamespace(**default)).step_wait_max_s == 0.05
    off = kv_transfer_config("decode", "nccl", "t", step_wait_max_s=0)
    assert off["kv_connector_extra_config"]["step_wait_max_s"] == 0
    assert ConnectorConfig.from_vllm(SimpleNamespace(**off)).step_wait_max_s == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "router"}, "role"),
        ({"transport": "rdma"}, "transport"),
        ({"cluster_token": ""}, "cluster_token"),
        ({"lease_s": 0}, "lease_s"),
        ({"failure_policy": "retry"}, "failure_policy"),
        ({"port": 70000}, "port"),
        ({"pull_timeout_s": -1}, "pull_timeout_s"),
        ({"nccl_api": "fast"}, "nccl_api"),
        ({"nccl_max_pairs": 0}, "nccl_max_pairs"),
        ({"nccl_max_pairs_per_session": True}, "nccl_max_pairs_per_session"),
        ({"step_wait_max_s": -0.01}, "step_wait_max_s"),
        ({"step_wait_max_s": 2.0}, "step_wait_max_s"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"role": "prefill", "transport": "grpc", "cluster_token": "t", **kwargs}
    with pytest.raises(ConfigError, match=field):
        kv_transfer_config(args.pop("role"), args.pop("transport"), args.pop("cluster_token"), **args)


def test_the_deployments_nccl_api_reaches_the_nccl_endpoints(monkeypatch) -> None:
    # config tree -> vLLM's kv_transfer_config (the engine actor) -> ConnectorConfig (the worker)
    # -> the endpoints it builds; no environment variable on the way.
    tree = PdserveConfig.model_validate(
        {"kv": {"transport": "nccl", "cluster_token": "t", "nccl_api": "torch", "advertise_host": "10.0.0.7"}}
    )
    vllm_config = vllm_engine._kv_transfer_config(EngineSpec("decode-0", "decode", "/m", "m", tree))
    config = ConnectorConfig.from_vllm(SimpleNamespace(**vllm_config))
    assert config.nccl_api == "torch"
    built = []
    monkeypatch.setattr(nccl, "NcclSource", lambda *a, **options: built.append(("source", options["nccl_api"])))
    monkeypatch.setattr(nccl, "NcclSink", lambda *a, **options: built.append(("sink", options["nccl_api"])))
    transports = NetworkTransports(config)
    transports.make_source(None, [], engine_id="e", on_release=lambda *a: None, tp_rank=0)
    transports.make_sink("nccl", None, [], engine_id="e")
    assert built == [("source", "torch"), ("sink", "torch")]
    # The default stays out of the extra config, which is then what it was before the setting.
    default = kv_transfer_config("prefill", "nccl", "t")["kv_connector_extra_config"]
    assert "nccl_api" not in default and ConnectorConfig.from_extra("kv_producer", default).nccl_api == "auto"


def test_the_deployments_nccl_pair_limits_reach_the_nccl_source(monkeypatch) -> None:
    tree = PdserveConfig.model_validate(
        {"kv": {"transport": "nccl", "cluster_token": "t", "advertise_host": "10.0.0.7",
                "nccl_max_pairs": 3, "nccl_max_pairs_per_session": 1}}
    )
    vllm_config = vllm_engine._kv_transfer_config(EngineSpec("prefill-0", "prefill", "/m", "m", tree))
    config = ConnectorConfig.from_vllm(SimpleNamespace(**vllm_config))
    built = []
    monkeypatch.setattr(
        nccl, "NcclSource", lambda *a, **o: built.append((o["max_pairs"], o["max_pairs_per_session"]))
    )
    NetworkTransports(config).make_source(None, [], engine_id="e", on_release=lambda *a: None, tp_rank=0)
    assert built == [(3, 1)]
    default = kv_transfer_config("prefill", "nccl", "t")["kv_connector_extra_config"]
    assert "nccl_max_pairs" not in default and "nccl_max_pairs_per_session" not in default


def test_unknown_extra_keys_and_policy_disagreement_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        ConnectorConfig.from_extra("kv_both", {"transport": "grpc", "cluster_token": "t", "lease": 3})
    vllm_config = SimpleNamespace(
        kv_role="kv_both",
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"transport": "grpc", "cluster_token": "t", "failure_policy": "recompute"},
    )
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        ConnectorConfig.from_vllm(vllm_config)


def test_vllm_policy_is_the_connector_policy_when_extra_config_is_silent() -> None:
    vllm_config = SimpleNamespace(
        kv_role="kv_both",
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"transport": "grpc", "cluster_token": "t"},
    )
    assert ConnectorConfig.from_vllm(vllm_config).failure_policy == "fail"


# ---- layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((182, 3, 128, 128), (0, 1)),  # CPU backend
        ((2, 182, 16, 8, 128), (1, 1)),  # FlashAttention
        ((2, 364, 16, 8, 128), (1, 2)),  # kernel blocks half the scheduler's
    ],
)
def test_block_dim_is_found_by_size(shape: tuple[int, ...], expected: tuple[int, int]) -> None:
    assert find_block_dim(shape, 182) == expected


def test_layers_sharing_one_tensor_are_one_region_and_kernel_splits_are_regrouped() -> None:
    buffer = torch.zeros(2, 10, 3, 4, 8)
    shared = {"a": buffer[0], "b": buffer[1], "b_alias": buffer[1]}
    regions = build_regions(shared, 10)
    assert len(regions) == 2 and regions[0].info().block_shape == (3, 4, 8)

    split = build_regions({"a": torch.zeros(2, 20, 4, 8)}, 10)
    assert split[0].num_blocks == 10 and split[0].info().block_shape == (2, 2, 4, 8)

    with pytest.raises(ValueError, match="layer a"):
        build_regions({"a": torch.zeros(3, 7)}, 10)


def test_layout_names_what_peers_must_share() -> None:
    caches = {f"l{i}": torch.zeros(10, 3, 16, 8) for i in range(4)}
    layout = build_layout(build_regions(caches, 10), model_id="m", block_size=16, tp_rank=0, tp_size=1)
    assert (layout.model, layout.dtype, layout.block_size, layout.num_layers) == ("m", "float32", 16, 4)
    assert layout.kv_layout == "block=3x16x8"
    # The block dim's position is not part of it: the wire form of a block is its row-major bytes.
    moved = {f"l{i}": torch.zeros(3, 10, 16, 8).movedim(1, 0) for i in range(4)}
    same = build_layout(build_regions(moved, 10), model_id="m", block_size=16, tp_rank=0, tp_size=1)
    assert same == layout


# ---- version shims -------------------------------------------------------------------------------


def scheduler_output(resumed: str) -> SimpleNamespace:
    new = SimpleNamespace(req_id="n", block_ids=([1, 2],), num_computed_tokens=0)
    cached = SimpleNamespace(
        req_ids=["c", "r"], new_block_ids=[None, ([7, 8],)], num_computed_tokens=[256, 0]
    )
    if resumed == "set":  # vLLM 0.24+ (and 0.32)
        cached.resumed_req_ids = {"r"}
    else:  # older releases
        cached.resumed_from_preemption = [False, True]
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"n": 200, "c": 1, "r": 130},
    )


@pytest.mark.parametrize("resumed", ["set", "flags"])
def test_scheduled_requests_are_read_from_either_scheduler_output_shape(resumed: str) -> None:
    assert list(compat.iter_scheduled(scheduler_output(resumed))) == [
        compat.ScheduledRequest("n", (1, 2), True, 0, 200),
        compat.ScheduledRequest("c", None, False, 256, 1),
        compat.ScheduledRequest("r", (7, 8), True, 0, 130),
    ]


def test_finish_kinds_follow_vllm_status_names() -> None:
    def kind(name: str) -> str:
        return compat.finish_kind(SimpleNamespace(status=SimpleNamespace(name=name)))

    assert kind("FINISHED_LENGTH_CAPPED") == compat.FinishKind.LENGTH
    assert kind("FINISHED_STOPPED") == compat.FinishKind.STOPPED
    assert (
        kind("FINISHED_ABORTED")
        == kind("FINISHED_ERROR")
        == kind("FINISHED_NEW")
        == compat.FinishKind.ABORTED
    )
    assert kind("RUNNING") == compat.FinishKind.RUNNING


def test_prompt_blocks_are_cut_from_either_versions_block_list() -> None:
    assert compat.prompt_block_ids([5, 6, 7, 8], 129, 128) == [5, 6]  # 0.24: every allocated block
    assert compat.prompt_block_ids([5, 6], 129, 128) == [5, 6]  # 0.32: computed tokens' blocks
    assert compat.prompt_block_ids([5], 129, 128) is None


def test_the_deployments_kv_tls_reaches_both_endpoints(monkeypatch) -> None:
    tree = PdserveConfig.model_validate(
        {"kv": {"transport": "nccl", "cluster_token": "t", "advertise_host": "10.0.0.7",
                "tls_certfile": "/pki/engine.pem", "tls_keyfile": "/pki/engine.key",
                "tls_ca_file": "/pki/ca.pem", "tls_client_auth": True}}
    )
    vllm_config = vllm_engine._kv_transfer_config(EngineSpec("decode-0", "decode", "/m", "m", tree))
    config = ConnectorConfig.from_vllm(SimpleNamespace(**vllm_config))
    built = []
    monkeypatch.setattr(nccl, "NcclSource", lambda *a, **options: built.append(options["tls"]))
    monkeypatch.setattr(nccl, "NcclSink", lambda *a, **options: built.append(options["tls"]))
    transports = NetworkTransports(config)
    transports.make_source(None, [], engine_id="e", on_release=lambda *a: None, tp_rank=0)
    transports.make_sink("nccl", None, [], engine_id="e")
    assert [(t.certfile, t.keyfile, t.ca_file, t.client_auth) for t in built] == [
        ("/pki/engine.pem", "/pki/engine.key", "/pki/ca.pem", True)
    ] * 2
    plain = kv_transfer_config("prefill", "grpc", "t")["kv_connector_extra_config"]
    assert not any(key.startswith("tls_") for key in plain)
    assert ConnectorConfig.from_extra("kv_producer", plain).tls is None


@pytest.mark.parametrize(
    "kv",
    [
        {"tls_certfile": "/c.pem"},
        {"tls_certfile": "/c.pem", "tls_keyfile": "/k.pem", "tls_client_auth": True},
        {"tls_ca_file": "/ca.pem"},
    ],
)
def test_incomplete_kv_tls_settings_are_refused(kv) -> None:
    with pytest.raises(ValueError, match="kv.tls_"):
        PdserveConfig.model_validate({"kv": kv})
