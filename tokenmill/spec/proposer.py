"""The drafter interface: after a step samples, propose each request's next draft tokens.

A proposer runs in the worker, after the target model's sampling, and its drafts travel back in
``ModelRunnerOutput.draft_token_ids``; the scheduler decides how many of them the next step verifies
(``core/spec_decode.py``). Token ids only cross this interface, so a proposer that runs a model
(``draft_model``, EAGLE heads) keeps whatever state it needs per request on its own side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.config import SpeculativeConfig


@dataclass
class DraftContext:
    """One request to draft for: its whole sequence as it stands after this step's tokens
    (``prompt + outputs``, read only) and the most drafts wanted."""

    request_id: str
    token_ids: list[int]
    max_drafts: int


class Proposer(Protocol):
    """Proposes draft tokens. Contract: ``propose`` returns, per request id it was given, at most
    ``max_drafts`` token ids (maybe none: an empty list or no entry); it never changes the contexts.
    ``drop`` forgets the given requests' state (they finished or were preempted)."""

    def propose(self, contexts: list[DraftContext]) -> dict[str, list[int]]: ...

    def drop(self, request_ids: list[str]) -> None: ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names, for the methods that need no model (``draft_model``
    runs a model: the worker builds it, ``worker/draft_model.py``)."""
    if config.method == "ngram":
        from tokenmill.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.draft_confidence)
    raise ValueError(f"speculative method {config.method!r} is not supported yet")
