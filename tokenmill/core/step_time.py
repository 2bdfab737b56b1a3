"""A step-time model: how long a step of so many tokens and sequences takes on this machine.

The engine core times every step and feeds ``(num_tokens, num_seqs, seconds)`` to ``observe``; the
scheduler asks ``tokens_within`` how many tokens a step may hold and still be predicted to end
within a time (``core/tiers.py`` uses it to keep steps short while a tier has a TTFT target).

The model is linear: ``seconds ≈ a + b·tokens + c·seqs``. ``a`` is the fixed cost of a step
(scheduling, batch building, launching), ``b`` the cost of a token through the model, ``c`` the
extra cost of a sequence (its attention group, a sampled row through the LM head, Python
bookkeeping). It is fitted by exponentially weighted least squares over the recent steps (each
older step weighs ``decay`` times less), which tracks a machine whose speed drifts (other load,
longer contexts), and constrained to non-negative coefficients: of the fits over each subset of the
three terms whose coefficients all come out non-negative, the one with the smallest weighted error
wins (with three terms that is every non-negative least-squares candidate). When the data cannot
tell two terms apart (only decodes, where tokens equal sequences), the fit with the per-token term
is kept, which is the cautious one for bounding prefill chunks. Squared errors make one freak step
(a page-fault storm, a garbage-collector pause, another process taking the cores) weigh for a long
time, so once the model predicts, an observation is counted as at most ``outlier_factor`` times its
prediction: a machine that really slows down is still followed, by that factor per step at most.
That prediction comes from a fit refreshed every ``CLIP_REFIT_EVERY`` observations rather than
solved anew for each (seven small least-squares solves in Python, ~25 us, were a tenth of a
single-stream decode step's Python time); callers of ``coefficients`` / ``predict`` /
``tokens_within`` still get the fit of every observation so far.
A fit is trusted only near the steps it has seen: ``tokens_within`` never answers more than
``TRUST_FACTOR`` times the largest recent step. Ints and floats only, no torch.
"""

from __future__ import annotations

import math

# tokens_within answers at most this many times the largest recent step (in tokens).
TRUST_FACTOR = 2.0
# observe bounds an outlier with a fit at most this many observations old.
CLIP_REFIT_EVERY = 16
# Term subsets tried, in order of preference when fits are equally good (the per-token term first).
_SUBSETS: tuple[tuple[int, ...], ...] = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,))


class StepTimeModel:
    """``seconds ≈ a + b·tokens + c·seqs`` over recent steps; see the module docstring.

    Contract: ``observe`` records one executed step; ``coefficients`` is None until
    ``min_observations`` steps were seen, else ``(a, b, c)``, all >= 0; predictions are pure
    functions of what was observed (deterministic, no clock).
    """

    def __init__(self, decay: float = 0.98, min_observations: int = 5, outlier_factor: float = 4.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.min_observations = min_observations
        self.outlier_factor = outlier_factor
        self.num_observations = 0
        # Weighted sums of x·xᵀ, x·y and y² for x = (1, tokens, seqs), y = seconds.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._yy = 0.0
        self._fit: tuple[float, float, float] | None = None
        self._stale = False
        self._largest_recent_step = 0.0  # tokens, decayed per observation (see tokens_within)
        self._clip_fit: tuple[float, float, float] | None = None  # observe's fit (see the module docstring)
        self._clip_fit_at = 0  # num_observations when it was taken

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Record that a step of ``num_tokens`` tokens over ``num_seqs`` sequences took ``seconds``."""
        if num_tokens <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        predicted = self._clip_prediction(num_tokens, num_seqs)
        if predicted is not None and predicted > 0.0:
            seconds = min(seconds, self.outlier_factor * predicted)
        x = (1.0, float(num_tokens), float(num_seqs))
        for i in range(3):
            for j in range(3):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
        self._yy = self.decay * self._yy + seconds * seconds
        self._largest_recent_step = max(float(num_tokens), self.decay * self._largest_recent_step)
        self.num_observations += 1
        self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of the current fit, or None before ``min_observations`` steps."""
        if self.num_observations < self.min_observations:
            return None
        if self._stale:
            self._fit = self._solve()
            self._stale = False
        return self._fit

    def _clip_prediction(self, num_tokens: int, num_seqs: int) -> float | None:
        """The prediction an observation is bounded by: the fit of all observations up to at most
        ``CLIP_REFIT_EVERY`` ago (None before ``min_observations``)."""
        if self.num_observations < self.min_observations:
            return None
        if self._clip_fit_at == 0 or self.num_observations - self._clip_fit_at >= CLIP_REFIT_EVERY:
            self._clip_fit, self._clip_fit_at = self.coefficients, self.num_observations
        if self._clip_fit is None:
            return None
        a, b, c = self._clip_fit
        return a + b * num_tokens + c * num_seqs

    def predict(self, num_tokens: int, num_seqs: int) -> float | None:
        """Predicted seconds of a step of ``num_tokens`` tokens over ``num_seqs`` sequences (None: unknown)."""
        fit = self.coefficients
        if fit is None:
            return None
        a, b, c = fit
        return a + b * num_tokens + c * num_seqs

    def tokens_within(self, seconds: float, num_seqs: int) -> int | None:
        """The most tokens a step over ``num_seqs`` sequences may hold and be predicted to take at most
        ``seconds`` (0 when even an empty one would not). None before ``min_observations`` steps.

        The fit is trusted only near the steps it has seen: the answer is at most
        ``TRUST_FACTOR`` times the largest recent step (in tokens, decayed by ``decay`` per step).
        Steps kept short vary little in tokens, so the best fit over them may put (almost) every
        cost on the fixed and per-sequence terms; that does not mean tokens are free, and without
        this cap the next step could take a whole prompt (seen on a server: a 600-token step of
        270 ms among steps of 20 ms whenever the fit lost its per-token term). A larger step
        than the fit has seen is thus approached a factor at a time, each teaching the fit."""
        fit = self.coefficients
        if fit is None:
            return None
        a, b, c = fit
        trusted = math.floor(TRUST_FACTOR * self._largest_recent_step)
        if b <= 0.0:
            return trusted
        return max(0, min(trusted, math.floor((seconds - a - c * num_seqs) / b)))

    def _solve(self) -> tuple[float, float, float] | None:
        best: tuple[float, float, float] | None = None
        best_error = math.inf
        tolerance = 1e-9 * max(self._yy, 1e-30)
        for subset in _SUBSETS:
            theta = _solve_subset(self._xx, self._xy, subset)
            if theta is None or min(theta) < 0.0:
                continue
            coefficients = [0.0, 0.0, 0.0]
            for index, value in zip(subset, theta):
                coefficients[index] = value
            error = self._weighted_error(coefficients)
            if error < best_error - tolerance:
                best, best_error = (coefficients[0], coefficients[1], coefficients[2]), error
        return best

    def _weighted_error(self, theta: list[float]) -> float:
        """Σ w·(y − θ·x)², expanded over the stored sums: y² − 2θ·(xy) + θ·(xx)·θ."""
        cross = sum(theta[i] * self._xy[i] for i in range(3))
        quadratic = sum(theta[i] * self._xx[i][j] * theta[j] for i in range(3) for j in range(3))
        return self._yy - 2.0 * cross + quadratic


def _solve_subset(xx: list[list[float]], xy: list[float], subset: tuple[int, ...]) -> list[float] | None:
    """Least-squares coefficients of the terms in ``subset`` (the normal equations, Gaussian
    elimination with partial pivoting), or None when those terms cannot be told apart."""
    n = len(subset)
    rows = [[xx[i][j] for j in subset] + [xy[i]] for i in subset]
    scale = max(abs(rows[k][k]) for k in range(n))
    if scale <= 0.0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-9 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    theta = [0.0] * n
    for r in reversed(range(n)):
        theta[r] = (rows[r][n] - sum(rows[r][c] * theta[c] for c in range(r + 1, n))) / rows[r][r]
    return theta
