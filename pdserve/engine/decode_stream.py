"""A request's first output without decoding its whole prompt.

vLLM's fast incremental detokenizer (`FastIncrementalDetokenizer`, tokenizers >= 0.22) primes a
`tokenizers.decoders.DecodeStream` with the request's whole prompt, and the stream's first step
decodes all of it, twice: 0.7 ms for 2,048 tokens, 3.6 ms for 8,192 and 6.1 ms for 16,384 on
a 2-core CI host, spent between the engine's first token and its first output. On an H200 host
it made most of the 18 ms between vLLM's own time to first token and the engine actor's first
output for 16k-token prompts (benchmarks/results/gpu/2026-12-01-h200-x1-tax).

What the stream emits for a token depends on the tokens before it only through the end of
their decoded text: after its first step the stream itself keeps just the tokens since its
last emission as context. So priming it with the prompt's last `PRIME_TOKENS` tokens gives the
same text, unless those decode to nothing (say, a tail of skipped special tokens): the next
token would then begin the text, and a decoder that strips a leading space (SentencePiece's)
would strip its space. Such a prompt primes the stream whole, as vLLM does.

One deliberate difference: a prompt that ends inside a multi-byte character (a token-id prompt
cut anywhere, as benchmarks send) leaves a whole-primed stream without a prefix, and its first
step emits the entire prompt's text as output. Here the stream is primed up to that
character, and the output text is the character once an output token completes it, then the
output's own text.

vLLM looks `DecodeStream` up on the `tokenizers.decoders` module for each request so that a
backend may replace it; `install()` replaces it, in the engine actor's process (where the
AsyncLLM detokenizes), with `TailPrimed`, which wraps whatever class was there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PRIME_TOKENS = 64
_PARTIAL_TOKENS = 8  # at most this many trailing tokens of a character split across tokens


class TailPrimed:
    """`DecodeStream(ids=..., skip_special_tokens=...)` primed with the end of `ids`, for one
    tokenizer (the engine's: vLLM passes `tokenizer._tokenizer` to every step)."""

    def __init__(self, stream_class: Any, tokenizer: Any) -> None:
        self.stream_class = stream_class
        self.tokenizer = tokenizer

    def __call__(self, ids: Sequence[int] | None = None, skip_special_tokens: bool = False) -> Any:
        if ids is None or len(ids) <= PRIME_TOKENS:
            return self.stream_class(ids=ids, skip_special_tokens=skip_special_tokens)
        tail = list(ids[-PRIME_TOKENS:])
        # A prompt that ends inside a character (its last tokens are part of a multi-byte one)
        # primes the stream without them; they follow as steps, which emit nothing until an
        # output token completes the character.
        for cut in range(len(tail), len(tail) - _PARTIAL_TOKENS, -1):
            text = self.tokenizer.decode(tail[:cut], skip_special_tokens=skip_special_tokens)
            if not text.endswith("\ufffd"):
                break
        else:
            text = ""
        if not text:
            return self.stream_class(ids=ids, skip_special_tokens=skip_special_tokens)
        stream = self.stream_class(ids=tail[:cut], skip_special_tokens=skip_special_tokens)
        for token in tail[cut:]:
            stream.step(self.tokenizer, token)
        return stream


def install(tokenizer: Any) -> bool:
    """Prime every DecodeStream made in this process from now on with its prompt's tail, for
    `tokenizer` (a `tokenizers.Tokenizer`). False if there is nothing to do: tokenizers
    without DecodeStream priming (vLLM then detokenizes another way), or already installed."""
    from tokenizers import decoders

    current = getattr(decoders, "DecodeStream", None)
    if current is None or isinstance(current, TailPrimed):
        return False
    decoders.DecodeStream = TailPrimed(current, tokenizer)
    return True
