"""Log-probabilities in OpenAI's two formats: chat (``content[].top_logprobs``) and legacy completions
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

Input is the output processor's per-position dicts (token id → ``Logprob`` with rank and text), where
the chosen token is always present and the top-N alternatives carry ranks 1..N.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.outputs import Logprob, PositionLogprobDict
from tokenmill.server.openai_protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; forbidden tokens (logit_bias -100, min_tokens) report this floor instead.
LOGPROB_FLOOR = -9999.0


def logprob_value(logprob: Logprob) -> float:
    """The logprob as JSON can carry it (-inf becomes ``LOGPROB_FLOOR``)."""
    return max(logprob.logprob, LOGPROB_FLOOR)


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def top_candidates(position: PositionLogprobDict, num_top: int) -> list[tuple[int, Logprob]]:
    """The position's ``num_top`` most likely tokens, best first (the chosen token only if among them)."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return ranked[:num_top]


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobDict], num_top: int
) -> list[ChatTokenLogprob]:
    """One chat entry per generated token, each with its ``num_top`` most likely alternatives."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        text = _text(chosen)
        entries.append(
            ChatTokenLogprob(
                token=text,
                logprob=logprob_value(chosen),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=_text(lp), logprob=logprob_value(lp), bytes=list(_text(lp).encode()))
                    for _, lp in top_candidates(position, num_top)
                ],
            )
        )
    return entries


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobDict | None],
    num_top: int,
    text_offset: int,
    token_texts: Sequence[str] | None = None,
) -> CompletionLogprobs:
    """Legacy-completions logprobs for a run of tokens whose text starts at ``text_offset``.

    A None position (the first prompt token under ``echo``) has no logprob; ``token_texts`` gives
    the text of such tokens.
    """
    result = CompletionLogprobs()
    offset = text_offset
    for i, (token_id, position) in enumerate(zip(token_ids, positions)):
        if position is None:
            text = token_texts[i] if token_texts is not None else ""
            result.tokens.append(text)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            text = _text(chosen)
            result.tokens.append(text)
            result.token_logprobs.append(logprob_value(chosen))
            result.top_logprobs.append(
                {_text(lp): logprob_value(lp) for _, lp in top_candidates(position, num_top)}
            )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def extend_completion_logprobs(target: CompletionLogprobs, more: CompletionLogprobs) -> None:
    target.tokens.extend(more.tokens)
    target.token_logprobs.extend(more.token_logprobs)
    target.top_logprobs.extend(more.top_logprobs)
    target.text_offset.extend(more.text_offset)
