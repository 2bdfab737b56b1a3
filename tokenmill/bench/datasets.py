"""Benchmark workloads: lists of :class:`BenchRequest` built from words, ShareGPT, or shared prefixes.

Prompt lengths. The client has no copy of the server's tokenizer, so prompts are built from common
English words and measured with a ``TokenCounter`` (see ``token_count.py``): with the server's
``/tokenize`` the word count is searched until the prompt has exactly the asked number of tokens
(:func:`fit_words`); without it the tokenizer-free estimate is used and lengths are approximate.
Either way ``BenchRequest.prompt_len`` is what the counter said, and the benchmark prefers the
server's own ``usage.prompt_tokens`` whenever the server reports it.

Every builder is deterministic for a given seed and counter.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.sharegpt import iter_conversations, sharegpt_path
from tokenmill.bench.token_count import TokenCounter

# Common words that most BPE vocabularies hold as one token (with their leading space).
_COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great where "
    "help through much before line right too mean old any same tell boy follow came want show also "
    "around form three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should world"
)
WORDS = tuple(_COMMON_WORDS.split())

SHARED_PREFIX_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    ``system`` is a shared prefix (empty when none): completions send ``system + separator + prompt``
    as the prompt, chat sends it as a system message before the user message ``prompt``.
    ``prompt_len`` counts the tokens of both parts; ``output_len`` is the ``max_tokens`` to ask for.
    """

    prompt: str
    prompt_len: int
    output_len: int
    system: str = ""
    group: int = -1

    def completion_prompt(self) -> str:
        return self.system + SHARED_PREFIX_SEPARATOR + self.prompt if self.system else self.prompt

    def chat_messages(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return [*messages, {"role": "user", "content": self.prompt}]


def fit_words(next_word: Callable[[], str], target: int, count: TokenCounter) -> tuple[str, int]:
    """Join words from ``next_word`` into a text of ``target`` tokens as counted by ``count``.

    Returns ``(text, tokens)`` with ``tokens <= target``; ``tokens == target`` unless the tokenizer
    jumps over ``target`` at every word boundary tried. Assumes the token count of a growing word
    prefix never decreases. Uses few ``count`` calls: each guess scales by the tokens-per-word seen
    so far, and the bracket [lo, hi] of word counts shrinks every round.
    """
    if target <= 0:
        return "", 0
    words: list[str] = []

    def tokens_of(k: int) -> int:
        while len(words) < k:
            words.append(next_word())
        return count(" ".join(words[:k]))

    lo, lo_tokens = 0, 0  # the longest prefix known to fit
    hi: int | None = None  # the shortest prefix known to overflow
    k = target
    for _ in range(64):
        tokens = tokens_of(k)
        if tokens == target:
            return " ".join(words[:k]), tokens
        if tokens < target:
            lo, lo_tokens = k, tokens
        else:
            hi = k
        if hi is not None and hi - lo <= 1:
            break
        per_word = max(tokens / k, 1e-3)
        guess = lo + max(1, round((target - lo_tokens) / per_word))
        k = guess if hi is None else min(max(guess, lo + 1), hi - 1)
        if k > 16 * target + 64:  # a counter that never grows: give up with what fits
            break
    # Adding word lo+1 overshoots; try a few other final words, which may be one token shorter.
    for _ in range(8):
        candidate = " ".join([*words[:lo], next_word()])
        if count(candidate) == target:
            return candidate, target
    return " ".join(words[:lo]), lo_tokens


def _word_source(rng: random.Random) -> Callable[[], str]:
    return lambda: rng.choice(WORDS)


def _scaled(length: int, range_ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from ``length * [1 - r, 1 + r]`` (at least 1)."""
    if range_ratio <= 0:
        return length
    low = max(1, round(length * (1 - range_ratio)))
    return rng.randint(low, max(low, round(length * (1 + range_ratio))))


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    count: TokenCounter,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> list[BenchRequest]:
    """``num_prompts`` prompts of random words, ``input_len`` tokens each (``range_ratio`` spreads
    input and output lengths uniformly by that fraction either side). Prompts differ from their
    first word on, so a prefix cache cannot help."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        text, tokens = fit_words(_word_source(rng), _scaled(input_len, range_ratio, rng), count)
        out.append(BenchRequest(text, tokens, _scaled(output_len, range_ratio, rng)))
    return out


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    count: TokenCounter,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_groups * prompts_per_group`` requests: each group shares one ``prefix_len``-token system
    prefix, each request adds its own ``question_len``-token question. Requests are shuffled (seeded)
    so that groups interleave, as traffic from many users of a few system prompts would."""
    rng = random.Random(seed)
    out = []
    for group in range(num_groups):
        prefix, prefix_tokens = fit_words(_word_source(rng), prefix_len, count)
        for _ in range(prompts_per_group):
            question, question_tokens = fit_words(_word_source(rng), question_len, count)
            out.append(BenchRequest(question, prefix_tokens + question_tokens, output_len, prefix, group))
    rng.shuffle(out)
    return out


def sharegpt_requests(
    num_prompts: int,
    count: TokenCounter,
    seed: int = 0,
    output_len: int | None = None,
    path: str | None = None,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """``num_prompts`` first human turns from ShareGPT, in a seeded random order.

    The output length is ``output_len`` when given, else the token count of the first answer.
    Conversations whose prompt or answer has fewer than ``min_len`` tokens, whose prompt exceeds
    ``max_prompt_len``, or whose prompt plus output exceed ``max_total_len`` are skipped. The
    whole file is read (under a second for the packaged one) so the sample is drawn from all of it;
    only sampled conversations are counted, which matters when counting is a ``/tokenize`` call.
    Raises ``ValueError`` if too few qualify.
    """
    rng = random.Random(seed)
    pool = list(_first_turns(path or str(sharegpt_path())))
    rng.shuffle(pool)
    out: list[BenchRequest] = []
    for prompt, answer in pool:
        if len(out) == num_prompts:
            break
        prompt_len = count(prompt)
        out_len = output_len if output_len is not None else count(answer)
        if prompt_len < min_len or out_len < min_len or prompt_len > max_prompt_len:
            continue
        if prompt_len + out_len > max_total_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, out_len))
    if len(out) < num_prompts:
        raise ValueError(
            f"only {len(out)} ShareGPT conversations fit the length limits; asked for {num_prompts}"
        )
    return out


def _first_turns(path: str) -> Iterator[tuple[str, str]]:
    """(first human turn, the answer after it) of every conversation that has both."""
    for record in iter_conversations(path):
        turns = record.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        prompt, answer = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(answer, str) and prompt and answer:
            yield prompt, answer
