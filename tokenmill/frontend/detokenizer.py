"""Incremental detokenization: turn a growing list of output token ids into text deltas.

Decoding token by token is wrong for two reasons. Byte-level BPE and byte-fallback tokenizers can split
one UTF-8 character over several tokens, so a single token may decode to a replacement character
(U+FFFD) that becomes a real character once the next token arrives. And SentencePiece-style decoders
turn the leading "▁" of a token into a space except on the first token of the decoded text, so the
text of a token depends on what precedes it.

The technique here decodes a short window of tokens twice: the tokens whose text has already been
emitted ("prefix", starting at the last safe boundary) and the same tokens plus the new ones. The new
text is the second decode minus the first. The window slides forward each time the text ends on a
complete character, so each step costs O(window), not O(generated length). While the text ends
inside a character, the text before that character is still released: from the latest token boundary
where the decode is whole (byte fallback, where one incomplete character spoils its entire byte run),
or else from the lossy decode up to its trailing U+FFFDs (byte-level BPE, whose tokens can straddle
characters). Skipped special tokens are dropped on arrival; they never change the decoded text.

The streaming output is defined against `decode_tokens()`, the one-shot reference below: the
concatenation of every delta returned by `push()` and `finish()` equals
`decode_tokens(tokenizer, output_ids, ...)` whenever that text contains no U+FFFD (an invalid byte
sequence can be repaired or spoiled by later bytes, so streaming cannot promise equality there).
With `spaces_between_special_tokens=False` the reference is exactly
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.

Why not `tokenizers.decoders.DecodeStream`: it keeps holding back a stream that ends in an invalid
byte sequence forever (a model emitting lone UTF-8 lead bytes would stall the response), it has no
equivalent of `spaces_between_special_tokens`, and it only accepts Rust `tokenizers.Tokenizer`
objects, so the general path below is needed anyway. That path costs two short Rust decodes per step
(a few more while a character is split).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

__all__ = ["IncrementalDetokenizer", "decode_tokens"]

_REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 character is at most 4 bytes and every token carries at least one byte, so a character
# that is still incomplete after this many tokens with no new text is invalid and must be released
# rather than held back forever.
_MAX_HELD_TOKENS = 4

# Hard bound on the tokens kept past the last clean boundary. Reaching it needs a run of this many
# consecutive tokens that all end mid-character; it exists only so that no input can make one step
# cost O(generated length).
_MAX_PENDING_TOKENS = 32

# How many prompt tokens to decode in front of the output when continuing from the prompt; enough for
# the first output token's spacing to be decided by real context.
_PROMPT_CONTEXT_TOKENS = 6


class _Decoder:
    """Decodes a list of token ids exactly as `decode_tokens()` specifies, with precomputed id sets."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.added_ids: frozenset[int] = frozenset(added)
        self._added_content: dict[int, str] = {i: str(tok) for i, tok in added.items()}
        self._backend = _fast_backend(tokenizer)
        # Ids that the decode drops before its decoder runs, so removing them from a token list never
        # changes the text. A fast tokenizer drops the added tokens flagged special; the Python-side
        # decode drops `all_special_ids`.
        hidden: set[int] = set()
        if skip_special_tokens:
            if self._backend is not None:
                hidden = {i for i, tok in added.items() if getattr(tok, "special", False)}
            else:
                hidden = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.hidden_ids: frozenset[int] = frozenset(hidden)

    def decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._spaces_between_special_tokens and not self.added_ids.isdisjoint(ids):
            return self._decode_segments(ids)
        return self._decode_plain(ids)

    def _decode_plain(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip_special_tokens)
        return str(
            self._tokenizer.decode(
                list(ids), skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )

    def _decode_segments(self, ids: Sequence[int]) -> str:
        # Added tokens stand as their own segments, runs of ordinary tokens are decoded together, and
        # segments are joined by one space: the historical `spaces_between_special_tokens` behaviour
        # that fast tokenizers no longer implement.
        segments: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id not in self.added_ids:
                run.append(token_id)
                continue
            if token_id in self.hidden_ids:
                continue
            if run:
                segments.append(self._decode_plain(run))
                run = []
            segments.append(self._added_content[token_id])
        if run:
            segments.append(self._decode_plain(run))
        return " ".join(segments)


def _fast_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer behind `tokenizer`, if calling it directly is equivalent to `decode()`.

    Skips the Python wrapper (about 4x cheaper per call); only taken when the tokenizer class does not
    override the stock fast `_decode`, which is a plain Rust decode followed by optional cleanup.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode:
        return None
    return backend


def decode_tokens(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    *,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    """Decode `token_ids` in one shot: the reference that `IncrementalDetokenizer` streams towards.

    Never applies `clean_up_tokenization_spaces` (it rewrites text across token boundaries, so no
    streaming decoder can reproduce it). With `spaces_between_special_tokens`, every added token that
    is kept becomes its own segment and segments are joined by a single space; otherwise the result is
    `tokenizer.decode(token_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
    """
    return _Decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens).decode(token_ids)


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens as they are generated.

    Contract: `push()` returns only text that is final; the concatenation of all `push()` results and
    `finish()` equals `decode_tokens(tokenizer, output_ids, ...)` whenever that text has no U+FFFD, and
    no delta ever contains a U+FFFD produced by a character that later tokens complete. A character
    still incomplete after `_MAX_HELD_TOKENS` tokens without new text is treated as invalid and
    released as U+FFFD, so a broken byte stream delays output by a few tokens at most.

    `prompt_token_ids` is used only with `continue_from_prompt=True`: then the output is decoded as a
    continuation of the prompt's last tokens, so a SentencePiece model's first output token keeps its
    leading space and `prompt_text + output_text` reads like the decode of the whole sequence. By
    default the output is decoded on its own, which is what the reference decode of the output ids
    gives (and what byte-level BPE gives either way).

    Not thread-safe; one instance per request (and per choice when n > 1).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        *,
        continue_from_prompt: bool = False,
    ) -> None:
        self._decoder = _Decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        # Window of token ids starting at the prefix boundary; ids before it are never needed again.
        self._window: list[int] = []
        # Index in `_window` up to which text has been emitted in full (a clean boundary).
        self._read = 0
        # Decoded text of `_window[:_read]`; the new text is whatever a longer decode adds to it.
        self._prefix_text = ""
        # Characters of the not-yet-clean tail already emitted (text before a held partial character).
        self._emitted_past_read = 0
        # Visible tokens pushed since the held tail last produced new text.
        self._held_tokens = 0
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._num_output_tokens = 0
        if continue_from_prompt and prompt_token_ids:
            self._seed_with_prompt(list(prompt_token_ids))

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of every returned delta)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    @property
    def num_output_tokens(self) -> int:
        """How many output token ids have been pushed."""
        return self._num_output_tokens

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Append newly generated token ids and return the text they finalize (possibly "").

        Text is held back while the decoded window ends in U+FFFD, because the next token may complete
        the character; any complete text before that character is still returned right away.
        """
        self._num_output_tokens += len(new_token_ids)
        # Skipped special tokens never change the decoded text; dropping them keeps a long run of them
        # (a model repeating EOS under ignore_eos) from growing the window.
        hidden = self._decoder.hidden_ids
        visible = [t for t in new_token_ids if t not in hidden] if hidden else list(new_token_ids)
        if not visible:
            return ""
        self._window.extend(visible)
        end = len(self._window)
        full = self._decoder.decode(self._window)
        if not self._tail(full).endswith(_REPLACEMENT_CHAR) or end - self._read >= _MAX_PENDING_TOKENS:
            return self._advance_to(end, full)
        # The text ends inside a character the next token may complete. First look for a recent token
        # boundary where the text is whole: in a byte-fallback run one incomplete character turns the
        # entire run into U+FFFDs, so only such a boundary reveals the complete characters before it.
        for cut in range(end - 1, max(self._read, end - _MAX_HELD_TOKENS), -1):
            text = self._decoder.decode(self._window[:cut])
            if not self._tail(text).endswith(_REPLACEMENT_CHAR):
                return self._advance_to(cut, text)
        # No such boundary (byte-level BPE tokens can straddle characters): lossy decoding is stable up
        # to the trailing replacement characters, so whatever precedes them is final.
        tail = self._tail(full)
        stable_len = len(tail.rstrip(_REPLACEMENT_CHAR))
        if stable_len > self._emitted_past_read:
            delta = tail[self._emitted_past_read : stable_len]
            self._emitted_past_read = stable_len
            # New text means the held character is a fresh one, so its budget starts over; the newest
            # token is the only one sure to hold part of it.
            self._held_tokens = 1
            return self._record(delta)
        self._held_tokens += len(visible)
        if self._held_tokens < _MAX_HELD_TOKENS:
            return ""
        return self._advance_to(end, full)

    def finish(self) -> str:
        """Flush text held back at the end of generation, including an incomplete final character.

        Idempotent; after it, `text` is the complete output text.
        """
        if self._read == len(self._window):
            return ""
        return self._advance_to(len(self._window), self._decoder.decode(self._window))

    def _tail(self, window_text: str) -> str:
        # Normally a window decode starts with `_prefix_text`. When it does not (an incomplete
        # character turned a byte-fallback run into U+FFFDs), slicing by length still lines the
        # offsets up with the text emitted so far.
        return window_text[len(self._prefix_text) :]

    def _advance_to(self, cut: int, window_text: str) -> str:
        """Emit the text of `_window[:cut]` not yet emitted and make `cut` the new read boundary.

        `window_text` is the decode of `_window[:cut]`. The tokens between the old and the new read
        boundary become the new prefix; any tokens after `cut` stay pending.
        """
        delta = self._tail(window_text)[self._emitted_past_read :]
        new_prefix_text = self._decoder.decode(self._window[self._read : cut])
        # A prefix that decodes to nothing (a bare "▁" at the start) would let the next token be
        # decoded as if it began the text, dropping its leading space; keep the old prefix then.
        if new_prefix_text:
            del self._window[: self._read]
            cut -= self._read
            self._prefix_text = new_prefix_text
        else:
            self._prefix_text = window_text
        self._read = cut
        self._emitted_past_read = 0
        self._held_tokens = len(self._window) - cut
        return self._record(delta)

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta

    def _seed_with_prompt(self, prompt_token_ids: list[int]) -> None:
        hidden = self._decoder.hidden_ids
        prompt_token_ids = [t for t in prompt_token_ids if t not in hidden]
        start = max(0, len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS)
        # Do not start the context inside a multi-byte character: its orphaned continuation bytes
        # would decode differently once a byte-fallback run is extended.
        for _ in range(_MAX_HELD_TOKENS - 1):
            if start == 0 or not self._decoder.decode(prompt_token_ids[start:]).startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        self._window = prompt_token_ids[start:]
        self._read = len(self._window)
        self._prefix_text = self._decoder.decode(self._window)
