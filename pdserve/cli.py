"""The `pdserve` command: serve, config, model (and bench, when installed).

Flags map onto dotted paths of the config tree, so `--port 8001` and `api: {port: 8001}` in the
YAML file mean the same thing; flags win over the file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pdserve.errors import PdserveError

# flag destination -> config path
_SERVE_FLAGS: dict[str, str] = {
    "host": "api.host",
    "port": "api.port",
    "ingress_replicas": "api.replicas",
    "model": "model.source",
    "served_model_name": "model.served_name",
    "max_model_len": "model.max_model_len",
    "dtype": "model.dtype",
    "load_format": "model.load_format",
    "engine": "engine.kind",
    "device": "engine.device",
    "replicas": "pools.colocated.replicas",
    "mode": "mode",
    "prefill": "pools.prefill.replicas",
    "decode": "pools.decode.replicas",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "prefill_tp": "pools.prefill.tensor_parallel_size",
    "decode_tp": "pools.decode.tensor_parallel_size",
    "transport": "kv.transport",
    "max_num_seqs": "engine.max_num_seqs",
    "kv_cache_memory_bytes": "engine.kv_cache_memory_bytes",
    "ray_address": "ray.address",
    "log_level": "api.log_level",
    "autoscale": "autoscale.enabled",
    "ttft_ms": "slo.ttft_ms",
    "tpot_ms": "slo.tpot_ms",
    "slo_percentile": "slo.percentile",
    "min_replicas": "autoscale.colocated.min_replicas",
    "max_replicas": "autoscale.colocated.max_replicas",
    "min_prefill": "autoscale.prefill.min_replicas",
    "max_prefill": "autoscale.prefill.max_replicas",
    "min_decode": "autoscale.decode.min_replicas",
    "max_decode": "autoscale.decode.max_replicas",
    "max_gpus": "autoscale.max_gpus",
    "profile": "scheduler.profile",
    "adaptive": "scheduler.overflow_ttft_share",
    "api_key": "api.api_keys",
    "ssl_certfile": "api.ssl_certfile",
    "ssl_keyfile": "api.ssl_keyfile",
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except PdserveError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(title="commands")
    _add_serve(sub)
    _add_config(sub)
    _add_model(sub)
    try:
        from pdserve.bench.cli import add_parser as add_bench
    except ImportError:  # the bench extra is not installed
        pass
    else:
        add_bench(sub)
    try:
        from pdserve.sim.cli import add_parser as add_sim
    except ImportError:  # the simulator needs the bench extra (workloads, metrics)
        pass
    else:
        add_sim(sub)
    return parser


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="start engines on Ray and serve the OpenAI API")
    p.add_argument("--config", help="YAML config file (see `pdserve config schema`)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--ingress-replicas", type=int,
                   help="HTTP ingress replicas, each a Ray actor on the same port (api.replicas)")
    p.add_argument("--model", help="'embedded', a local HF checkpoint dir, or a hub id")
    p.add_argument("--served-model-name", help="model name clients use")
    p.add_argument("--max-model-len", type=int, help="context length")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", help="vLLM load format ('dummy': random weights)")
    p.add_argument("--engine", choices=["vllm", "mock"], help="engine implementation")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--mode", choices=["colocated", "disaggregated"])
    p.add_argument("--replicas", type=int, help="engines in the colocated pool")
    p.add_argument("--prefill", type=int, help="engines in the prefill pool (disaggregated)")
    p.add_argument("--decode", type=int, help="engines in the decode pool (disaggregated)")
    p.add_argument("--tensor-parallel-size", type=int, help="GPUs per engine (every pool)")
    p.add_argument("--prefill-tp", type=int, help="GPUs per prefill engine (default: --tensor-parallel-size)")
    p.add_argument("--decode-tp", type=int, help="GPUs per decode engine (default: --tensor-parallel-size)")
    p.add_argument("--adaptive", type=float, nargs="?", const=0.5, metavar="SHARE",
                   help="disaggregated: decode engines also prefill once the prefill pool is behind "
                   "(a remote prefill predicts a TTFT above SHARE of --ttft-ms, default 0.5) and "
                   "--tpot-ms leaves room (scheduler.overflow_ttft_share)")
    p.add_argument("--transport", choices=["grpc", "nccl", "cuda_ipc"],
                   help="KV transfer transport (nccl runs over gloo on CPU-only hosts)")
    p.add_argument("--max-num-seqs", type=int, help="most concurrent requests per engine")
    p.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache size per engine")
    p.add_argument("--ttft-ms", type=float, help="TTFT target in ms (routing, admission, scaling)")
    p.add_argument("--tpot-ms", type=float, help="TPOT target in ms (routing, admission, scaling)")
    p.add_argument("--slo-percentile", type=float, help="percentile the targets hold for (90)")
    p.add_argument("--autoscale", action="store_true", default=None,
                   help="scale each pool within its bounds against the targets")
    p.add_argument("--min-replicas", type=int, help="autoscale: fewest colocated engines")
    p.add_argument("--max-replicas", type=int, help="autoscale: most colocated engines")
    p.add_argument("--min-prefill", type=int, help="autoscale: fewest prefill engines")
    p.add_argument("--max-prefill", type=int, help="autoscale: most prefill engines")
    p.add_argument("--min-decode", type=int, help="autoscale: fewest decode engines")
    p.add_argument("--max-decode", type=int, help="autoscale: most decode engines")
    p.add_argument("--max-gpus", type=int, help="autoscale: most GPUs of all pools together")
    p.add_argument("--profile", help="calibration JSON that seeds the performance model")
    p.add_argument("--ray-address", help="join this Ray cluster ('auto' for the local one)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key /v1 clients must send as 'Authorization: Bearer KEY' (repeatable; "
                   "on a shared host prefer api.api_key_file: command lines are visible in ps)")
    p.add_argument("--ssl-certfile", help="PEM certificate: serve HTTPS (with --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field by dotted path, e.g. engine.max_num_seqs=32")
    p.set_defaults(handler=_serve)


def _add_config(sub: Any) -> None:
    p = sub.add_parser("config", help="inspect the configuration")
    csub = p.add_subparsers(title="config commands")
    schema = csub.add_parser("schema", help="print the JSON schema of the config file")
    schema.set_defaults(handler=_config_schema)
    show = csub.add_parser("show", help="print the merged, validated config as YAML "
                           "(secrets as '***')")
    show.add_argument("--config")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(handler=_config_show)


def _add_model(sub: Any) -> None:
    p = sub.add_parser("model", help="manage models")
    msub = p.add_subparsers(title="model commands")
    prep = msub.add_parser("prepare", help="convert the embedded model now (idempotent)")
    prep.add_argument("--cache-dir", help="where converted models live")
    prep.set_defaults(handler=_model_prepare)


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.config import parse_set_options

    overrides = {path: getattr(args, dest) for dest, path in _SERVE_FLAGS.items()
                 if getattr(args, dest, None) is not None}
    overrides.update(parse_set_options(args.set))
    return overrides


def _serve(args: argparse.Namespace) -> int:
    from pdserve.config import load_config

    config = load_config(args.config, serve_overrides(args))
    if config.owned_by_deployment:
        # Ray folds like log lines of different actors into "[repeated Nx across cluster]": the
        # ingress replicas' one line per request (pdserve.provenance) would lose its request
        # ids. Ray reads this when it is imported.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from pdserve.service import run_service

    run_service(config)
    return 0


def _config_schema(args: argparse.Namespace) -> int:
    from pdserve.config import config_json_schema

    print(config_json_schema())
    return 0


def _config_show(args: argparse.Namespace) -> int:
    import yaml

    from pdserve.config import load_config, parse_set_options

    config = load_config(args.config, parse_set_options(args.set))
    print(yaml.safe_dump(config.redacted(), sort_keys=False))
    return 0


def _model_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.models.embedded import ensure_embedded_model

    path = ensure_embedded_model(Path(args.cache_dir) if args.cache_dir else None)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
