"""Per-request provenance on real CPU vLLM engines (issue 32): a whole response's headers say
which engines served it, how its KV came (pulled: how many bytes, how long, as the decode
engine's connector measured the pull; local; colocated) and how often it migrated, and the
server logs one line per request with the same; a stream's headers say where it was placed."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.testing.server import metric_value, wait_for_metrics
from tests.integration.openai_api.conftest import MODEL
from tests.integration.openai_api.test_fields_across_the_split import LONG, SHORT

pytestmark = pytest.mark.integration


def pulled_total(base_url: str) -> float:
    return metric_value(httpx.get(f"{base_url}/metrics").text, "pdserve_kv_transfer_bytes_total",
                        transport="grpc") or 0.0


def complete(server, prompt: str, **extra) -> httpx.Response:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def test_a_pulled_request_says_what_it_pulled(disaggregated):
    time.sleep(2)  # earlier tests' pulls reach /metrics
    before = pulled_total(disaggregated.base_url)
    r = complete(disaggregated, LONG, request_id="provenance-remote")
    h = r.headers
    assert (h["x-pdserve-path"], h["x-pdserve-kv"], h["x-pdserve-migrations"]) == \
        ("remote", "pulled", "0"), dict(h)
    assert h["x-pdserve-prefill-engine"].startswith("prefill-")
    assert h["x-pdserve-decode-engine"].startswith("decode-")
    nbytes, pull_ms = int(h["x-pdserve-kv-bytes"]), float(h["x-pdserve-kv-pull-ms"])
    assert nbytes > 0 and pull_ms > 0
    # The same bytes as the deployment's counter moved for this one request.
    text = wait_for_metrics(disaggregated.base_url,
                            lambda t: (metric_value(t, "pdserve_kv_transfer_bytes_total",
                                                    transport="grpc") or 0) > before)
    assert metric_value(text, "pdserve_kv_transfer_bytes_total", transport="grpc") - before == nbytes
    log = disaggregated.log_path.read_text()
    line = next(li for li in log.splitlines() if "provenance" in li and "path=remote" in li
                and f"kv_bytes={nbytes}" in li)
    assert f"decode={h['x-pdserve-decode-engine']} kv=pulled" in line


def test_local_and_colocated_requests_say_so(disaggregated, colocated):
    # A 5-token prompt may be prefilled on the decode engine (when the router predicts that no
    # slower than the prefill engine): the headers say which, consistently.
    h = complete(disaggregated, SHORT).headers
    if h["x-pdserve-path"] == "local_short_prompt":
        assert h["x-pdserve-kv"] == "local", dict(h)
        assert "x-pdserve-prefill-engine" not in h and "x-pdserve-kv-bytes" not in h
    else:
        assert (h["x-pdserve-path"], h["x-pdserve-kv"]) == ("remote", "pulled"), dict(h)
        assert int(h["x-pdserve-kv-bytes"]) > 0
    h = complete(colocated, LONG).headers
    assert (h["x-pdserve-path"], h["x-pdserve-kv"]) == ("colocated", "local"), dict(h)


def test_a_first_token_that_ends_the_request_needs_no_pull(disaggregated):
    h = complete(disaggregated, LONG, max_tokens=1).headers
    assert (h["x-pdserve-path"], h["x-pdserve-kv"]) == ("remote", "not_needed"), dict(h)


def test_a_stream_says_where_it_was_placed(disaggregated):
    with httpx.stream("POST", f"{disaggregated.base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": True}) as r:
        assert r.headers["x-pdserve-path"] == "remote"
        assert r.headers["x-pdserve-prefill-engine"].startswith("prefill-")
        r.read()
