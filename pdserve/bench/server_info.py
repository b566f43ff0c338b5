"""What a benchmark asks an OpenAI-compatible server about itself before it runs."""

from __future__ import annotations

from typing import Any

import aiohttp


async def list_models(base_url: str, api_key: str | None = None,
                      timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The model cards the server lists on /v1/models; ConnectionError when it cannot be asked."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url, headers=headers) as response,
        ):
            response.raise_for_status()
            listing = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ConnectionError(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from exc
    cards = listing.get("data") if isinstance(listing, dict) else None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
