"""Appending a step's sampled token, then the tokens the request's grammar forces (jump-forward).

Contract: every appended token goes through the request's grammar and its stop checks, in order;
appending ends at the first token that finishes the request. A token the grammar rejects (the
bitmask makes that unreachable) fails this request with ``error``, never the engine. Token ids only;
no torch.
"""

from __future__ import annotations

from tokenmill.core.request import Request
from tokenmill.protocol import FinishReason


def append_tokens(request: Request, sampled: int) -> tuple[list[int], bool]:
    """Append ``sampled``, then any tokens the grammar forces. Returns the appended tokens and
    whether the request finished; sets ``request.num_forced_since_sample``."""
    appended = [sampled]
    stopped = append_one(request, sampled)
    grammar = request.grammar
    while not stopped and grammar is not None and (forced := grammar.forced_token()) is not None:
        appended.append(forced)
        stopped = append_one(request, forced)
    request.num_forced_since_sample = len(appended) - 1
    return appended, stopped


def append_one(request: Request, token: int) -> bool:
    """Append ``token`` through the grammar and the stop checks; whether the request finished."""
    request.append_output_token(token)
    if request.grammar is not None and not request.grammar.accept(token):
        request.finish_reason = FinishReason.ERROR
        request.error = f"token {token} is not allowed by the request's grammar"
        return True
    return request.check_stop()
