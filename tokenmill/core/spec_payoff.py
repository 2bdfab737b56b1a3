"""Whether drafting pays on this machine, measured: tokens per second of decode steps with and
without drafts, per batch-size class.

The adaptive draft length (``core/spec_decode.py``) prices a draft with the step-time model's linear
fit, which cannot see what makes a verifying step dear on a CPU: small steps run the fused decode
stack and the int4 GEMV kernels, whose cost grows with every row, and a step past the stack's row
limit falls back to the layer modules; the drafter's own cost is in no term at all. So the scheduler
also keeps, for each class of decoding batch size (1, 2-3, 4-7, 8-15, ...: ``num_seqs.bit_length()``),
an exponentially weighted mean of the tokens per second that decode-only steps yielded with drafts
and without, and a class whose drafted steps yield fewer tokens per second than its plain ones
stops drafting. The loser is re-measured in a run of ``run_length`` steps once every
``explore_every`` steps of the class, so a change of load or of acceptance (copying starts after a
stretch of new text) is followed.

A step verifies the drafts the step before it proposed, and proposes (runs the drafter) for the step
after it: a step that verifies drafts but proposes none, or proposes without verifying any, carries
one side's cost with the other side's tokens. Such steps are not measured (``observe``'s
``proposed``), and the gate decides in runs of ``run_length`` steps, whose steps after the first are
consistent. (Measuring every step with alternating decisions charged the drafter's time to the plain
side and credited the drafted side without it: drafting won where it lost, 0.86-0.92x at 16
concurrent on SmolLM2 with an EAGLE head.)

Until both sides of a class have ``min_samples`` steps, runs alternate between them. Ints and floats
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
    run_side: bool = False  # the side of the current run of decisions
    run_left: int = 0  # decisions left in it


class DraftPayoff:
    """Measured payoff of drafting per batch-size class (see the module docstring).

    Contract: ``should_draft(num_seqs)`` once per planned step; ``observe`` once per executed
    decode-only step with the tokens it emitted (every entry's sampled token plus accepted drafts),
    whether it verified the step before's proposals, its measured seconds, and whether it proposed. Steps
    with prompt chunks are not observed (their time is mostly the prompt's).
    """

    def __init__(
        self, min_samples: int = 4, explore_every: int = 32, smoothing: float = 0.2, run_length: int = 3
    ) -> None:
        if (
            min_samples < 1
            or explore_every < 2
            or not 0.0 < smoothing <= 1.0
            or not 2 <= run_length < explore_every
        ):
            raise ValueError(
                "min_samples >= 1, explore_every >= 2, smoothing in (0, 1] and 2 <= run_length < explore_every "
                "are required"
            )
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.run_length = run_length
        self._classes: dict[int, _BatchClass] = {}

    def _class(self, num_seqs: int) -> _BatchClass:
        return self._classes.setdefault(num_seqs.bit_length(), _BatchClass())

    def should_draft(self, num_seqs: int) -> bool:
        """Whether a step over ``num_seqs`` decoding sequences should propose drafts (for the step
        after it to verify): the side that yields more tokens per second, the other one for a run of
        ``run_length`` steps every ``explore_every`` steps; runs alternating between the sides until
        both are measured."""
        batch = self._class(num_seqs)
        batch.steps += 1
        if batch.run_left > 0:
            batch.run_left -= 1
            return batch.run_side
        drafted, plain = batch.drafted, batch.plain
        if drafted.count < self.min_samples or plain.count < self.min_samples:
            side = drafted.count <= plain.count
        else:
            drafting_wins = drafted.tokens_per_second >= plain.tokens_per_second
            if batch.steps % self.explore_every != 0:
                return drafting_wins
            side = not drafting_wins
        batch.run_side, batch.run_left = side, self.run_length - 1
        return side

    def observe(self, num_seqs: int, num_emitted: int, drafted: bool, seconds: float, proposed: bool) -> None:
        """Record a decode-only step over ``num_seqs`` sequences that emitted ``num_emitted`` tokens
        in ``seconds`` (``drafted``: whether it verified the step before's proposals, drafts found or
        not; ``proposed``: whether it ran the drafter for the next step). A step with one and not the
        other is not recorded."""
        if num_seqs <= 0 or seconds <= 0.0 or proposed != drafted:
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
