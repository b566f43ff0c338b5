"""JSON request bodies, parsed by pydantic-core's parser (jiter) instead of the standard library's.

FastAPI reads a JSON body with `Request.json()` (the standard library's `json.loads`) and then
validates the tree. A 16k-token prompt sent as token ids is a 100 KB body of integers: the
standard parser took 0.63 ms for it on the CI host, jiter 0.32. jiter also refuses what no
tokenizer nor UTF-8 encoder takes, a lone UTF-16 surrogate, whether escaped ("\\ud800") or as
raw bytes, at the byte where it stands. The standard parser lets it through, and a walk over
every string and list item of the parsed tree to find one cost 1.45 ms more for that prompt.

`JsonBodyRoute` is the app's route class (FastAPI's documented way to give routes another
`Request`): its requests parse with jiter. A body jiter refuses reaches FastAPI as the
`json.JSONDecodeError` it expects, so it becomes the usual `json_invalid` validation error, with
the parser's words (or `NOT_UNICODE`) as its context, which the app's 400 quotes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute

NOT_UNICODE = ("The request holds text that is not valid Unicode (a lone UTF-16 surrogate such "
               "as \\ud800, or bytes that are not UTF-8); send UTF-8 text.")
# jiter's words for a lone surrogate (escaped or raw) and for bytes that are not UTF-8.
_UNICODE_ERRORS = ("surrogate", "unicode code point", "hex escape", "utf-8")


def parse_json(body: bytes) -> Any:
    """The parsed body, or `json.JSONDecodeError` (its msg `NOT_UNICODE` for text that cannot
    be UTF-8)."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        text = str(e)
        msg = NOT_UNICODE if any(word in text.lower() for word in _UNICODE_ERRORS) else text
        raise json.JSONDecodeError(msg, "", 0) from None


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JsonBodyRoute(APIRoute):
    """A route whose handler sees a request that parses its JSON body with jiter."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_jiter(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return with_jiter
