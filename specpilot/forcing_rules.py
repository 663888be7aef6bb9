"""Token forcing's rules: pure functions on counts and margins. No model, no I/O.

Vocabulary (docs/DESIGN.md §6). A system's outputs are replayed through the stock target with an FP32 LM
head (``forcing.py``). At each output position:
- a *mismatch*: the system's token is not the FP32 argmax; its *margin* is
  ``logit[argmax] - logit[system token]`` (>= 0, in logits);
- ``δ`` (delta), the near-tie threshold, is calibrated on **stock's own** forced run
  (`calibrate_delta`): the ``DELTA_QUANTILE`` quantile of the margins of stock's own mismatches
  (the gaps stock's own numerics flip), never below ``DELTA_FLOOR``. With no stock mismatches
  (fp32 on CPU usually has none) δ is the floor.
- an *event*: a mismatch with margin > 2δ; it is *explained* when the stock engine itself, run on
  that exact prefix with its real dtype and kernels, emits the system's token. Events are audited
  (explanations checked) up to ``MAX_AUDITED`` per run, a seeded uniform sample beyond that; the
  number of unexplained events is then estimated as ``events x unexplained/audited``.

Rules (the system passes only if both pass):
- **Rate rule** (`rate_rule`): reject if the system's mismatch rate exceeds stock's by more than
  ``RATE_MARGIN`` (0.5 points) at 95% confidence: a one-sided score test (Farrington-Manning) of
  ``H0: p_system - p_stock <= 0.005``; reject when its p-value < 0.05, equivalently when the
  one-sided 95% lower confidence bound of the difference (the inverted test) exceeds 0.005.
- **Event rule** (`event_rule`): reject if unexplained events are more frequent per position than
  stock's: the exact conditional test of two Poisson rates, ``binomtest(u_sys, u_sys + u_stock,
  n_sys / (n_sys + n_stock), alternative="greater")``; reject when p < 0.05. With no unexplained
  events on either side it passes (p = 1).

What this module does not do: run a model, choose which events to audit, or talk to NATS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import optimize, stats

from specpilot import schema

RATE_MARGIN = 0.005  # 0.5 percentage points
CONFIDENCE = 0.95  # one-sided, rate rule
EVENT_ALPHA = 0.05  # event rule
DELTA_QUANTILE = 0.95  # of stock's own mismatch margins
# δ never goes below this (logits). Stock in fp32 on CPU flips no token at all between decoding and
# teacher forcing, so without a floor δ would be 0 and every near-exact tie an event. 0.05 is about
# the median shift bf16 rounding gives SmolLM2's top-2 gaps (measured: 0.035 median, 0.13 at the
# 90th and 0.24 at the 99th percentile), so a stock that runs in bf16 calibrates δ above the floor
# from its own mismatches.
DELTA_FLOOR = 0.05
EVENT_FACTOR = 2.0  # an event is a mismatch with margin > EVENT_FACTOR * delta
MAX_AUDITED = 200  # events whose explanation is checked per run (and reported)
# Power: every verdict reports the probability that its rate rule would have rejected a system 1 point
# worse than stock (`rate_power`); the controller forces at least `tokens_for_power` positions, so a
# passing verdict had >= 90% power to catch such a system.
POWER_EXCESS = 0.01
POWER_TARGET = 0.9


# --- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One request's output: the prompt's token ids and the tokens the system emitted after it."""

    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    stock_tokens: tuple[int, ...] | None = None  # stock's own output for this prompt, when known


def parse_outputs(raw: Sequence[dict[str, Any]], encode: Callable[[str, bool], list[int]] | None = None,
                  vocab_size: int | None = None) -> list[Output]:
    """Outputs from dicts: ``{"prompt_ids": [...], "tokens": [...]}`` (optionally ``"stock_tokens"``),
    or text ``{"prompt": str, "output": str, "chat": bool}`` tokenized with ``encode(text, chat)``
    (the output on its own, never in the chat template). Raises ValueError naming the bad entry."""
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise ValueError(f"output {i}: expected an object, got {type(r).__name__}")
        if "prompt_ids" in r:
            prompt, tokens = r["prompt_ids"], r.get("tokens", [])
        elif "prompt" in r:
            if encode is None:
                raise ValueError(f"output {i}: text outputs need a tokenizer")
            prompt = encode(str(r["prompt"]), bool(r.get("chat", False)))
            tokens = encode(str(r.get("output", "")), False)
        else:
            raise ValueError(f"output {i}: needs prompt_ids+tokens or prompt+output, got keys {sorted(r)}")
        stock = r.get("stock_tokens")
        ids = [prompt, tokens] + ([stock] if stock is not None else [])
        for name, seq in zip(("prompt_ids", "tokens", "stock_tokens"), ids, strict=False):
            if not isinstance(seq, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in seq):
                raise ValueError(f"output {i}: {name} must be a list of integers")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in seq):
                raise ValueError(f"output {i}: {name} has token ids outside [0, {vocab_size})")
        if not prompt:
            raise ValueError(f"output {i}: the prompt is empty")
        out.append(Output(tuple(prompt), tuple(tokens), tuple(stock) if stock is not None else None))
    return out


# --- delta ------------------------------------------------------------------------------------


def calibrate_delta(stock_mismatch_margins: Sequence[float], quantile: float = DELTA_QUANTILE,
                    floor: float = DELTA_FLOOR) -> float:
    """Near-tie threshold δ from the margins of stock's own mismatches (see the module docstring)."""
    m = np.asarray(stock_mismatch_margins, dtype=np.float64)
    m = m[np.isfinite(m)]
    if m.size == 0:
        return float(floor)
    return float(max(floor, np.quantile(m, quantile, method="higher")))


def is_event(margin: float, delta: float) -> bool:
    return margin > EVENT_FACTOR * delta


# --- counts and rules -------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """What one forced run (the system's or stock's) adds up to."""

    positions: int
    mismatches: int
    events: int = 0
    audited: int = 0
    unexplained_audited: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.mismatches <= self.positions:
            raise ValueError(f"mismatches ({self.mismatches}) must be in [0, positions={self.positions}]")
        if not 0 <= self.events <= self.mismatches:
            raise ValueError(f"events ({self.events}) must be in [0, mismatches={self.mismatches}]")
        if not 0 <= self.unexplained_audited <= self.audited <= self.events:
            raise ValueError("need 0 <= unexplained_audited <= audited <= events")

    @property
    def rate(self) -> float:
        return self.mismatches / self.positions if self.positions else 0.0

    @property
    def unexplained(self) -> int:
        """Unexplained events, extrapolated from the audited sample (all of them when none was audited)."""
        if self.audited == self.events:
            return self.unexplained_audited
        if self.audited == 0:
            return self.events
        return round(self.events * self.unexplained_audited / self.audited)


def _neg_loglik(p1: float, p0: float, x1: int, n1: int, x0: int, n0: int) -> float:
    def ll(x: int, n: int, p: float) -> float:
        p = min(max(p, 1e-15), 1 - 1e-15)
        return x * math.log(p) + (n - x) * math.log1p(-p)

    return -(ll(x1, n1, p1) + ll(x0, n0, p0))


def _restricted_mle(x1: int, n1: int, x0: int, n0: int, d0: float) -> tuple[float, float]:
    """(p1, p0) maximising the likelihood under p1 - p0 = d0: Farrington-Manning's closed form
    (the root of a cubic), falling back to a bounded 1-D search where the formula degenerates."""
    q1, q0, theta = x1 / n1, x0 / n0, n0 / n1
    a = 1 + theta
    b = -(1 + theta + q1 + theta * q0 + d0 * (theta + 2))
    c = d0 * d0 + d0 * (2 * q1 + theta + 1) + q1 + theta * q0
    d = -q1 * d0 * (1 + d0)
    v = b**3 / (27 * a**3) - b * c / (6 * a * a) + d / (2 * a)
    u2 = b * b / (9 * a * a) - c / (3 * a)
    if u2 > 1e-18:
        u = math.copysign(math.sqrt(u2), v) if v != 0 else math.sqrt(u2)
        w = (math.pi + math.acos(min(1.0, max(-1.0, v / u**3)))) / 3
        p1 = 2 * u * math.cos(w) - b / (3 * a)
        p0 = p1 - d0
        if -1e-12 <= p0 <= 1 + 1e-12 and -1e-12 <= p1 <= 1 + 1e-12:
            return min(max(p1, 0.0), 1.0), min(max(p0, 0.0), 1.0)
    lo, hi = max(0.0, -d0), min(1.0, 1.0 - d0)  # range of p0 with p1 = p0 + d0 in [0, 1]
    if hi - lo < 1e-15:
        return lo + d0, lo
    res = optimize.minimize_scalar(lambda p: _neg_loglik(p + d0, p, x1, n1, x0, n0), bounds=(lo, hi),
                                   method="bounded", options={"xatol": 1e-12})
    return float(res.x) + d0, float(res.x)


def _score_z(x1: int, n1: int, x0: int, n0: int, d0: float) -> float:
    """Farrington-Manning score statistic for H0: p1 - p0 = d0."""
    diff = x1 / n1 - x0 / n0
    p1, p0 = _restricted_mle(x1, n1, x0, n0, d0)
    var = p1 * (1 - p1) / n1 + p0 * (1 - p0) / n0
    if var <= 0:
        return 0.0 if diff == d0 else math.copysign(math.inf, diff - d0)
    return (diff - d0) / math.sqrt(var)


@dataclass(frozen=True)
class RateResult:
    passed: bool
    system_rate: float
    stock_rate: float
    difference: float  # system - stock
    lower_bound: float  # one-sided CONFIDENCE lower bound of the difference
    p_value: float  # of H0: difference <= RATE_MARGIN
    margin: float = RATE_MARGIN
    system_ci: tuple[float, float] = (0.0, 1.0)  # two-sided 95% Wilson interval of each rate
    stock_ci: tuple[float, float] = (0.0, 1.0)


def _wilson(x: int, n: int) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    ci = stats.binomtest(x, n).proportion_ci(0.95, method="wilson")
    return (float(ci.low), float(ci.high))


def rate_rule(system: Counts, stock: Counts, margin: float = RATE_MARGIN,
              confidence: float = CONFIDENCE) -> RateResult:
    """Reject when the system's mismatch rate exceeds stock's by more than ``margin`` (module docstring)."""
    x1, n1, x0, n0 = system.mismatches, system.positions, stock.mismatches, stock.positions
    if n1 == 0 or n0 == 0:  # nothing to compare: no evidence of excess
        return RateResult(True, system.rate, stock.rate, system.rate - stock.rate, -1.0, 1.0, margin,
                          _wilson(x1, n1), _wilson(x0, n0))
    diff = x1 / n1 - x0 / n0
    p = float(stats.norm.sf(_score_z(x1, n1, x0, n0, margin)))
    zq = float(stats.norm.ppf(confidence))
    # Lower bound: the d0 at which the one-sided test is exactly significant (z decreases with d0).
    f = lambda d0: _score_z(x1, n1, x0, n0, d0) - zq  # noqa: E731
    lo = -1.0 + 1e-9
    if diff <= lo or f(lo) <= 0:
        bound = -1.0
    else:
        bound = float(optimize.brentq(f, lo, diff, xtol=1e-10)) if f(diff) < 0 else diff
    return RateResult(passed=not p < 1 - confidence, system_rate=x1 / n1, stock_rate=x0 / n0, difference=diff,
                      lower_bound=bound, p_value=p, margin=margin, system_ci=_wilson(x1, n1),
                      stock_ci=_wilson(x0, n0))


def rate_power(n_system: int, n_stock: int, stock_rate: float, excess: float = POWER_EXCESS,
               margin: float = RATE_MARGIN, confidence: float = CONFIDENCE) -> float:
    """Probability that the rate rule rejects a system whose true mismatch rate is stock's plus
    ``excess``, with ``n_system`` and ``n_stock`` forced positions: the normal approximation of the
    one-sided Farrington-Manning score test (its null variance from the restricted MLE at the margin,
    its alternative variance from the true rates)."""
    if n_system <= 0 or n_stock <= 0 or excess <= margin:
        return 0.0
    p0 = min(max(stock_rate, 0.0), 1.0 - excess)
    p1 = p0 + excess
    r1, r0 = _restricted_mle(p1 * n_system, n_system, p0 * n_stock, n_stock, margin)
    null_sd = math.sqrt(r1 * (1 - r1) / n_system + r0 * (1 - r0) / n_stock)
    true_sd = math.sqrt(p1 * (1 - p1) / n_system + p0 * (1 - p0) / n_stock)
    return float(stats.norm.cdf((excess - margin - stats.norm.ppf(confidence) * null_sd) / true_sd))


def tokens_for_power(stock_rate: float, target: float = POWER_TARGET, excess: float = POWER_EXCESS) -> int:
    """Forced positions a side (system and stock alike) for `rate_power` >= ``target``."""
    lo, hi = 1, 1024
    while rate_power(hi, hi, stock_rate, excess) < target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rate_power(mid, mid, stock_rate, excess) >= target else (mid, hi)
    return hi


@dataclass(frozen=True)
class EventResult:
    passed: bool
    system_unexplained: int
    stock_unexplained: int
    system_rate: float  # unexplained events per position
    stock_rate: float
    p_value: float
    alpha: float = EVENT_ALPHA


def event_rule(system: Counts, stock: Counts, alpha: float = EVENT_ALPHA) -> EventResult:
    """Reject when unexplained events are more frequent than stock's (exact conditional binomial test)."""
    u1, u0 = system.unexplained, stock.unexplained
    n1, n0 = system.positions, stock.positions
    if u1 + u0 == 0 or n1 == 0:
        p = 1.0
    elif n0 == 0:
        p = 0.0  # events with no stock run to compare against: nothing explains them
    else:
        p = float(stats.binomtest(u1, u1 + u0, n1 / (n1 + n0), alternative="greater").pvalue)
    return EventResult(passed=not p < alpha, system_unexplained=u1, stock_unexplained=u0,
                       system_rate=u1 / n1 if n1 else 0.0, stock_rate=u0 / n0 if n0 else 0.0,
                       p_value=p, alpha=alpha)


# --- the verdict ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    rate: RateResult
    event: EventResult
    system: Counts
    stock: Counts
    delta: float

    def stats(self) -> dict[str, Any]:
        """Everything behind the verdict, JSON-ready (``ForcingReported.stats``)."""
        return {
            "delta": self.delta, "event_threshold": EVENT_FACTOR * self.delta,
            "system": {**asdict(self.system), "rate": self.system.rate, "unexplained": self.system.unexplained},
            "stock": {**asdict(self.stock), "rate": self.stock.rate, "unexplained": self.stock.unexplained},
            "rate_rule": _jsonable(asdict(self.rate)),
            "event_rule": _jsonable(asdict(self.event)),
        }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def verdict(system: Counts, stock: Counts, delta: float) -> Verdict:
    """Both rules on the two runs' counts; the reason names every rule that failed."""
    rate, event = rate_rule(system, stock), event_rule(system, stock)
    why = []
    if not rate.passed:
        why.append(f"rate rule: mismatch rate {rate.system_rate:.2%} vs stock {rate.stock_rate:.2%}, "
                   f"excess lower bound {rate.lower_bound:.2%} > {rate.margin:.1%} (p={rate.p_value:.3g})")
    if not event.passed:
        why.append(f"event rule: {event.system_unexplained} unexplained events (margin > {EVENT_FACTOR * delta:.3g}) "
                   f"in {system.positions} positions vs stock's {event.stock_unexplained} in {stock.positions} "
                   f"(p={event.p_value:.3g})")
    if why:
        return Verdict(False, "; ".join(why), rate, event, system, stock, delta)
    reason = (f"passed: mismatch rate {rate.system_rate:.2%} vs stock {rate.stock_rate:.2%} "
              f"(excess lower bound {rate.lower_bound:+.2%}); {event.system_unexplained} unexplained events "
              f"vs stock's {event.stock_unexplained}")
    return Verdict(True, reason, rate, event, system, stock, delta)


# --- the service's decisions -----------------------------------------------------------------


def failed(reason: str) -> dict[str, Any]:
    """The fields of a ForcingReported for a request that could not be forced at all (never a pass)."""
    return {"passed": False, "reason": f"forcing failed: {reason}", "stats": {"error": reason}, "audited": []}


def report_event_id(request_event_id: str) -> str:
    """The id of the report answering one request (`schema.derived_id`): it sorts right after its cause, and
    a redelivered request's report is the same event."""
    return schema.derived_id(request_event_id, f"forcing.reported:{request_event_id}")


def report(request: schema.ForcingRequested, fields: dict[str, Any]) -> schema.ForcingReported:
    """The ForcingReported answering ``request`` (the bus stamps source, causation and correlation)."""
    return schema.ForcingReported(event_id=report_event_id(request.event_id), request_id=request.request_id,
                                  patch_id=request.patch_id, **fields)
