"""The engine's detokenizer primed with the prompt's tail (pdserve/engine/decode_stream.py) emits
what vLLM's, primed with the whole prompt, emits: token by token, for real tokenizers and
prompts with multi-byte characters, special tokens and leading-space-stripping decoders."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.engine import decode_stream
from pdserve.engine.decode_stream import PRIME_TOKENS, TailPrimed

pytestmark = pytest.mark.unit

TEXT = ("Once upon a time, naïve café owners in Zürich sold crème brûlée; 東京の夜は静かだった. "
        "Ein Fluß, ein Floß — 🙂🚀 emoji, numbers 12345, code `x = f(y)`.\n")


@pytest.fixture(scope="module")
def smollm(embedded_checkpoint) -> Tokenizer:
    """The embedded model's byte-level BPE (GPT-2 style, as Llama 3's)."""
    return Tokenizer.from_file(str(embedded_checkpoint / "tokenizer.json"))


def metaspace() -> Tokenizer:
    """A SentencePiece-style tokenizer: '▁' marks spaces, decoding strips the text's leading one."""
    pieces = ["<s>", "</s>", "▁hello", "▁world", "▁the", "▁a", "lo", "▁"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="▁"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def emitted(stream_factory, tokenizer: Tokenizer, prompt: list[int], outputs: list[int],
            skip: bool) -> list[str | None]:
    stream = stream_factory(ids=list(prompt), skip_special_tokens=skip)
    return [stream.step(tokenizer, token) for token in outputs]


def assert_same(tokenizer: Tokenizer, prompt: list[int], outputs: list[int], skip: bool = True) -> None:
    primed = TailPrimed(decoders.DecodeStream, tokenizer)
    assert emitted(primed, tokenizer, prompt, outputs, skip) == \
        emitted(decoders.DecodeStream, tokenizer, prompt, outputs, skip)


def ends_inside_a_character(tokenizer: Tokenizer, prompt: list[int]) -> bool:
    return tokenizer.decode(prompt, skip_special_tokens=False).endswith("\ufffd")


def test_a_long_prompts_tail_gives_the_text_its_whole_gives(smollm):
    rng = random.Random(0)
    text_ids = smollm.encode(TEXT * 40).ids
    vocab = smollm.get_vocab_size()
    checked = 0
    for _ in range(100):
        cut = rng.randrange(PRIME_TOKENS + 1, 600)
        for prompt in (text_ids[:cut], [rng.randrange(vocab) for _ in range(cut)]):
            if ends_inside_a_character(smollm, prompt):
                continue  # vLLM's whole-primed stream emits the prompt then (next test)
            checked += 1
            assert_same(smollm, prompt, text_ids[cut:cut + rng.randrange(1, 40)])
            assert_same(smollm, prompt, [rng.randrange(vocab) for _ in range(20)], skip=False)
    assert checked > 150


def test_a_prompt_that_ends_inside_a_character_gets_only_its_outputs_text(smollm):
    """vLLM's whole-primed stream then emits the whole prompt's text as output; the tail-primed
    one emits the character the outputs complete, then their text."""
    text_ids = smollm.encode(TEXT * 4).ids
    cuts = [cut for cut in range(PRIME_TOKENS + 1, len(text_ids) - 30)
            if ends_inside_a_character(smollm, text_ids[:cut])]
    assert len(cuts) > 10  # the Japanese, the emoji: characters of several byte tokens
    primed = TailPrimed(decoders.DecodeStream, smollm)
    for cut in cuts:
        prompt, outputs = text_ids[:cut], text_ids[cut:cut + 30]
        whole = emitted(decoders.DecodeStream, smollm, prompt, outputs, True)
        assert "".join(filter(None, whole)).startswith(smollm.decode(prompt[:10]))  # vLLM's
        text = "".join(filter(None, emitted(primed, smollm, prompt, outputs, True)))
        clean = next(k for k in range(cut - 1, 0, -1) if not ends_inside_a_character(smollm, prompt[:k]))
        expected = smollm.decode(prompt + outputs)[len(smollm.decode(prompt[:clean])):]
        assert text == expected.rstrip("\ufffd")  # a character the outputs leave open is held


def test_a_prompt_ending_in_special_tokens_still_gives_vllms_text(smollm):
    text_ids = smollm.encode(TEXT * 4).ids
    special = smollm.token_to_id("<|im_end|>")
    outputs = smollm.encode(" and then", add_special_tokens=False).ids
    for tail in (3, PRIME_TOKENS - 1, PRIME_TOKENS + 5):
        for skip in (True, False):
            assert_same(smollm, text_ids + [special] * tail, outputs, skip)


def test_a_tail_that_decodes_to_nothing_primes_the_stream_whole():
    """A decoder that strips the text's leading space would drop the first output's space if
    the stream were primed with skipped special tokens alone: such a prompt is primed whole."""
    tok = metaspace()
    words = tok.encode("hello world the a hello").ids
    bos = tok.token_to_id("<s>")
    prompt, outputs = words + [bos] * (PRIME_TOKENS + 3), tok.encode("hello world").ids
    naive = decoders.DecodeStream(ids=prompt[-PRIME_TOKENS:], skip_special_tokens=True)
    whole = emitted(decoders.DecodeStream, tok, prompt, outputs, True)
    assert [naive.step(tok, t) for t in outputs] != whole  # the case this guards against
    assert_same(tok, prompt, outputs)
    assert_same(tok, words * 30, outputs)


def test_install_wraps_the_modules_stream_class_once(smollm, monkeypatch):
    monkeypatch.setattr(decoders, "DecodeStream", decoders.DecodeStream)  # restored afterwards
    original = decoders.DecodeStream
    assert decode_stream.install(smollm)
    assert isinstance(decoders.DecodeStream, TailPrimed) and decoders.DecodeStream.stream_class is original
    assert not decode_stream.install(smollm)
    prompt = smollm.encode(TEXT * 10).ids
    assert emitted(decoders.DecodeStream, smollm, prompt, prompt[:30], True) == \
        emitted(original, smollm, prompt, prompt[:30], True)
