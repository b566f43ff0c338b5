"""How a request's output continues from one leg to the next: the leg requests
(`prefill_request`, `decode_request`, `continuation_request`) and what the flow does to their
deltas so the client's stream is what one engine would have sent (token 1's held-back text,
the decode leg's stop strings, the replayed outputs a continuation drops).

`RequestFlow` (flow.py) runs the legs; everything here is pure: requests and deltas in,
requests and deltas out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.types import GenerateDelta, GenerateRequest, Leg, SamplingOptions


@dataclass(slots=True)
class Sent:
    """The output the client has: token ids and text, and whether it has the prompt's
    logprobs (a leg that continues the request then does not ask for them again)."""

    tokens: list[int] = field(default_factory=list)
    text_chars: int = 0
    prompt_logprobs: bool = False

    def add(self, delta: GenerateDelta) -> None:
        self.tokens.extend(delta.token_ids)
        self.text_chars += len(delta.text)
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs is not None


class Replayed:
    """Drops the outputs a leg replays (already the client's) from its deltas."""

    def __init__(self, leg_request: GenerateRequest, sent: Sent) -> None:
        replaying = bool(leg_request.replay_output_tokens)
        self._tokens = len(leg_request.replay_output_tokens)
        # Both engines' texts are prefixes of the one detokenization of the same tokens: the
        # client's text is as long as it is, whatever the engine it came from held back.
        self._chars = sent.text_chars if replaying else 0

    def new_part(self, delta: GenerateDelta) -> GenerateDelta | None:
        if not self._tokens and not self._chars:
            return delta
        drop_tokens = min(self._tokens, len(delta.token_ids))
        drop_chars = min(self._chars, len(delta.text))
        self._tokens -= drop_tokens
        self._chars -= drop_chars
        token_ids = delta.token_ids[drop_tokens:]
        text = delta.text[drop_chars:]
        if not token_ids and not text and not delta.finished:
            return None
        logprobs = None if delta.logprobs is None else delta.logprobs[drop_tokens:]
        return dataclasses.replace(delta, token_ids=token_ids, text=text, logprobs=logprobs)


class StopStrings:
    """The stop strings of a decode leg that continues after token 1, checked here exactly as
    vLLM's detokenizer checks them on one engine (`IncrementalDetokenizer.update`,
    `check_stop_strings`): the decode engine has token 1 as prompt, so it could not see a stop
    string that begins in token 1's text, and its own hold-back would blur which token
    completed a stop. The leg therefore runs without stop strings (its text arrives token by
    token, never held back), and this holds back the end a stop string may still claim (its
    longest but one character; nothing with `include_stop_str_in_output`), finds a stop once
    the output holds more than `min_tokens` tokens, cuts the text there and ends the request."""

    def __init__(self, first_text: str, first_sent: int, sampling: SamplingOptions) -> None:
        self._stop = sampling.stop
        self._include = sampling.include_stop_str_in_output
        self._min_tokens = sampling.min_tokens
        self._hold = 0 if self._include else max(len(s) for s in self._stop) - 1
        self._text = first_text  # the output's text: token 1's, then the leg's
        self._sent = first_sent  # how much of it the client has
        self._tokens = 1

    def feed(self, delta: GenerateDelta) -> GenerateDelta:
        """The delta as the client gets it: its text less what is held back, or cut at a stop
        (then finished with that stop as its reason)."""
        new_from = len(self._text)
        self._text += delta.text
        self._tokens += len(delta.token_ids)
        found = None
        if self._tokens > self._min_tokens:
            found = _find_stop(self._text, len(self._text) - new_from, self._stop, self._include)
        if found is not None:
            stop, cut = found
            self._text = self._text[:cut]
            delta = dataclasses.replace(delta, finish_reason="stop", stop_reason=stop)
        end = len(self._text) if delta.finished else max(self._sent, len(self._text) - self._hold)
        text, self._sent = self._text[self._sent:end], max(self._sent, end)
        return dataclasses.replace(delta, text=text)


def _find_stop(text: str, new_chars: int, stops: tuple[str, ...],
               include: bool) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: the stop string that completes earliest in the last
    `new_chars` characters of `text` (ties in list order), and where the text ends: before it,
    or after it with `include`."""
    best: tuple[str, int, int] | None = None  # (stop, start, end)
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at >= 0 and (best is None or at + len(stop) < best[2]):
            best = (stop, at, at + len(stop))
    if best is None:
        return None
    stop, at, end = best
    return stop, (end if include else at)


def merged(deltas: list[GenerateDelta]) -> GenerateDelta | None:
    """Consecutive deltas of one leg as one: the last's state, every token, text and logprob."""
    if not deltas:
        return None
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = (None if any(d.logprobs is None for d in deltas)
                else tuple(p for d in deltas for p in d.logprobs))
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return dataclasses.replace(
        last, text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids), logprobs=logprobs,
        prompt_logprobs=prompt)


def prefill_request(request: GenerateRequest) -> GenerateRequest:
    """The prefill leg: one token; keep the blocks for a decode leg if one will follow. It
    computes the whole prompt, so the prompt's logprobs (when asked) come from it."""
    sampling = dataclasses.replace(request.sampling, max_tokens=1,
                                   min_tokens=min(request.sampling.min_tokens, 1))
    decode_follows = request.sampling.max_tokens > 1
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-p", sampling=sampling, leg=Leg.PREFILL,
        kv_transfer_params={"do_remote_decode": True} if decode_follows else None,
    )


def decode_request(request: GenerateRequest, first: GenerateDelta) -> GenerateRequest:
    """The decode leg, under the client's request id (it runs on another engine than the
    prefill leg), with the prefill engine connector's transfer parameters (where the KV is).

    It continues after token 1 as prompt + token 1 with the rest of the budget: the prompt's KV
    comes from the prefill engine whole and the decode engine computes token 1's position, as
    a colocated engine's first decode step does, so greedy output is the same token for token.
    What counts output tokens is shifted by token 1: presence and frequency penalties still
    count it (`replay.py`'s `pdserve_prior`), `min_tokens` is one less, the stop strings are
    checked by the flow (`StopStrings`); the repetition penalty, `logit_bias`, stop token
    ids and the logprobs (raw, before any penalty) need nothing. A request whose sampling
    depends on its output history in a way the prompt cannot carry (a grammar, bad words, a
    seeded generator; `SamplingOptions.constrains_output_history`) replays token 1 instead, so
    that state is where a colocated engine's would be: the decode engine then computes the
    prompt's last position itself, numerically close to but not the same as the prefill
    engine's batched pass (as in vLLM's own disaggregated serving). The prompt's logprobs came
    with token 1."""
    params = {k: v for k, v in (first.kv_transfer_params or {}).items() if k != "do_remote_decode"}
    params["do_remote_prefill"] = True
    s = dataclasses.replace(request.sampling, prompt_logprobs=None)
    if s.constrains_output_history:
        continued = dataclasses.replace(request, sampling=s, replay_output_tokens=first.token_ids)
    else:
        n = len(first.token_ids)
        # The flow checks the stop strings (`StopStrings`): the engine could not see one that
        # begins in token 1.
        sampling = dataclasses.replace(s, max_tokens=s.max_tokens - n,
                                       min_tokens=max(0, s.min_tokens - n), stop=())
        continued = dataclasses.replace(
            request, prompt_token_ids=request.prompt_token_ids + first.token_ids,
            sampling=sampling, prior_output_tokens=n)
    return dataclasses.replace(continued, leg=Leg.DECODE, kv_transfer_params=params)


def continuation_request(request: GenerateRequest, sent: Sent, migration: int) -> GenerateRequest:
    """A migrated request: one `FULL` leg that prefills the client's prompt and replays the
    tokens the client has, one engine step each, as a colocated engine computed them, so the
    continuation is what one engine would have produced (penalties, seed, stop strings, and
    greedy output token for token). Its id is new (the engine it leaves may still know the old
    one)."""
    sampling = request.sampling
    if sent.prompt_logprobs:
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    return dataclasses.replace(request, request_id=f"{request.request_id}-m{migration}",
                               leg=Leg.FULL, sampling=sampling,
                               replay_output_tokens=tuple(sent.tokens))


def held_back(first: GenerateDelta, sampling: SamplingOptions) -> GenerateDelta:
    """Token 1's text less what a stop string completed by a later token would cut: the end
    that vLLM's detokenizer holds back while a stop string may still match (its longest stop
    string but one character; nothing with `include_stop_str_in_output`). If no stop string
    matches, the held text reaches the client after all: through `StopStrings`, or from the
    decode engine when it replays token 1; so the client's text is what one engine would have
    streamed."""
    if sampling.include_stop_str_in_output:
        return first
    hold = min(len(first.text), max((len(s) for s in sampling.stop), default=1) - 1)
    if hold <= 0:
        return first
    return dataclasses.replace(first, text=first.text[:len(first.text) - hold])


def first_for_client(request: GenerateRequest, first: GenerateDelta,
                      finished: bool) -> GenerateDelta:
    reason = (first.finish_reason or "length") if finished else None
    return dataclasses.replace(
        first, request_id=request.request_id, finish_reason=reason, kv_transfer_params=None,
        num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1,
    )
