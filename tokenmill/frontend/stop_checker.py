"""Stop strings over streamed text: find them across delta boundaries, never emit text past them.

The detokenizer hands out text in arbitrary pieces, so a stop string can begin in one delta and end
in a later one. The checker therefore holds back the shortest tail that could still grow into a stop
string and only releases text that no stop string can claim any more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StopCheckResult", "StopStringChecker"]


@dataclass(frozen=True, slots=True)
class StopCheckResult:
    """What `StopStringChecker.process()` decided about one delta.

    `text` is safe to send to the client now. `stop` is the stop string that matched, or None; once it
    is set the request must finish and `text` is the last text it produces.
    """

    text: str
    stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopStringChecker:
    """Streams text through a set of stop strings.

    Contract: fed the output text in pieces via `process()`, the concatenation of every returned `text`
    (plus `flush()` at the end of generation) is the output text cut at the first stop string: cut
    right before it, or right after it when `include_stop_str_in_output`. "First" means the match that
    ends earliest in the text (for matches ending at the same place, the one that starts earliest), so
    the result does not depend on how the text was split into deltas. At most `max(len(s)) - 1`
    characters are held back at any time. After a match every further input is ignored.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        # Every proper prefix of a stop string: a tail equal to one of them must be held back.
        self._prefixes: frozenset[str] = frozenset(s[:i] for s in self._stop for i in range(1, len(s)))
        self._max_held = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self._matched is not None

    @property
    def held_text(self) -> str:
        """Text received but not yet released because a stop string may still begin in it."""
        return self._held

    def process(self, delta: str) -> StopCheckResult:
        """Take the next piece of output text and return what may be emitted now.

        On a match, returns the text up to (or through) the stop string together with the matched
        string; the text after it, in this delta and any later one, is dropped.
        """
        if self._matched is not None:
            return StopCheckResult("", self._matched)
        if not self._stop:
            return StopCheckResult(delta)
        # A match cannot start in text already released (that text had no stop-string prefix as a
        # tail), so searching the held tail plus the new delta finds every match.
        buf = self._held + delta
        match = self._earliest_match(buf)
        if match is not None:
            start, stop = match
            self._matched = stop
            self._held = ""
            end = start + len(stop) if self._include_stop else start
            return StopCheckResult(buf[:end], stop)
        keep = self._held_tail_len(buf)
        self._held = buf[len(buf) - keep :]
        return StopCheckResult(buf[: len(buf) - keep])

    def flush(self) -> str:
        """Release the held-back tail at the end of generation (no stop string can complete now)."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = buf.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_tail_len(self, buf: str) -> int:
        # The longest tail that is a proper prefix of some stop string; nothing earlier can be part
        # of a future match.
        for length in range(min(len(buf), self._max_held), 0, -1):
            if buf[len(buf) - length :] in self._prefixes:
                return length
        return 0
