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

Until both sides of a class have ``min_samples`` steps, runs alternate between them, unless the
class can borrow a verdict or one side already wins clearly:

- Drafting pays less the larger the batch (a verifying step's extra rows cost more once the step is
  compute-bound; what a draft brings does not grow), so a class with no verdict of its own takes
  "plain" from the nearest smaller class with a verdict where plain steps won, or "drafted" from the
  nearest larger one where drafted steps won, and measures its other side only in its exploring
  runs: under a load that rises (a server filling up) the alternation is paid once, in the smallest
  class. The other way round a verdict carries only when its margin is at least ``decisive_margin``
  to the power of the classes between (a load that falls, 16 concurrent requests finishing one by
  one, after drafted steps at 16 yielded 0.6x what plain ones did).
- Once each side has one run's steps (``run_length - 1``), a side ahead by ``decisive_margin`` times
  decides (at 16 concurrent on SmolLM2 with an EAGLE head, drafted steps yield ~0.7x what plain
  ones do: a second alternation would only pay that loss again).
- An exploring run that leaves the class's own verdict standing by at least ``decisive_margin``
  doubles its exploring interval, up to ``max_explore_every``; any other resets it to
  ``explore_every``. The interval stays short because the side not taken keeps its old rate: after
  copy-heavy prompts (plain steps over long code prompts, n-gram drafts winning 1.4x) a chat
  workload's drafted rate is compared with the code's plain rate until an exploring run renews it
  (with a cap of 256 steps, single-stream chat after code fell from 1.04-1.11x to 0.98x).
- With ``batch_scaled_exploring`` (drafters that run a model: a draft model, an EAGLE head, an MTP
  layer) a class's interval is multiplied by its smallest batch size (16 for 16-31 sequences; one
  sequence explores as above). Such a drafter's exploring run starts by catching it up over every
  position it skipped, for every sequence of the batch, and its verifying steps carry the batch's
  extra rows: at 16 concurrent on SmolLM2 with an EAGLE head, exploring every 32-64 steps cost a
  tenth of the throughput (0.90x of speculation off, lowest 0.84x over three rounds) against
  0.96-1.03x with no re-measuring at all; a request then mostly ends before its class explores again,
  so the drafter never catches up over it. An n-gram lookup has no such cost and keeps the base
  intervals.

Ints and floats only, no torch, no clock: the caller passes each step's measured seconds.
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
    run_side: bool = False  # the side of the current run of decisions
    run_left: int = 0  # decisions left in it
    explore_every: int = 0  # decisions between exploring runs (0: the gate's base interval)
    since_explored: int = 0  # decisions since the last exploring run began
    explored_from: bool | None = None  # the verdict an exploring run set out from, until judged

    def measured(self, min_samples: int) -> bool:
        return self.drafted.count >= min_samples and self.plain.count >= min_samples

    def drafting_wins(self) -> bool:
        return self.drafted.tokens_per_second >= self.plain.tokens_per_second

    def margin(self) -> float:
        """The winning side's rate over the losing one's (inf when the loser yields nothing)."""
        high = max(self.drafted.tokens_per_second, self.plain.tokens_per_second)
        low = min(self.drafted.tokens_per_second, self.plain.tokens_per_second)
        return high / low if low > 0.0 else float("inf")


class DraftPayoff:
    """Measured payoff of drafting per batch-size class (see the module docstring).

    Contract: ``should_draft(num_seqs)`` once per planned step; ``observe`` once per executed
    decode-only step with the tokens it emitted (every entry's sampled token plus accepted drafts),
    whether it verified the step before's proposals, its measured seconds, and whether it proposed. Steps
    with prompt chunks are not observed (their time is mostly the prompt's).
    """

    def __init__(
        self,
        min_samples: int = 4,
        explore_every: int = 32,
        smoothing: float = 0.2,
        run_length: int = 3,
        decisive_margin: float = 1.3,
        max_explore_every: int = 64,
        batch_scaled_exploring: bool = False,
    ) -> None:
        if (
            min_samples < 1
            or explore_every < 2
            or not 0.0 < smoothing <= 1.0
            or not 2 <= run_length < explore_every
            or decisive_margin < 1.0
            or max_explore_every < explore_every
        ):
            raise ValueError(
                "min_samples >= 1, explore_every >= 2, smoothing in (0, 1], 2 <= run_length < explore_every, "
                "decisive_margin >= 1 and max_explore_every >= explore_every are required"
            )
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.run_length = run_length
        self.decisive_margin = decisive_margin
        self.max_explore_every = max_explore_every
        self.batch_scaled_exploring = batch_scaled_exploring
        self._classes: dict[int, _BatchClass] = {}

    def _class(self, num_seqs: int) -> _BatchClass:
        return self._classes.setdefault(num_seqs.bit_length(), _BatchClass())

    def should_draft(self, num_seqs: int) -> bool:
        """Whether a step over ``num_seqs`` decoding sequences should propose drafts (for the step
        after it to verify): the class's verdict (its own, or one borrowed), the other side for a run
        of ``run_length`` steps once per exploring interval; runs alternating between the sides while
        there is no verdict."""
        batch = self._class(num_seqs)
        batch.since_explored += 1
        if batch.run_left > 0:
            batch.run_left -= 1
            return batch.run_side
        verdict = self.verdict(num_seqs)
        if verdict is None:
            side = batch.drafted.count <= batch.plain.count
        else:
            interval = batch.explore_every or self.explore_every
            if batch.explored_from is not None:  # the exploring run's steps are measured by now
                own = self._own_verdict(batch)
                clear = (
                    own is not None and own == batch.explored_from and batch.margin() >= self.decisive_margin
                )
                interval = min(2 * interval, self.max_explore_every) if clear else self.explore_every
                batch.explore_every, batch.explored_from = interval, None
            if batch.since_explored < interval * self._explore_scale(num_seqs):
                return verdict
            batch.since_explored, batch.explored_from = 0, verdict
            side = not verdict
        batch.run_side, batch.run_left = side, self.run_length - 1
        return side

    def _explore_scale(self, num_seqs: int) -> int:
        """What a class's exploring interval is multiplied by: its smallest batch size with
        ``batch_scaled_exploring``, else 1."""
        return 1 << (num_seqs.bit_length() - 1) if self.batch_scaled_exploring else 1

    def verdict(self, num_seqs: int) -> bool | None:
        """Whether drafting wins for ``num_seqs`` sequences: the class's own measurement, else one
        borrowed from a neighbouring class (see the module docstring); None while unknown."""
        key = num_seqs.bit_length()
        own = self._own_verdict(self._class(num_seqs))
        if own is not None:
            return own
        # The nearest class on each side that has a verdict of its own.
        verdicts = {k: v for k, batch in self._classes.items() if (v := self._own_verdict(batch)) is not None}
        smaller = max((k for k in verdicts if k < key), default=None)
        larger = min((k for k in verdicts if k > key), default=None)
        if smaller is not None and not verdicts[smaller]:
            return False  # plain won with fewer sequences
        if larger is not None and verdicts[larger]:
            return True  # drafted won with more sequences
        # Against the grain, only a wide win reaches across: decisive_margin per class between.
        for k in (larger, smaller):
            if k is not None and self._classes[k].margin() >= self.decisive_margin ** abs(k - key):
                return verdicts[k]
        return None

    def _own_verdict(self, batch: _BatchClass) -> bool | None:
        if batch.measured(self.min_samples):
            return batch.drafting_wins()
        if batch.measured(self.run_length - 1) and batch.margin() >= self.decisive_margin:
            return batch.drafting_wins()
        return None

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
