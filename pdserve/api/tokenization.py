"""POST /tokenize and POST /detokenize, as vLLM's OpenAI server has them.

The paths (at the root; vLLM has no /v1/tokenize), the request fields and the response shapes are
vLLM's (`vllm/entrypoints/serve/tokenize/`):

    /tokenize    {"model"?, "prompt", "add_special_tokens": true, "return_token_strs": false}
              or {"model"?, "messages", "add_generation_prompt": true, "continue_final_message": false,
                  "add_special_tokens": false, "return_token_strs": false}
              -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model"?, "tokens"} -> {"prompt"}

The chat form renders the messages as pdserve's chat endpoint does (`render_chat`), so its count is
the prompt length /v1/chat/completions will see. A missing model means the served one; another name
gets the 404 of the other endpoints; token ids outside the vocabulary get 400. Tokenizing runs in a
worker thread, off the event loop.

Unlike vLLM, whose `--api-key` guards `/v1/...` only, these routes need the API key when keys are
configured (`keyed_tokenizer_routes`): they spend the server's CPU on a client's text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pdserve.api.errors import bad_request, model_not_found
from pdserve.api.protocol import ChatCompletionRequest, ChatMessage
from pdserve.api.tools import ToolCalling


class _TokenizerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None


class TokenizeRequest(_TokenizerRequest):
    """vLLM's two tokenize forms in one body: `prompt` (text) or `messages` (a chat)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS). Default: true for a prompt, "
                          "false for messages, whose chat template writes its own.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    # Rendering options, as /v1/chat/completions takes them (tools: their definitions, for the
    # template). A request's own template is refused there and here.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("Missing required parameter: 'prompt' (text) or 'messages' (a chat).")
        if self.prompt is not None and self.messages is not None:
            raise ValueError("Send either 'prompt' (text) or 'messages' (a chat), not both.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                             "to True (add_generation_prompt defaults to true).")
        if self.chat_template:
            raise ValueError("chat_template is not supported: messages are rendered with the "
                             "model's own template")
        return self


class DetokenizeRequest(_TokenizerRequest):
    # Strict: "5", 5.0 and true are not token ids.
    tokens: list[StrictInt] = Field(min_length=1)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat endpoint hands them to the chat template: its own conversion
    (roles, content parts), borrowed rather than copied so that the two cannot drift apart."""
    return ChatCompletionRequest.model_construct(messages=messages).template_messages()


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt token ids of a chat, rendered by the model's chat template (`template_kwargs`:
    more variables for it, such as `tools`). The defaults are what /v1/chat/completions sends
    the engine. Blocking: call it in a worker thread."""
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False,
            **(template_kwargs or {}))
    except Exception as e:  # jinja errors for message orders the template refuses
        raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from e
    # The template already wrote the special tokens; by default no second BOS.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class Tokenization:
    """The two routes' work over the frontend's tokenizer."""

    def __init__(self, tokenizer: Any, served_name: str, max_model_len: Callable[[], int],
                 tools: ToolCalling) -> None:
        self._tokenizer = tokenizer
        self._served_name = served_name
        self._max_model_len = max_model_len
        self._tools = tools  # the chat endpoint's: tools reach the template as they do there

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        ids = await asyncio.to_thread(self._encode, body)
        token_strs = None
        if body.return_token_strs:
            token_strs = self._tokenizer.convert_ids_to_tokens(ids)
        return {"count": len(ids), "max_model_len": self._max_model_len(), "tokens": ids,
                "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        vocab = len(self._tokenizer)
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"token ids must be in [0, {vocab}), the vocabulary; got {outside[0]}",
                              "tokens")
        return {"prompt": await asyncio.to_thread(self._tokenizer.decode, body.tokens)}

    def _encode(self, body: TokenizeRequest) -> list[int]:
        if body.messages is None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return list(self._tokenizer.encode(body.prompt, add_special_tokens=special))
        kwargs = dict(body.chat_template_kwargs or {})
        plan = self._tools.plan(body.tools, "none") if body.tools is not None else None
        if plan is not None and plan.template_tools is not None:
            kwargs["tools"] = plan.template_tools
        return render_chat(self._tokenizer, template_messages(body.messages),
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           add_special_tokens=bool(body.add_special_tokens),
                           template_kwargs=kwargs)

    def _check_model(self, model: str | None) -> None:
        # vLLM's rule: no model (or "") means the served one.
        if model and model != self._served_name:
            raise model_not_found(model)

