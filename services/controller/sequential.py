"""Sequential verdicts: stop a candidate's timing as soon as the evidence is clear. Pure, no I/O.

Contract (docs/DESIGN.md §5, step 4; the design and its simulations: docs/lab/2026-12-07-session-43-sequential-design.md
and bench/sequential_sim.py):

- **Looks.** The timing runs ABBA trials (`stats.abba_order`) up to ``cap``; after every complete pair
  (k = 2, 4, ..., and at ``cap``) the controller looks at what it has (`look`) and promotes, rejects or goes on.
- **Boundaries.** A group-sequential test: the one-sided error ``1 - stats.CONFIDENCE`` is spent over the looks
  by the Hwang-Shih-DeCani function with ``GAMMA`` (`spent`), between O'Brien-Fleming's (which never stops
  at the first looks) and Pocock's (which widens the last). `bounds` gives the z boundaries by the
  Armitage-McPherson-Rowe recursion on a grid (pinned in tests to gsDesign's published table); a look's
  t boundary at ``dof`` is the same nominal level, ``t_dof^-1(Phi(z_k))``.
- **Variance.** A look at k trials has few degrees of freedom of its own, so its per-trial SD is pooled with
  the stock-versus-stock noise run's (``Reference``: the noise run's per-trial SD and its degrees of freedom).
  A candidate noisier than stock cannot hide behind the pool: the promotion bound uses the larger of the
  candidate's own SD and the pooled one (with the candidate's degrees of freedom when its own is larger),
  and no candidate is promoted before ``FIRST_PROMOTION`` trials.
- **Bar.** The noise of a k-trial gain is ``s0 / sqrt(k)`` (s0: the noise run's per-trial SD), and the bar
  is `stats.promotion_bar` of it: higher at the early looks, never lower than at the cap.
- **Cap.** `cap_for` sizes the most trials a timing runs from the noise run: the fewest whose last look
  promotes a true 5% gain with 90% power at the noise measured, within the deployment's ``trials``.
- **Rules at look k** (log-gain units, ``g`` the crossover estimate of `stats.paired_gain`):
    - promote (k >= FIRST_PROMOTION): ``g - c_k(nu_P) * sigma_P * se_factor > bar_k``;
    - reject (futility, any look): ``g + c_k(nu_p) * s_p * se_factor < bar_k``, the repeated interval wholly
      below the bar (non-binding: it only costs power, never a false promotion);
    - at ``cap``: promote by the first rule, else reject;
    - otherwise go on.
  `Look.estimate` carries those two bounds as its lower and upper bound, so `stats.decide` with `Look.noise`
  reaches the same verdict on the bar and adds its other rules (ceiling, forcing).
- **Guarantee.** The spending makes the chance that the promotion bound ever clears a fixed value, at any look,
  at most ``1 - CONFIDENCE`` when the true gain is that value; since every bar_k is at least the cap's bar
  (1% plus twice the noise), a stock copy is promoted far less often (simulated: bench/sequential_sim.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from scipy import optimize, signal
from scipy import stats as sps

from specpilot.services.controller import stats

GAMMA = -3.0  # Hwang-Shih-DeCani: -4 is near O'Brien-Fleming, 1 near Pocock
LOOK_EVERY = 2  # a look after each complete AB/BA pair keeps the trials balanced in position
FIRST_PROMOTION = 4  # trials: no promotion on one lucky pair
_GRID_STEP = 0.002  # the recursion's grid (in SDs of the Brownian motion at the last look)
_GRID_HALF_WIDTH = 10.0

Action = Literal["promote", "reject", "continue"]
# The cap is sized for this: a true gain of DESIGN_GAIN promoted with DESIGN_POWER, at the noise measured (`cap_for`).
DESIGN_GAIN = math.log(1.05)
DESIGN_POWER = 0.90
CAP_SD_CONFIDENCE = 0.8  # `cap_for` sizes on this one-sided upper bound of the stock run's per-trial SD


def spent(tau: np.ndarray | Sequence[float], alpha: float = 1.0 - stats.CONFIDENCE,
          gamma: float = GAMMA) -> np.ndarray:
    """The Hwang-Shih-DeCani spending function: the error spent by information fraction ``tau`` (0..1)."""
    t = np.asarray(tau, dtype=np.float64)
    if gamma == 0.0:
        return alpha * t
    return alpha * (1.0 - np.exp(-gamma * t)) / (1.0 - math.exp(-gamma))


def looks(cap: int) -> tuple[int, ...]:
    """The trial counts at which a timing of at most ``cap`` trials is looked at: every pair, and the cap."""
    if cap < 2:
        raise ValueError(f"a sequential timing needs a cap of at least 2 trials, got {cap}")
    return (*range(LOOK_EVERY, cap, LOOK_EVERY), cap)


@lru_cache(maxsize=64)
def bounds(looks_at: tuple[int, ...], alpha: float = 1.0 - stats.CONFIDENCE, gamma: float = GAMMA,
           spending: str = "hsd") -> tuple[float, ...]:
    """One-sided efficacy z boundaries at the looks ``looks_at`` (trial counts, increasing), spending
    ``alpha`` by Hwang-Shih-DeCani(``gamma``), or by Lan-DeMets O'Brien-Fleming with ``spending="obf"``.

    The z statistics of a Brownian motion at information fractions tau_k have corr sqrt(tau_i / tau_j);
    boundary k is the value whose first crossing at look k has the probability spent between looks k-1
    and k. Computed on a grid of the motion's value, convolving the density that has not yet crossed."""
    info = np.asarray(looks_at, dtype=np.float64)
    if info.ndim != 1 or info.size == 0 or np.any(np.diff(info) <= 0) or info[0] <= 0:
        raise ValueError(f"looks must be increasing positive trial counts, got {looks_at}")
    tau = info / info[-1]
    if spending == "obf":
        cumulative = 2.0 * sps.norm.sf(sps.norm.isf(alpha / 2.0) / np.sqrt(tau))
    else:
        cumulative = spent(tau, alpha, gamma)
    increments = np.diff(np.concatenate([[0.0], cumulative]))
    grid = np.arange(-_GRID_HALF_WIDTH, _GRID_HALF_WIDTH + _GRID_STEP / 2, _GRID_STEP)
    density = None  # of W(tau_{k-1}) on `grid`, zero where it crossed before
    out, prev = [], 0.0
    for t, a in zip(tau, increments, strict=True):
        step = t - prev
        if density is None:
            b = float(sps.norm.isf(a))
            density = sps.norm.pdf(grid, scale=math.sqrt(t))
        else:
            mass = density * _GRID_STEP

            def crossing(b: float, mass=mass, t=t, step=step, a=a) -> float:
                return float(mass @ sps.norm.sf((b * math.sqrt(t) - grid) / math.sqrt(step))) - a

            b = float(optimize.brentq(crossing, -5.0, 15.0, xtol=1e-7)) if a > 0 else math.inf
            half = int(math.ceil(8.0 * math.sqrt(step) / _GRID_STEP))
            kernel = sps.norm.pdf(np.arange(-half, half + 1) * _GRID_STEP, scale=math.sqrt(step))
            density = signal.fftconvolve(density, kernel, mode="same") * _GRID_STEP
        density = np.where(grid < b * math.sqrt(t), density, 0.0)
        out.append(b)
        prev = t
    return tuple(out)


@dataclass(frozen=True)
class Reference:
    """What the stock-versus-stock noise run says of one trial: its per-trial SD of log r (crossover
    residuals) and that SD's degrees of freedom."""

    per_trial_sd: float
    dof: int

    @classmethod
    def from_noise(cls, noise: float, noise_trials: int) -> Reference:
        """From a noise figure (the SD of a ``noise_trials``-trial gain, `stats.NoiseEstimate.noise`)."""
        return cls(noise * math.sqrt(noise_trials), max(1, noise_trials - (2 if noise_trials >= 4 else 1)))


def cap_for(reference: Reference, most: int, least: int = FIRST_PROMOTION, gain: float = DESIGN_GAIN,
            power: float = DESIGN_POWER, outputs_identical: bool = True) -> int:
    """The fewest trials (a multiple of `LOOK_EVERY`, from ``least`` to ``most``) whose last look promotes a
    true ``gain`` with ``power`` at the noise of ``reference`` (normal approximation: the last look's bound
    and bar at the `CAP_SD_CONFIDENCE` upper bound of the stock run's per-trial SD); ``most`` when none does. A quiet machine needs few trials
    for a marginal candidate, a noisy one more; clear losers and winners stop early either way."""
    if most <= least:
        return most
    # sized on an upper bound of the stock run's SD: a few trials' SD is often well below the truth
    s0 = reference.per_trial_sd * math.sqrt(reference.dof / float(sps.chi2.ppf(1.0 - CAP_SD_CONFIDENCE, reference.dof)))
    for cap in range(least + (least % LOOK_EVERY), most, LOOK_EVERY):
        se = s0 / math.sqrt(cap)
        z = bounds(looks(cap))[-1]
        c = float(sps.t.ppf(sps.norm.cdf(z), cap - 2 + reference.dof))
        bar = stats.promotion_bar(se, outputs_identical)
        if se == 0.0 or sps.norm.cdf((gain - bar) / se - c) >= power:
            return cap
    return most


@dataclass(frozen=True)
class Look:
    k: int  # trials looked at
    cap: int
    action: Action
    estimate: stats.GainEstimate  # lower / upper bound: the look's promotion and futility bounds
    noise: float  # SD of a k-trial gain when nothing changed: what the bar is made of
    bar: float
    z: float  # the look's z boundary

    def why(self) -> str:
        """The look in words, for a verdict's reason."""
        return (f"sequential look at {self.k} of at most {self.cap} trials (z boundary {self.z:.2f}): "
                f"bounds {self.estimate.lower_bound:+.4f} .. {self.estimate.upper_bound:+.4f}, bar {self.bar:.4f}")


def look(incumbent_s: Sequence[float], candidate_s: Sequence[float], order: Sequence[str] | None,
         reference: Reference, cap: int, outputs_identical: bool = True) -> Look:
    """The action after ``len(incumbent_s)`` trials of a timing of at most ``cap`` (module docstring)."""
    lr = stats.log_ratios(incumbent_s, candidate_s)
    k = lr.size
    at = looks(cap)
    if k < 2 or k > cap:
        raise ValueError(f"a look needs 2 to {cap} trials, got {k}")
    z = bounds(at)[_look_index(at, k)]
    gain, factor, resid, dof, position = stats.fit_run(lr, stats.position_signs(order, k))
    own = math.sqrt(float(resid @ resid) / dof)
    pooled_dof = dof + reference.dof
    pooled = math.sqrt((dof * own ** 2 + reference.dof * reference.per_trial_sd ** 2) / pooled_dof)
    level = float(sps.norm.cdf(z))
    sigma_p, dof_p = (own, dof) if own > pooled else (pooled, pooled_dof)
    lower = gain - float(sps.t.ppf(level, dof_p)) * sigma_p * math.sqrt(factor)
    upper = gain + float(sps.t.ppf(level, pooled_dof)) * pooled * math.sqrt(factor)
    noise = reference.per_trial_sd * math.sqrt(factor)
    bar = stats.promotion_bar(noise, outputs_identical)
    if k >= min(FIRST_PROMOTION, cap) and lower > bar:
        action: Action = "promote"
    elif upper < bar or k >= cap:
        action = "reject"
    else:
        action = "continue"
    estimate = stats.GainEstimate(gain=gain, lower_bound=lower, upper_bound=upper,
                                  std_err=sigma_p * math.sqrt(factor), n=k,
                                  per_trial_log_r=tuple(float(x) for x in lr), confidence=level, position=position)
    return Look(k=k, cap=cap, action=action, estimate=estimate, noise=noise, bar=bar, z=z)


def _look_index(at: tuple[int, ...], k: int) -> int:
    """The look a trial count belongs to: its own, or (a count between looks, e.g. a timing cut short) the
    last look before it, so no boundary is ever looser than the spending allows at that point."""
    i = int(np.searchsorted(np.asarray(at), k, side="right")) - 1
    return max(0, i)
