"""Paired-timing statistics and the promotion rule: pure functions, no I/O, no clock.

Contract (docs/DESIGN.md §5, steps 4-5):

- **Design.** One experiment is ``n`` trials. A trial times the incumbent (A) and the candidate (B)
  once each, on the same requests, back to back; `abba_order` says who goes first in each trial
  (AB, BA, BA, AB, ...), so a linear drift within any four consecutive trials cancels.
- **Gain.** Per trial ``r = t_incumbent / t_candidate``; the gain is ``mean(log r)`` (natural log:
  a gain of 0.0488 is a 5% speedup, ``exp(gain)`` is the speedup factor). `paired_gain` gives its
  standard error and a one-sided 95% *lower* bound from a Student t-interval (and the one-sided 95%
  upper bound; together the two are a 90% two-sided interval).
- **Position** (the crossover analysis). Given the trials' order, `paired_gain` fits
  ``log r = gain + position * s`` with ``s = +1`` where the incumbent went first and ``-1`` where the
  candidate did (least squares, ``n - 2`` degrees of freedom): whatever running first costs a system
  (measured on this 2-core machine: 2% of a trial, which doubled the spread of ``log r``) then no
  longer counts as noise. ABBA orders are balanced and orthogonal to a linear drift, so the gain is
  still ``mean(log r)``; only its standard error shrinks. Without the order, or with fewer than 4
  trials or one order only, it is the plain paired t-interval. The noise of stock-versus-stock runs
  is computed the same way.
- **Noise.** ``noise`` is the standard deviation of the *gain estimate* of one experiment of this
  design when the candidate is the incumbent (stock versus stock), in log-gain units. It is
  measured per deployment and device by `noise_from_stock_runs` from one or more stock-versus-stock
  experiments: the larger of (a) the within-run estimate, the pooled per-trial SD of ``log r``
  over ``sqrt(n_trials)``, and (b) with two or more runs, the between-run estimate, the RMS of the
  runs' gains (their true value is 0, so this also catches drift between runs that (a) misses).
- **Promotion** (`decide`). All quantities are in log-gain units. Promote only if every rule passes:
    1. the estimate is sane (finite, ``n >= 2``);
    2. *ceiling*: the measured speedup ``exp(gain)`` does not exceed the physical ceiling (the most
       the candidate can gain over the incumbent, a factor, e.g. 1.8); beyond it the measurement is
       at fault, not the candidate (``ceiling <= 0`` means unknown: the rule is skipped);
    3. *forcing*: if the candidate's outputs differ from the incumbent's, a forcing verdict is
       required and must have passed (a failed verdict rejects even identical outputs); forcing that
       could not run (``forcing_error``) rejects under its own rule, naming the cause, not as a failure;
    4. *bar*: ``lower_bound > bar`` with ``bar = log(1.01) + 2 * noise``, raised to at least
       ``log(1.03)`` when outputs differ.
  `Decision` carries every statistic so the controller can put them all in a ``VerdictIssued``
  (`Decision.verdict_fields`).

- **Carry-over** (`carryover`, interleaved trials only). Within an interleaved trial request ``i``
  is answered by both systems back to back, in the trial's order for even ``i`` and reversed for
  odd ``i`` (`first_in_request`), so after request 0 (which both answer right after the other's
  warm-up) each system answers half its requests right after the other and half right after
  itself. A system that slows whatever runs after it (GPU work it queued before its reply that
  still runs while it is stopped, or caches it evicts) slows the other system's "after" requests
  and not its own. Least squares over every request's log time, with a term per system and
  request, one per trial, and one per system for "right after the other" (``c_A``, ``c_B``), gives
  ``(c_A - c_B) / 2``, the gain the carry-over fakes, with a one-sided t-test; the timing is
  ``suspect`` when ``p < CARRYOVER_P`` and the effect exceeds ``CARRYOVER_MIN``, and the
  controller then times the pair again run by run (a worker exits before the other starts, so
  nothing can carry over) rather than promote on it.
- **GPU confirmation** (`retime_reason`). Work a paused GPU worker queued keeps running, and
  separate processes' GPU contexts time-slice: a candidate that keeps the GPU busy *all the time*
  (a growing queue of spin kernels) slows every one of the incumbent's requests alike, which the
  carry-over test cannot see (seen on the H200: docs/FIGURES.md, "Lab notes moved from code").
  So an interleaved GPU timing that would promote is timed again run by run (each worker alone on
  the device). Run by run, every trial starts fresh processes, and on a GPU a process has its own
  level (one in six ran 1.3-1.5x slower on every request on 2026-12-05's H100), so a t-interval
  over a handful of such trials has little power. `confirms` therefore asks the confirmation only
  what it is for: is the candidate faster *alone* (the Hodges-Lehmann lower bound of its per-trial
  gains, from the exact Wilcoxon signed-rank distribution, above 0, and the estimate above the
  promotion bar: one slow process moves them little), and is its gain alone not clearly below the
  interleaved one (its upper bound at or above the interleaved lower bound: a candidate that only
  slows its neighbour fails here)? If both hold,
  the verdict rests on the interleaved timing and the deployment's noise; if not, on the
  confirmation alone, held to `confirmation_noise`.

What this module does not do: run trials, measure load, choose which runs count as noise runs,
or publish anything. It trusts that the noise given was measured for the same deployment, device
and number of trials as the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from scipy import stats as sps

# 32 trials (a multiple of 4, so the ABBA pattern is complete) promote a true 5% gain in >= 97% of
# simulated experiments with 2-5% per-request noise, outliers and drift, where 24 trials fall below
# 90% once outliers are a little more frequent (tests/controller/test_stats.py holds the model).
DEFAULT_TRIALS = 32
CONFIDENCE = 0.95  # one-sided
BASE_BAR = math.log(1.01)  # 1% in log-gain units
CHANGED_OUTPUTS_BAR = math.log(1.03)  # at least 3% when the candidate's outputs differ
NOISE_MULTIPLIER = 2.0

Verdict = Literal["promote", "reject"]
CARRYOVER_P = 0.001  # an honest candidate is timed again (run by run) for carry-over in ~0.1% of experiments
CARRYOVER_MIN = math.log(1.005)  # and only when it would fake more than 0.5%


def abba_order(n_trials: int) -> list[str]:
    """Who runs first in each trial: ``["AB", "BA", "BA", "AB", "AB", "BA", ...]`` (A = incumbent)."""
    if n_trials < 0:
        raise ValueError(f"n_trials must be >= 0, got {n_trials}")
    return ["AB" if i % 4 in (0, 3) else "BA" for i in range(n_trials)]


def first_in_request(order: str, i: int) -> str:
    """Who answers request ``i`` first in an interleaved trial whose order is ``order`` ("AB"/"BA")."""
    return order[i % 2]


@dataclass(frozen=True)
class Carryover:
    effect: float  # log units: the gain the candidate would fake by slowing what runs after it
    lower_bound: float  # one-sided lower bound at 1 - CARRYOVER_P
    p_value: float  # one-sided, H0: no more carry-over from the candidate than from the incumbent
    n_requests: int

    @property
    def suspect(self) -> bool:
        return self.p_value < CARRYOVER_P and self.effect > CARRYOVER_MIN


def carryover(trials: Sequence[tuple[str, Sequence[float], Sequence[float]]]) -> Carryover | None:
    """The carry-over test (module docstring) over interleaved trials ``[(order, incumbent request
    seconds, candidate request seconds), ...]``; None when the design cannot tell.

    Least squares on every request time: ``log t = system x request + trial + c_A after_A + c_B after_B``
    (``after``: answered right after the other system); the effect is ``(c_A - c_B) / 2`` with its
    t-test. The trial term absorbs a slow trial, the system x request term each request's length."""
    if len(trials) < 2:
        return None
    n_req = min(min(len(a), len(b)) for _, a, b in trials)
    n_tr = len(trials)
    rows, y = [], []
    n_cols = 2 * n_req + (n_tr - 1) + 2  # system x request, trials but the first, c_A, c_B
    for t, (order, a, b) in enumerate(trials):
        for i in range(n_req):
            first = first_in_request(order, i)
            for s_idx, (who, secs) in enumerate((("A", a), ("B", b))):
                x = np.zeros(n_cols)
                x[s_idx * n_req + i] = 1.0
                if t:
                    x[2 * n_req + t - 1] = 1.0
                x[n_cols - 2 + s_idx] = float(i == 0 or first != who)  # ran right after the other
                rows.append(x)
                y.append(math.log(secs[i]))
    X, Y = np.asarray(rows), np.asarray(y)
    dof = X.shape[0] - n_cols
    if n_req < 2 or dof < 2 or np.linalg.matrix_rank(X) < n_cols:
        return None  # some request never answered in both positions, or too few times
    beta, *_ = np.linalg.lstsq(X, Y, rcond=None)
    resid = Y - X @ beta
    sigma2 = float(resid @ resid) / dof
    contrast = np.zeros(n_cols)
    contrast[-2:] = (0.5, -0.5)
    effect = float(contrast @ beta)
    se = math.sqrt(max(0.0, sigma2 * float(contrast @ np.linalg.pinv(X.T @ X) @ contrast)))
    if se == 0.0:
        return Carryover(effect, effect, 0.0 if effect > 0 else 1.0, n_req)
    p = float(sps.t.sf(effect / se, dof))
    return Carryover(effect, effect - _t_quantile(1 - CARRYOVER_P, dof) * se, p, n_req)


def retime_reason(interleaved: bool, carry: Carryover | None, estimate: GainEstimate, noise: float,
                  gpu: bool) -> str:
    """Why a timing must be repeated run by run before a verdict ('' when it stands): a suspect
    carry-over, or (on a GPU) an interleaved timing that would clear the lowest promotion bar."""
    if not interleaved:
        return ""
    if carry is not None and carry.suspect:
        return f"carry-over {carry.effect:+.4f} (p {carry.p_value:.1e}) in the interleaved timing"
    if gpu and estimate.n >= 2 and estimate.lower_bound > promotion_bar(noise, outputs_identical=True):
        return "an interleaved GPU timing that would promote (confirmed with each worker alone on the device)"
    return ""


# Untimed work (a worker's start-up and warm-up) may grow with a patch, within bounds: loading a drafter
# or packing weights is legitimate; answering requests ahead of time is work moved out of the clock.
UNTIMED_FACTOR = 2.0
UNTIMED_SLACK_S = 30.0


def untimed_excess(incumbent_s: Sequence[float], candidate_s: Sequence[float]) -> str:
    """Why the candidate's untimed work is out of bounds ('' when it is not): its median over the
    timing's workers above ``UNTIMED_FACTOR`` x the incumbent's + ``UNTIMED_SLACK_S``."""
    if not incumbent_s or not candidate_s:
        return ""
    ours, theirs = float(np.median(candidate_s)), float(np.median(incumbent_s))
    limit = UNTIMED_FACTOR * theirs + UNTIMED_SLACK_S
    if ours <= limit:
        return ""
    return (f"start-up work: the candidate's workers took {ours:.1f} s before their first timed request against "
            f"the incumbent's {theirs:.1f} s (limit {limit:.1f} s); work done before the clock starts is not speed")


def signed_rank_bounds(log_r: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(Hodges-Lehmann estimate, one-sided lower bound, one-sided upper bound) of the per-trial gain:
    the median of the Walsh averages ``(x_i + x_j) / 2`` (i <= j), and the order statistics of those
    averages that invert the exact Wilcoxon signed-rank test at ``confidence``. Robust to one trial in
    a handful being far off. The bounds are infinite when too few trials can reach ``confidence``
    (fewer than 5 at 95%)."""
    x = np.sort(np.asarray(log_r, dtype=np.float64))
    n = x.size
    if n < 1 or not np.all(np.isfinite(x)):
        raise ValueError("signed-rank bounds need finite per-trial gains")
    walsh = np.sort((x[:, None] + x[None, :])[np.triu_indices(n)] / 2.0)
    c = _signed_rank_critical(n, 1.0 - confidence)
    if c < 0:
        return float(np.median(walsh)), -math.inf, math.inf
    return float(np.median(walsh)), float(walsh[c]), float(walsh[walsh.size - 1 - c])


@lru_cache(maxsize=256)
def _signed_rank_critical(n: int, alpha: float) -> int:
    """The largest ``k`` with P(W+ <= k) <= ``alpha`` under the null (W+: the signed-rank sum of ``n``
    trials, exact: each rank's sign a fair coin), or -1 when even P(W+ = 0) = 2^-n exceeds ``alpha``."""
    counts = np.zeros(n * (n + 1) // 2 + 1)
    counts[0] = 1.0
    for rank in range(1, n + 1):  # subsets of {1..n} by their sum
        counts[rank:] = counts[rank:] + counts[:-rank].copy()
    cdf = np.cumsum(counts) / 2.0 ** n
    return int(np.searchsorted(cdf, alpha, side="right")) - 1


def confirms(interleaved: GainEstimate, alone: GainEstimate, bar: float) -> tuple[bool, str]:
    """Whether a run-by-run confirmation upholds an interleaved GPU timing that would promote at
    ``bar`` (module docstring, "GPU confirmation"), and why, in words."""
    est, low, high = signed_rank_bounds(alone.per_trial_log_r, alone.confidence)
    said = f"alone {est:+.4f} (signed-rank bounds {low:+.4f} .. {high:+.4f}, {alone.n} trials)"
    if low <= 0.0 or est <= bar:
        return False, f"{said}: not clearly faster alone (bar {bar:.4f})"
    if high < interleaved.lower_bound:
        return False, (f"{said}: below the interleaved lower bound {interleaved.lower_bound:+.4f}, so part of "
                       "the interleaved gain came from slowing the other system")
    return True, f"{said}: faster alone and consistent with the interleaved timing"


def confirmation_noise(noise: float, estimate: GainEstimate) -> float:
    """The noise a run-by-run confirmation's verdict is held to: the deployment's noise was measured
    with interleaved trials (the quieter design), so never less than the confirmation's own
    standard error of the gain (run-by-run stock-versus-stock noise is not measured)."""
    return max(noise, estimate.std_err)


@lru_cache(maxsize=1024)
def _t_quantile(confidence: float, dof: int) -> float:
    return float(sps.t.ppf(confidence, dof))


@dataclass(frozen=True)
class GainEstimate:
    gain: float  # mean of log(t_incumbent / t_candidate); > 0: the candidate is faster
    lower_bound: float  # one-sided lower bound at `confidence`
    upper_bound: float  # one-sided upper bound at `confidence`
    std_err: float  # standard error of `gain`
    n: int  # trials
    per_trial_log_r: tuple[float, ...]
    confidence: float = CONFIDENCE
    position: float = 0.0  # what going first costs the incumbent over the candidate (log units; crossover fit)

    @property
    def speedup(self) -> float:
        """The candidate's measured speedup factor over the incumbent, exp(gain)."""
        return math.exp(self.gain)

    @property
    def per_trial_sd(self) -> float:
        return self.std_err * math.sqrt(self.n)


def log_ratios(incumbent_s: Sequence[float], candidate_s: Sequence[float]) -> np.ndarray:
    """``log(t_incumbent / t_candidate)`` per trial; refuses unpaired, non-positive or NaN times."""
    a = np.asarray(incumbent_s, dtype=np.float64)
    b = np.asarray(candidate_s, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired timings need two equal-length lists, got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))) or np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("trial times must be finite and > 0")
    return np.log(a) - np.log(b)


def position_signs(order: Sequence[str] | None, n: int) -> np.ndarray | None:
    """``+1`` for each trial the incumbent ran first ("AB..."), ``-1`` for the candidate's; None when
    the crossover fit cannot be made (no order, fewer than 4 trials, or only one order)."""
    if not order or len(order) != n or n < 4:
        return None
    signs = np.array([1.0 if str(o)[:1] == "A" else -1.0 for o in order])
    return signs if abs(signs.sum()) < n else None


def fit_run(lr: np.ndarray, signs: np.ndarray | None) -> tuple[float, float, np.ndarray, int, float]:
    """(gain, the variance factor of the gain, residuals, degrees of freedom, position) of one run's per-trial
    log ratios: the crossover fit with ``signs`` (`position_signs`), else the plain mean."""
    n = lr.size
    if signs is None:
        return float(lr.mean()), 1.0 / n, lr - lr.mean(), n - 1, 0.0
    x = np.column_stack([np.ones(n), signs])
    beta, *_ = np.linalg.lstsq(x, lr, rcond=None)
    return float(beta[0]), float(np.linalg.inv(x.T @ x)[0, 0]), lr - x @ beta, n - 2, float(beta[1])


def paired_gain(incumbent_s: Sequence[float], candidate_s: Sequence[float],
                confidence: float = CONFIDENCE, order: Sequence[str] | None = None) -> GainEstimate:
    """The gain of the candidate over the incumbent from paired trial times (seconds, same order);
    with ``order`` (the trials' "AB"/"BA"), the crossover fit (module docstring, "Position")."""
    lr = log_ratios(incumbent_s, candidate_s)
    n = lr.size
    if n < 2:
        raise ValueError(f"a paired gain needs at least 2 trials, got {n}")
    gain, factor, resid, dof, position = fit_run(lr, position_signs(order, n))
    se = math.sqrt(float(resid @ resid) / dof * factor)
    half = _t_quantile(confidence, dof) * se
    return GainEstimate(gain=gain, lower_bound=gain - half, upper_bound=gain + half, std_err=se, n=n,
                        per_trial_log_r=tuple(float(x) for x in lr), confidence=confidence, position=position)


@dataclass(frozen=True)
class NoiseEstimate:
    noise: float  # SD of one experiment's gain estimate when nothing changed (log-gain units)
    within: float  # pooled per-trial SD of log r / sqrt(n_trials)
    between: float  # RMS of the stock-vs-stock runs' gains (0.0 with fewer than 2 runs)
    per_trial_sd: float  # pooled SD of per-trial log r
    n_runs: int
    n_trials: int  # the experiment size the noise is stated for


def noise_from_stock_runs(runs: Sequence[tuple[Sequence[float], Sequence[float]]],
                          n_trials: int | None = None, orders: Sequence[Sequence[str] | None] | None = None,
                          ) -> NoiseEstimate:
    """Noise of the gain estimate, from stock-versus-stock runs ``[(incumbent_s, candidate_s), ...]``.

    ``n_trials`` is the size of the experiments the noise will be used for (default: the runs' own
    size, which must then be the same for every run). The between-run term assumes runs of that
    same design. ``orders`` (each run's trial orders, or None) fits each run as `paired_gain` does.
    """
    if not runs:
        raise ValueError("noise needs at least one stock-versus-stock run")
    lrs = [log_ratios(a, b) for a, b in runs]
    if any(lr.size < 2 for lr in lrs):
        raise ValueError("every stock-versus-stock run needs at least 2 trials")
    sizes = {lr.size for lr in lrs}
    if n_trials is None:
        if len(sizes) != 1:
            raise ValueError(f"runs have different trial counts {sorted(sizes)}: pass n_trials")
        n_trials = sizes.pop()
    if n_trials < 2:
        raise ValueError(f"n_trials must be >= 2, got {n_trials}")
    # Pooled variance: each run around its own fit (a run's offset is the between-run term's job).
    fits = [fit_run(lr, position_signs(order, lr.size))
            for lr, order in zip(lrs, orders if orders is not None else [None] * len(lrs), strict=True)]
    ss = sum(float(resid @ resid) for _, _, resid, _, _ in fits)
    dof = sum(d for _, _, _, d, _ in fits)
    per_trial_sd = math.sqrt(ss / dof)
    within = per_trial_sd / math.sqrt(n_trials)
    between = math.sqrt(float(np.mean([gain ** 2 for gain, *_ in fits]))) if len(lrs) >= 2 else 0.0
    return NoiseEstimate(noise=max(within, between), within=within, between=between,
                         per_trial_sd=per_trial_sd, n_runs=len(lrs), n_trials=n_trials)


def promotion_bar(noise: float, outputs_identical: bool) -> float:
    """The lower bound a gain must exceed (log-gain units)."""
    bar = BASE_BAR + NOISE_MULTIPLIER * noise
    return bar if outputs_identical else max(bar, CHANGED_OUTPUTS_BAR)


@dataclass(frozen=True)
class Decision:
    decision: Verdict
    rule: str  # "promoted" | "bad_estimate" | "ceiling" | "forcing_error" | "forcing_missing" | "forcing_failed" | "below_bar"
    reason: str
    gain: float
    lower_bound: float
    upper_bound: float
    std_err: float
    n_trials: int
    bar: float
    noise: float
    speedup: float
    ceiling: float
    outputs_identical: bool
    forcing_passed: bool | None

    @property
    def promoted(self) -> bool:
        return self.decision == "promote"

    def as_dict(self) -> dict:
        return asdict(self)

    def verdict_fields(self) -> dict:
        """The keyword arguments of ``schema.VerdictIssued`` this decision fills (all but patch_id etc.)."""
        return {"decision": self.decision, "reason": f"{self.rule}: {self.reason}", "gain": self.gain,
                "lower_bound": self.lower_bound, "upper_bound": self.upper_bound, "bar": self.bar,
                "noise": self.noise, "n_trials": self.n_trials, "outputs_identical": self.outputs_identical,
                "forcing_passed": self.forcing_passed, "ceiling": self.ceiling}


def decide(estimate: GainEstimate, noise: float | NoiseEstimate, outputs_identical: bool,
           forcing_passed: bool | None = None, ceiling: float = 0.0, forcing_error: str = "") -> Decision:
    """Promote or reject a candidate (rules in the module docstring, checked in that order).

    ``forcing_passed``: None when no forcing verdict exists. ``ceiling``: the largest physically
    possible speedup factor of the candidate over the incumbent; ``<= 0`` means unknown.
    """
    noise_value = noise.noise if isinstance(noise, NoiseEstimate) else float(noise)
    bar = promotion_bar(noise_value, outputs_identical)

    def out(decision: Verdict, rule: str, reason: str) -> Decision:
        return Decision(decision=decision, rule=rule, reason=reason, gain=estimate.gain,
                        lower_bound=estimate.lower_bound, upper_bound=estimate.upper_bound,
                        std_err=estimate.std_err, n_trials=estimate.n, bar=bar, noise=noise_value,
                        speedup=_safe_exp(estimate.gain), ceiling=ceiling,
                        outputs_identical=outputs_identical, forcing_passed=forcing_passed)

    numbers = (estimate.gain, estimate.lower_bound, estimate.upper_bound, noise_value)
    if estimate.n < 2 or not all(math.isfinite(x) for x in numbers) or noise_value < 0:
        return out("reject", "bad_estimate", f"unusable estimate (n={estimate.n}, gain={estimate.gain}, "
                                             f"noise={noise_value})")
    speedup = math.exp(estimate.gain)
    if ceiling > 0 and speedup > ceiling:
        return out("reject", "ceiling", f"measured speedup {speedup:.3f}x exceeds the physical ceiling "
                                        f"{ceiling:.3f}x: a measurement fault")
    if forcing_error:
        return out("reject", "forcing_error", f"forcing could not run, so nothing was proved: {forcing_error}")
    if forcing_passed is False:
        return out("reject", "forcing_failed", "the forcing verdict failed")
    if not outputs_identical and forcing_passed is None:
        return out("reject", "forcing_missing", "outputs differ from the incumbent's and no forcing verdict "
                                                "was given")
    if estimate.lower_bound <= bar:
        return out("reject", "below_bar", f"lower bound {estimate.lower_bound:+.4f} <= bar {bar:.4f} "
                                          f"(gain {estimate.gain:+.4f}, noise {noise_value:.4f})")
    return out("promote", "promoted", f"lower bound {estimate.lower_bound:+.4f} > bar {bar:.4f} "
                                      f"(speedup {speedup:.3f}x)")


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except (OverflowError, ValueError):
        return math.inf
