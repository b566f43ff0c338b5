"""deploy/: every cluster YAML is one Ray's own schema accepts, every app config is one pdserve
loads, the pools of each app config land on its cluster's worker node types, and the monitoring
files agree with the metrics pdserve exports."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.serving.metrics import ServingMetrics
from pdserve.config import load_config
from pdserve.config.schema import ServingMode

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "pdserve.json"
CLUSTERS = sorted(DEPLOY.glob("*/cluster.yaml"))
APPS = sorted(DEPLOY.glob("*/app.yaml"))
MONITORING_YAMLS = {
    MONITORING / "prometheus.yml",
    MONITORING / "docker-compose.yml",
    MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml",
    MONITORING / "grafana" / "provisioning" / "dashboards" / "pdserve.yml",
}
# On the dashboard before pdserve exports them (the autoscaler is being built).
PLANNED_METRICS = {"pdserve_pool_replicas", "pdserve_scaling_decisions_total"}
# Ray's autoscaler metrics (the `ray` scrape job): nodes per node type.
RAY_METRICS = {"autoscaler_active_nodes", "autoscaler_pending_nodes"}


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(DEPLOY)) for p in paths]


def ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_every_yaml_in_deploy_is_checked_here():
    found = set(DEPLOY.rglob("*.yaml")) | set(DEPLOY.rglob("*.yml"))
    assert found == set(CLUSTERS) | set(APPS) | MONITORING_YAMLS
    assert {p.parent for p in CLUSTERS} == {p.parent for p in APPS}, "one app config per cluster"
    assert len(CLUSTERS) >= 2


@pytest.mark.parametrize("path", CLUSTERS, ids=ids(CLUSTERS))
def test_cluster_yaml_passes_rays_schema_and_ray_up_config_checks(path):
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, ray_schema())
    # What `ray up` does before it touches a cloud: fill defaults, check node types.
    validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CLUSTERS, ids=ids(CLUSTERS))
def test_setup_commands_install_pdserve_with_its_gpu_extra(path):
    config = yaml.safe_load(path.read_text())
    assert any('pdserve[gpu]"' in cmd and "install" in cmd for cmd in config["setup_commands"])
    assert config["file_mounts"]["~/pdserve"] == "."


@pytest.mark.parametrize("path", APPS, ids=ids(APPS))
def test_app_config_loads_and_joins_the_cluster(path):
    config = load_config(path)
    assert config.ray.address == "auto"
    for role in config.active_roles():
        pool = config.pools.for_role(role)
        # Explicit: the head has no GPU and workers may still be starting when the service does.
        assert pool.num_gpus == config.engine.tensor_parallel_size
        assert pool.resources, f"pools.{role.value} must ask for its node type's resource"


def ray_starts(commands: list[str]) -> list[str]:
    """Each `ray start` of a start-command list, with what precedes it in its shell command."""
    found = []
    for command in commands:
        for part in re.split(r"[;&|\n]+", command):
            if re.search(r"\bray start\b", part):
                found.append(" ".join(part.split()))
    return found


@pytest.mark.parametrize("path", CLUSTERS, ids=ids(CLUSTERS))
def test_every_node_starts_ray_with_token_auth_and_the_same_token(path):
    config = yaml.safe_load(path.read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = ray_starts(config[key])
        assert starts, f"{key}: no ray start"
        for start in starts:
            # The variable on the command itself: a worker's raylet without it cannot join.
            assert re.match(r"^(\S+=\S+ )*RAY_AUTH_MODE=token ray start\b", start), start
    everything = yaml.safe_dump(config)
    assert "RAY_AUTH_MODE=disabled" not in everything
    # One token on every node: the file mount the head's autoscaler also syncs to workers.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # Whatever runs on a node later (`ray exec`, pdserve serve, ray status) sends the token too.
    assert any("export RAY_AUTH_MODE=token" in cmd and ".bashrc" in cmd
               for cmd in config["setup_commands"])
    assert "chmod 600 ~/.ray/auth_token" in config["setup_commands"]


@pytest.mark.parametrize("path", CLUSTERS, ids=ids(CLUSTERS))
def test_the_ray_dashboard_listens_on_the_heads_localhost_only(path):
    config = yaml.safe_load(path.read_text())
    (head,) = ray_starts(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head.split()
    assert "--include-dashboard=false" not in head  # Prometheus' service discovery needs it
    for start in ray_starts(config["worker_start_ray_commands"]):
        assert "--dashboard-host" not in start


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@pytest.mark.parametrize("path", APPS, ids=ids(APPS))
def test_the_api_listens_on_localhost_unless_it_requires_a_key(path):
    api = load_config(path).api
    has_key = bool(getattr(api, "api_keys", ())) or getattr(api, "api_key_file", None) is not None
    assert api.host in LOOPBACK_HOSTS or has_key, f"{path}: api.host {api.host} without an API key"


def test_the_firewall_table_lists_every_port_the_cluster_files_fix():
    readme = (DEPLOY / "README.md").read_text()
    table = readme[readme.index("## Network: ports and who needs them"):]
    table = table[:table.index("\n## ", 1)]
    fixed = set()
    for path in CLUSTERS:
        for match in re.finditer(r"--(?:port|[a-z-]+-port)=(\d+)", path.read_text()):
            fixed.add(match.group(1))
    fixed |= {str(load_config(p).api.port) for p in APPS}
    assert fixed >= {"6379", "8076", "8077", "8000"}
    for port in fixed | {"8265", "22"}:
        assert f"`{port}`" in table or f"`{port}-" in table or f"-{port}`" in table, port


def node_type_resources(cluster: dict) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(head resources, worker node types' resources) as `ray start` will advertise them."""
    if cluster["provider"]["type"] == "local":  # one node type: resources go on the command line
        def started_with(commands: list[str]) -> dict[str, float]:
            found = re.search(r"--resources='(\{.*?\})'", " ".join(commands))
            return json.loads(found.group(1)) if found else {}
        return (started_with(cluster["head_start_ray_commands"]),
                [started_with(cluster["worker_start_ray_commands"])])
    types = cluster["available_node_types"]
    head = cluster["head_node_type"]
    return (types[head].get("resources", {}),
            [t.get("resources", {}) for name, t in types.items() if name != head])


@pytest.mark.parametrize("path", CLUSTERS, ids=ids(CLUSTERS))
def test_every_pool_lands_on_a_worker_node_type_and_never_on_the_head(path):
    cluster = yaml.safe_load(path.read_text())
    app = load_config(path.with_name("app.yaml"))
    head, workers = node_type_resources(cluster)
    for role in app.active_roles():
        wanted = app.pools.for_role(role).resources
        assert any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in workers), role
        assert not any(k in head for k in wanted), f"the head would host {role.value} engines"


def test_the_cloud_cluster_has_prefill_and_decode_node_types_for_a_disaggregated_app():
    cloud = [p for p in CLUSTERS if yaml.safe_load(p.read_text())["provider"]["type"] != "local"]
    assert cloud
    for path in cloud:
        assert load_config(path.with_name("app.yaml")).mode is ServingMode.DISAGGREGATED
        types = yaml.safe_load(path.read_text())["available_node_types"]
        advertised = {k for t in types.values() for k in t.get("resources", {})}
        assert {"pdserve_prefill", "pdserve_decode"} <= advertised


def test_prometheus_scrapes_the_pdserve_frontend():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["pdserve"]["metrics_path"] == "/metrics"
    assert jobs["pdserve"]["static_configs"][0]["targets"]


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Prometheus) not installed")
def test_prometheus_config_passes_promtool():
    done = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_mounts_files_that_exist():
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (MONITORING / source).exists(), volume


def exported_metric_names() -> set[str]:
    """Series names pdserve's /metrics can expose (histograms as their _bucket/_sum/_count)."""
    names = set()
    for family in ServingMetrics().registry.collect():
        if family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        elif family.type == "counter":
            names.add(f"{family.name}_total")
        else:
            names.add(family.name)
    return names


def dashboard_panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def dashboard_metric_names() -> set[str]:
    exprs = [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b((?:pdserve|autoscaler)_[a-z0-9_]+)\b", e)}


def base_name(series: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", series)


def test_dashboard_queries_only_metrics_that_exist_or_are_planned():
    exported = exported_metric_names()
    unknown = dashboard_metric_names() - exported - PLANNED_METRICS - RAY_METRICS
    assert not unknown, f"the dashboard queries metrics pdserve does not export: {unknown}"


def test_every_metric_pdserve_exports_has_a_panel():
    shown = {base_name(m) for m in dashboard_metric_names()}
    missing = {m for m in exported_metric_names() if base_name(m) not in shown}
    assert not missing, f"metrics without a panel on {DASHBOARD.name}: {missing}"


def test_dashboard_covers_the_issue_panels_and_is_importable():
    titles = " | ".join(p["title"] for p in dashboard_panels())
    for needed in ("Time to first token", "Time per output token", "Pool replicas",
                   "Scaling decisions", "KV transfer rate", "KV transfer failures"):
        assert needed in titles
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            # Bound to the dashboard's data source variable: works imported or provisioned.
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


SECURITY_MD = DEPLOY.parent / "SECURITY.md"


def config_field_paths(model: type = None, prefix: str = "") -> set[str]:
    """Every dotted field path of the config tree (api.api_keys, kv.tls_certfile, ...)."""
    from pydantic import BaseModel

    from pdserve.config.schema import PdserveConfig

    model = model or PdserveConfig
    paths = set()
    for name, field in model.model_fields.items():
        paths.add(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths |= config_field_paths(annotation, f"{prefix}{name}.")
    return paths


@pytest.mark.parametrize("doc", [SECURITY_MD, DEPLOY / "README.md"],
                         ids=["SECURITY.md", "deploy/README.md"])
def test_the_security_docs_name_only_options_that_exist(doc):
    """Every config field and `pdserve serve` flag the docs name exists: nothing planned reads
    as done."""
    from pdserve.cli import build_parser

    text = doc.read_text()
    named = {name.rstrip(".") for name in re.findall(r"`((?:api|kv|engine|pools)\.[a-z_.]+)", text)}
    named -= {"pools"}  # `pools.<pool>.resources`
    assert named - config_field_paths() == set(), "options the docs name that the config lacks"
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {opt for act in commands.choices["serve"]._actions for opt in act.option_strings}
    mentioned = set(re.findall(r"`(--[a-z][a-z-]+)", text))
    serve_flags = {f for f in mentioned if f.startswith(("--api", "--ssl", "--host", "--port"))}
    assert serve_flags <= flags, serve_flags - flags
    if doc == SECURITY_MD:
        assert {"api.api_keys", "api.api_key_file", "api.metrics_api_key", "kv.cluster_token"} <= named
        assert "--api-key" in serve_flags
