"""Whether drafting pays on this machine, measured: tokens per second of decode steps with and
without drafts, per batch-size class.

The adaptive draft length (``core/spec_decode.py``) prices a draft with the step-time model's linear
fit, which cannot see what makes a verifying step dear on a CPU: small steps run the fused decode
stack and the int4 GEMV kernels, whose cost grows with every row, and a step past the stack's row
limit falls back to the layer modules; the drafter's own cost is in no term at all. So the scheduler
also keeps, for each class of decoding batch size (1, 2-3, 4-7, 8-15, ...: ``num_seqs.bit_length()``),
an exponentially weighted mean of the tokens per second that decode-only steps yielded with drafts
and without, and a class whose drafted steps yield fewer tokens per second than its plain ones
stops drafting. The loser is re-measured one step in every ``explore_every`` of the class, so a
change of load or of acceptance (copying starts after a stretch of new text) is followed.

Until both sides of a class have ``min_samples`` steps, steps alternate between them. Ints and floats
only, no torch, no clock: the caller passes each step's measured seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rate:
    """An exponentially weighted mean of tokens per second over ``count`` steps."""

    tokens_per_second: float = 0.0
    count: int = 0

    def add(self, value: float, smoothing: float) -> None:
        self.tokens_per_second = (
            value
            if self.count == 0
            else self.tokens_per_second + smoothing * (value - self.tokens_per_second)
        )
        self.count += 1


@dataclass
class _BatchClass:
    drafted: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    steps: int = 0  # decisions taken for this class


class DraftPayoff:
    """Measured payoff of drafting per batch-size class (see the module docstring).

    Contract: ``should_draft(num_seqs)`` once per planned step; ``observe`` once per executed
    decode-only step with the tokens it emitted (every entry's sampled token plus accepted drafts),
    whether any entry verified drafts, and its measured seconds. Steps with prompt chunks are not
    observed (their time is mostly the prompt's).
    """

    def __init__(self, min_samples: int = 4, explore_every: int = 32, smoothing: float = 0.2) -> None:
        if min_samples < 1 or explore_every < 2 or not 0.0 < smoothing <= 1.0:
            raise ValueError("min_samples >= 1, explore_every >= 2 and smoothing in (0, 1] are required")
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._classes: dict[int, _BatchClass] = {}

    def _class(self, num_seqs: int) -> _BatchClass:
        return self._classes.setdefault(num_seqs.bit_length(), _BatchClass())

    def should_draft(self, num_seqs: int) -> bool:
        """Whether a step over ``num_seqs`` decoding sequences should verify drafts: the side that
        yields more tokens per second, the other one every ``explore_every``-th step; alternating
        until both sides are measured."""
        batch = self._class(num_seqs)
        batch.steps += 1
        drafted, plain = batch.drafted, batch.plain
        if drafted.count < self.min_samples or plain.count < self.min_samples:
            return drafted.count <= plain.count
        drafting_wins = drafted.tokens_per_second >= plain.tokens_per_second
        explore = batch.steps % self.explore_every == 0
        return drafting_wins != explore

    def observe(self, num_seqs: int, num_emitted: int, drafted: bool, seconds: float) -> None:
        """Record a decode-only step over ``num_seqs`` sequences that emitted ``num_emitted`` tokens
        in ``seconds`` (``drafted``: whether it verified any draft)."""
        if num_seqs <= 0 or seconds <= 0.0:
            return
        batch = self._class(num_seqs)
        rate = batch.drafted if drafted else batch.plain
        rate.add(num_emitted / seconds, self.smoothing)

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per class (``num_seqs.bit_length()``) with both sides measured: (drafted, plain) tokens/s."""
        return {
            key: (batch.drafted.tokens_per_second, batch.plain.tokens_per_second)
            for key, batch in sorted(self._classes.items())
            if batch.drafted.count and batch.plain.count
        }
