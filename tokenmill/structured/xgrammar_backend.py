"""The xgrammar implementation of the grammar backend.

Constraints are first turned into an ``xgrammar.Grammar`` without any tokenizer
(:func:`build_grammar`): that is cheap, catches every syntax error, and is what the frontend runs
to answer a bad schema with a 400. Compiling that grammar against the vocabulary (token masks for
every grammar state) is the slow part; the engine core runs it on worker threads.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import GrammarBackend, GrammarMatcher
from tokenmill.structured.schema_check import check_schema

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed-check
# preamble; the client only needs the sentence after them.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")

# Any JSON object, written compactly: the grammar then never lets a model pad with endless blanks.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _clean_error(exc: Exception) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = _LOG_PREFIX.sub("", message)
    return _CHECK_PREFIX.sub("", message)


def _json_schema_grammar(text: str) -> xgr.Grammar:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON schema: not valid JSON ({exc})") from None
    check_schema(schema)
    # Compact separators and no free whitespace: outputs are what json.dumps would write, and the
    # forced punctuation makes jump-forward effective. Strict mode forbids properties the schema
    # does not list, a subset of what the schema allows.
    return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)


# Characters that mean something in a regex; everything else stands for itself.
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")


def _choice_grammar(choices: list[str]) -> xgr.Grammar:
    if any(c == "" for c in choices):
        raise ValueError("choice must not contain an empty string")
    # A regex alternation rather than EBNF literals: xgrammar 0.2.9 mis-encodes non-ASCII characters in
    # EBNF string literals ("ça" matches other bytes), while its regex parser encodes them correctly.
    escaped = ("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices)
    return xgr.Grammar.from_regex("(" + "|".join(escaped) + ")")


def _ebnf_grammar(text: str) -> xgr.Grammar:
    if not text.isascii():
        raise ValueError(
            "grammar must be ASCII: non-ASCII characters in EBNF grammars are not enforced correctly by "
            "the grammar backend (use a regex or a JSON schema for non-ASCII text)"
        )
    return xgr.Grammar.from_ebnf(text)


def build_grammar(constraint: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar ``Grammar`` (no tokenizer needed).

    Raises ValueError naming the problem: invalid JSON, a schema keyword that cannot be enforced
    (see ``schema_check``), a regex or EBNF syntax error, an unsupported regex feature.
    """
    kind = constraint.kind
    what = {
        "json": "JSON schema",
        "json_object": "JSON object",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }[kind]
    try:
        if kind == "json":
            assert constraint.json is not None
            return _json_schema_grammar(constraint.json)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        if kind == "regex":
            assert constraint.regex is not None
            return xgr.Grammar.from_regex(constraint.regex)
        if kind == "choice":
            assert constraint.choice is not None
            return _choice_grammar(constraint.choice)
        assert constraint.grammar is not None
        return _ebnf_grammar(constraint.grammar)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar reports every parse error as a RuntimeError
        raise ValueError(f"invalid {what}: {_clean_error(exc)}") from None


class XGrammarMatcher(GrammarMatcher):
    """A thin wrapper over ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def forced_string(self) -> str:
        return self._matcher.find_jump_forward_string()


class XGrammarBackend(GrammarBackend):
    """Compiles with one ``xgrammar.GrammarCompiler`` built lazily from the tokenizer.

    ``vocab_size`` is the model's (the width of its logits), which may exceed the tokenizer's;
    tokens past the tokenizer's vocabulary are never allowed. Building the tokenizer info takes a
    fraction of a second, so it happens on the first compile (a worker thread), not at start-up.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, num_threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._no_control_bytes: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads)
                self._no_control_bytes = self._tokens_without_control_bytes(info)
            return self._compiler

    def _tokens_without_control_bytes(self, info: xgr.TokenizerInfo) -> torch.Tensor:
        mask = self.allocate_bitmask(1)[0]  # [words]
        for token_id, text in enumerate(info.decoded_vocab):
            if any(byte < 0x20 for byte in text):
                mask[token_id // 32] &= ~(1 << (token_id % 32))
        return mask

    def token_filter(self, constraint: StructuredOutputsParams) -> torch.Tensor | None:
        # xgrammar 0.2.9 writes the characters of a string with maxLength as [^"\\\r\n], which admits
        # raw control characters that JSON forbids. Our JSON grammars are compact (no newlines or tabs
        # between tokens), so no valid output has a byte below 0x20: filtering those tokens out removes
        # only invalid continuations.
        if constraint.kind not in ("json", "json_object"):
            return None
        self._get_compiler()
        return self._no_control_bytes

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        grammar = build_grammar(constraint)
        try:
            return self._get_compiler().compile_grammar(grammar)
        except Exception as exc:
            raise ValueError(
                f"could not compile the {constraint.kind} constraint: {_clean_error(exc)}"
            ) from None

    def make_matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids)))
