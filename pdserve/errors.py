"""Control-plane errors.

Every error that pdserve's control plane raises derives from `PdserveError`, so callers can
catch the family without catching programming errors. The data plane (KV transfers) reports
failures as state, not exceptions; the HTTP layer turns these into OpenAI-style error bodies.
"""


class PdserveError(Exception):
    """Base class of pdserve's control-plane errors."""


class ConfigError(PdserveError):
    """The configuration is invalid; the message names the offending field."""


class ModelPreparationError(PdserveError):
    """A model could not be resolved or converted into a loadable checkpoint."""


class EngineStartError(PdserveError):
    """An engine actor failed to start (bad model, out of memory, timeout)."""


class EngineUnavailableError(PdserveError):
    """No engine can take the request (all dead, draining, or none configured)."""


class EngineRequestError(PdserveError):
    """An engine failed while serving one request (actor died, engine raised)."""


class EngineRejectedRequestError(EngineRequestError):
    """The engine refused the request's input before running it (vLLM's validation: a grammar
    that does not compile, a token id outside the vocabulary): the client's error (HTTP 400),
    with the engine's message, which names the field and says what is wrong."""


class EngineDiedError(EngineRequestError):
    """The engine died or hung under a request: not the request's fault, so another engine may
    run it (recompute a prefill, migrate a decode). A failure the request itself caused (the
    engine raised for it alone) stays a plain `EngineRequestError` and is never retried."""


class RequestDeadlineError(PdserveError):
    """The request ran past its deadline (api.request_timeout_s); its engine work was aborted."""


class OverloadedError(PdserveError):
    """The scheduler refuses a request: its SLO cannot be met now (HTTP 429 + Retry-After)."""

    def __init__(self, retry_after_s: float, reason: str, predicted_ttft_s: float) -> None:
        super().__init__(f"overloaded ({reason}); predicted TTFT {predicted_ttft_s:.2f} s")
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.predicted_ttft_s = predicted_ttft_s
