"""The cost model (docs/DESIGN.md §7), pure: measurements in, a speed ceiling and its three factors out.

Definitions:
- A kernel class's **floor** is ``max(FLOPs / (0.6 · peak FLOP/s), bytes / (0.9 · bandwidth))``
  with the peaks measured on the device (`HardwareMeasured`).
- **Exact replay**: walk the target's own greedy output; at each step the drafter's candidates at
  that prefix (recorded by the system itself, `specpilot.harness.replay`) match the target to some depth; the
  best tree of ``N`` draft nodes in hindsight holds that matching path cut to ``N`` nodes, so a
  step commits ``min(depth, N) + 1`` tokens (the bonus included). ``tau_best(N)`` is the mean.
- The **ceiling** is one draft plus one exact pass over the best tree (``N + 1`` tokens) with every
  kernel class at its floor: ``S* = max_N tau_best(N) · t_AR / (draft_floor + floor(N + 1))``,
  a speedup over the measured AR step ``t_AR``.
- **Factors** of the current system (``tau`` per step, ``step`` seconds, kernel-class profile):
  *tau* = ``tau_best(N*) / tau``; *kernel* = kernel time / the summed floors of the current step;
  *overhead* = step time / kernel time. Their product is the gap between the current speedup and
  the ceiling, up to the difference between the current step's floors and the best tree's; the
  largest names what to attack.
- **Batched** (a deployment of ``rows`` closed-loop clients, `batched_ceiling`): a step verifies every
  row's tree in one forward, whose weights are read once for all rows but whose FLOPs and KV reads grow
  with them, so drafts cost more the more rows share a step. ``S*_B = max_N tau_best(N) · t_AR(B) /
  floor_B(N + 1)`` over the measured batched AR step ``t_AR(B)``; with the measured step costs instead of
  the floors, ``S_B = max_N tau_best(N) / c(N, B)`` is what today's kernels allow. The best ``N`` at B
  rows is shorter than at one, and the *tau* factor is taken at it. Its *overhead* factor
  (`batched_overhead`) adds the step's per-row part: the batched AR step of B rows of one token over
  one row of B tokens, which is the same linear work without the per-row attention calls, cache
  writes and bookkeeping (host work that one attention call over every row removes).
- **Latency floor.** A kernel costs the device a few microseconds however little it reads
  (``kernel_floor_s``, measured by replaying tiny kernels as one CUDA graph), so a step of K kernels costs
  at least ``K · kernel_floor_s``; a step's floor is the larger of that and its classes' summed floors. On
  a small model on a GPU (SmolLM2: ~240 kernels a step, 270 MB of bf16 weights) the latency floor is the
  larger one, and the ceiling and the *kernel* factor read it (CPU: no such floor).
- **Kernel time** of a class is its profiled time less what its launches cost the host
  (``launches · launch_s``, both measured), but never below its floor: a class whose time is
  launches (an eager step on a GPU, where the device waits for the host) counts as *overhead*,
  which graphs and fusion remove, not as *kernel*, which faster kernels remove.

Nothing here measures or imports torch: the controller measures (`specpilot.harness.replay.measure`, in its
timing worker) and the master reads the events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specpilot.engine.options import EngineOptions, factor_options, options_from_dict
from specpilot.shapes import Shape

FLOP_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.9
NODE_BUDGETS = (1, 2, 4, 8, 16, 32, 64)
LINEAR_CLASSES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Classes of a fused_kernels step (specpilot.engine.fused): one GEMM over concatenated weights; floor = parts' sum.
FUSED_CLASSES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
KERNEL_CLASSES = (*LINEAR_CLASSES, *FUSED_CLASSES, "lm_head", "attention", "norms", "embedding")
FACTORS = ("tau", "kernel", "overhead")


@dataclass(frozen=True)
class Hardware:
    bandwidth_bytes_s: float
    flops_s: float


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def floor_s(self, hw: Hardware) -> float:
        return max(self.flops / (FLOP_EFFICIENCY * hw.flops_s), self.bytes / (BANDWIDTH_EFFICIENCY * hw.bandwidth_bytes_s))


def step_work(shape: Shape, n_tokens: int, context: int, weight_bytes: float, act_bytes: float = 4.0,
              head_bytes: float | None = None, rows: int = 1) -> dict[str, Work]:
    """FLOPs and bytes per kernel class of one target forward over ``n_tokens`` new tokens in each of
    ``rows`` rows (a batched step: weights read once, activations, attention and KV reads per row).

    ``context`` is the number of cached positions each row attends to; ``weight_bytes`` per weight
    (4 fp32, 2 bf16, 1.5 W12), ``head_bytes`` per LM-head weight (default ``weight_bytes``; less
    where a lossless argmax reads less, `head_bytes_per_weight`); activations and the KV cache use
    ``act_bytes``."""
    head_bytes = weight_bytes if head_bytes is None else head_bytes
    d, kv, f, L, n = shape.dim, shape.kv_dim, shape.intermediate, shape.n_layers, n_tokens
    T = n * rows
    dims = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    out = {
        name: Work(flops=2.0 * T * k * n * L, bytes=(k * n * weight_bytes + T * (k + n) * act_bytes) * L)
        for name, (k, n) in dims.items()
    }
    out["lm_head"] = Work(flops=2.0 * T * d * shape.vocab_size,
                          bytes=d * shape.vocab_size * head_bytes + T * (d + shape.vocab_size) * act_bytes)
    attended = context + n  # per row: its own cache
    out["attention"] = Work(flops=4.0 * T * attended * d * L,  # scores and the weighted sum, every head
                            bytes=(2.0 * attended * kv * rows + 2.0 * T * d) * act_bytes * L)
    out["norms"] = Work(flops=4.0 * T * d * (2 * L + 1), bytes=2.0 * T * d * act_bytes * (2 * L + 1))
    out["embedding"] = Work(flops=0.0, bytes=T * d * weight_bytes)
    return out


# Bytes a weight by format: ours, and a served model's GGUF quantisations (blocks of 32 weights with their
# fp16 scale, and min for q4_1) (`ServerSpec.weight_dtype`).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}


def head_bytes_per_weight(device: str, weight_bytes: float) -> float:
    """Bytes per LM-head weight a greedy step must read on ``device`` (a label, "cpu (2 threads)"): on a
    CPU the certified argmax head (``screened_head``, `specpilot.engine.screened_head`) reads a bf16 copy
    and a few exact rows, so the floor is at most bf16's; elsewhere ``weight_bytes``."""
    return min(weight_bytes, 2.0) if device.startswith("cpu") else weight_bytes


def floors_s(work: dict[str, Work], hw: Hardware) -> dict[str, float]:
    return {name: w.floor_s(hw) for name, w in work.items()}


# --- exact replay ---------------------------------------------------------------------------------

def replay_tau(depths: Sequence[int], budgets: Sequence[int] = NODE_BUDGETS) -> dict[int, float]:
    """Tokens per step of the best tree in hindsight at each node budget.

    ``depths[p]``: how deep the drafter's candidates after the output's first ``p`` tokens match
    what the target emitted from position ``p`` on (`specpilot.harness.replay.matched_depths`; position 0 is
    the prefill's token). Each budget walks its own steps: a bigger tree commits more per step
    and so visits other positions. A step at ``p`` commits ``min(depth, budget) + 1`` tokens."""
    n = len(depths)
    out: dict[int, float] = {}
    for budget in budgets:
        pos, steps = min(1, n), 0
        while pos < n:
            pos += min(depths[pos], budget, n - pos - 1) + 1
            steps += 1
        out[budget] = (n - min(1, n)) / steps if steps else 1.0
    return out


def pooled_replay(depth_lists: Sequence[Sequence[int]], budgets: Sequence[int] = NODE_BUDGETS) -> dict[int, float]:
    """`replay_tau` pooled over requests, each weighted by its steps."""
    totals: dict[int, tuple[float, float]] = {}
    for depths in depth_lists:
        n = len(depths) - 1
        if n <= 0:
            continue
        for budget, tau in replay_tau(depths, budgets).items():
            tokens, steps = totals.get(budget, (0.0, 0.0))
            totals[budget] = (tokens + n, steps + n / tau)
    return {b: tokens / steps for b, (tokens, steps) in totals.items()} or {1: 1.0}


def envelope(tables: dict[str, dict[int, float]]) -> tuple[dict[int, float], dict[int, str]]:
    """Per node budget, the most tokens a step commits under any of several replays (the system's own
    drafter's best tree, its chain, each other drafter's chain: ``name -> replay table``), and which one.
    A table without that budget counts at its largest budget below it (`_at_budget`)."""
    budgets = sorted({b for t in tables.values() for b in t})
    best: dict[int, float] = {}
    by: dict[int, str] = {}
    for b in budgets:
        name = max(tables, key=lambda k: _at_budget(tables[k], b))
        best[b], by[b] = _at_budget(tables[name], b), name
    return best, by


# --- ceiling and factors --------------------------------------------------------------------------

@dataclass(frozen=True)
class Ceiling:
    speedup: float  # S*: the best tree's speedup over the measured AR step, every class at its floor
    budget: int  # the node budget N that reaches it
    tau_best: float
    factors: dict[str, float]  # tau, kernel, overhead of the current system
    floors_s: dict[str, float]  # per kernel class, of the current step
    current_speedup: float  # tau / (step / t_AR) of the current system
    latency_floor_s: float = 0.0  # the step's kernels at the device's floor of a kernel (module doc)

    @property
    def largest_factor(self) -> str:
        return max(self.factors, key=self.factors.__getitem__)


def ceiling(*, shape: Shape, hw: Hardware, weight_bytes: float, act_bytes: float, context: int,
            t_ar_s: float, step_s: float, tau: float, n_tokens: int, profile_s: dict[str, float],
            replay: dict[int, float], draft_floor_s: float = 0.0, launches: dict[str, float] | None = None,
            launch_s: float = 0.0, head_bytes: float | None = None, kernel_floor_s: float = 0.0) -> Ceiling:
    """The ceiling and the factors of the current system.

    ``step_s``/``tau``/``n_tokens``: the current system's mean step time, tokens per step and
    tokens per verification (root included); ``profile_s``: seconds per step by kernel class (the
    keys of `KERNEL_CLASSES` that were measured; others are ignored); ``replay``: `replay_tau`;
    ``launches``: operator launches per step by class, ``launch_s``: the host time of one launch;
    ``kernel_floor_s``: the device time of one tiny kernel in a graph (the latency floor, module doc)."""
    if t_ar_s <= 0 or step_s <= 0 or tau <= 0:
        raise ValueError("t_ar_s, step_s and tau must be positive")
    latency_s = latency_floor_s(launches or {}, kernel_floor_s)
    options = {}
    for budget, tau_n in replay.items():
        work = step_work(shape, budget + 1, context, weight_bytes, act_bytes, head_bytes)
        pass_s = draft_floor_s + max(latency_s, sum(floors_s(work, hw).values()))
        options[budget] = (tau_n * t_ar_s / pass_s, tau_n)
    budget = max(options, key=lambda b: options[b][0])
    speedup, tau_best = options[budget]
    current_floors = floors_s(step_work(shape, n_tokens, context, weight_bytes, act_bytes, head_bytes), hw)
    kernel_s = sum(kernel_time_s(t, class_floor_s(current_floors, k), (launches or {}).get(k, 0.0) * launch_s)
                   for k, t in profile_s.items() if k in KERNEL_CLASSES)
    factors = {
        "tau": max(tau_best, tau) / tau,
        "kernel": kernel_s / max(latency_s, sum(current_floors.values())) if kernel_s > 0 else 1.0,
        "overhead": step_s / kernel_s if kernel_s > 0 else 1.0,
    }
    return Ceiling(speedup=speedup, budget=budget, tau_best=tau_best, factors=factors, floors_s=current_floors,
                   current_speedup=tau * t_ar_s / step_s, latency_floor_s=latency_s)


def latency_floor_s(launches: dict[str, float], kernel_floor_s: float) -> float:
    """The least a step of the profiled classes' kernels costs the device, one ``kernel_floor_s`` a launch."""
    return kernel_floor_s * sum(n for k, n in launches.items() if k in KERNEL_CLASSES)


@dataclass(frozen=True)
class BatchedCeiling:
    rows: int
    speedup: float  # S*_B: over the measured batched AR step, every class at its floor
    budget: int  # the node budget that reaches it
    measured_speedup: float  # max over measured N of tau_best(N) / c(N, B): today's kernels, perfect drafts
    measured_budget: int  # 0 when no step cost was measured
    by_budget: dict[int, dict[str, float]] = field(default_factory=dict)  # N -> {"floor", "measured", "tau"}


def batched_ceiling(*, shape: Shape, hw: Hardware, weight_bytes: float, act_bytes: float, context: int, rows: int,
                    t_ar_rows_s: float, replay: dict[int, float], measured_c: dict[int, float] | None = None,
                    head_bytes: float | None = None) -> BatchedCeiling:
    """The ceiling of speculation at ``rows`` rows a step (see the module docstring): ``replay`` is
    `replay_tau` (tokens a row commits a step with the best tree of N nodes), ``t_ar_rows_s`` the measured
    step of ``rows`` rows of one token, ``measured_c`` the measured ``c(N, B)`` by draft count N."""
    if rows < 1 or t_ar_rows_s <= 0:
        raise ValueError("rows must be >= 1 and t_ar_rows_s positive")
    table: dict[int, dict[str, float]] = {}
    for budget, tau_n in replay.items():
        floor = sum(floors_s(step_work(shape, budget + 1, context, weight_bytes, act_bytes, head_bytes, rows),
                             hw).values())
        row = {"tau": tau_n, "floor": tau_n * t_ar_rows_s / floor}
        if measured_c and budget in measured_c and measured_c[budget] > 0:
            row["measured"] = tau_n / measured_c[budget]
        table[budget] = row
    budget = max(table, key=lambda b: table[b]["floor"])
    measured = {b: r["measured"] for b, r in table.items() if "measured" in r}
    best_measured = max(measured, key=measured.__getitem__) if measured else 0
    return BatchedCeiling(rows=rows, speedup=table[budget]["floor"], budget=budget,
                          measured_speedup=measured.get(best_measured, 0.0), measured_budget=best_measured,
                          by_budget=table)


def batched_overhead(overhead: float, t_ar_rows_s: float, t_one_row_s: float) -> float:
    """The overhead factor of a batched step: the one-row step's ``overhead`` (taken as at least 1: below 1
    the profiled kernel time exceeds the step, an artefact of profiling) times the per-row part
    ``t_ar_rows_s / t_one_row_s`` (B rows of one token over one row of B tokens, at least 1); ``overhead``
    alone when the one-row step was not measured."""
    if t_ar_rows_s <= 0 or t_one_row_s <= 0:
        return overhead
    return max(1.0, overhead) * max(1.0, t_ar_rows_s / t_one_row_s)


def class_floor_s(floors: dict[str, float], cls: str) -> float:
    """The floor of a profiled kernel class (a fused class's is the sum of its parts')."""
    return sum(floors.get(part, 0.0) for part in FUSED_CLASSES.get(cls, (cls,)))


def kernel_time_s(measured_s: float, floor_s: float, launch_cost_s: float) -> float:
    """A class's kernel time: measured less its launch cost, within [floor, measured]."""
    return min(measured_s, max(floor_s, measured_s - launch_cost_s))


# --- predictions for planning ---------------------------------------------------------------------

# The options replay can judge: those that attack tau (their OptionInfo says factor="tau").
PREDICTABLE = factor_options("tau")


@dataclass(frozen=True)
class StepModel:
    """The current system's step as the planner sees it: a step verifying ``1 + n`` tokens costs
    ``t_AR · (1 + slope · n)`` (slope from the profiled step), and commits the replayed tau at ``n``:
    of the best tree in hindsight for a tree, of the drafter's first candidate for a chain
    (``chain_replay``; the tree's replay when it is missing, which flatters chains). Another drafter
    (``drafters``: its chain replay on the same outputs and its seconds per proposal) commits its own
    replayed tau and adds its draft time to the step.

    ``slope`` is per *nominal* draft token: the profiled drafter does not fill every step (an n-gram
    without a match verifies the root alone), and its other settings will not either. Another drafter
    that proposes a full chain every step (parallel, eagle) pays ``token_cost`` per draft token
    instead, the step's cost over the tokens its forwards actually ran (``verified_tokens``): the
    nominal slope overrated the parallel drafter where the n-gram verified far fewer tokens a step
    than nominal (docs/FIGURES.md, "Lab notes moved from code"). Where the profile
    measured full chains directly (``chain_cost``: n -> c(n), `specpilot.harness.replay.chain_cost`) those
    figures are used instead (`full_chain_cost`): round 11 extrapolated c(4) = 1.69 from the n-gram's
    steps where HumanEval measured 1.41, and never tried the parallel drafter."""

    t_ar_s: float
    step_s: float
    n_tokens: int
    tau: float
    replay: dict[int, float]
    chain_replay: dict[int, float] = field(default_factory=dict)
    drafters: dict[str, tuple[dict[int, float], float]] = field(default_factory=dict)
    drafter_trees: dict[str, dict[int, float]] = field(default_factory=dict)  # other drafters' tree replays
    verified_tokens: float = 0.0  # mean tokens per profiled forward, root included (0: n_tokens)
    chain_cost: dict[int, float] = field(default_factory=dict)  # measured c(n) of full chains
    profiled: dict | None = None  # the profiled system's options over stock (None: each candidate's base)

    @property
    def slope(self) -> float:
        return max(0.0, (self.step_s / self.t_ar_s - 1.0) / max(1, self.n_tokens - 1))

    @property
    def token_cost(self) -> float:
        """The step's extra cost per draft token actually verified, in AR steps."""
        if self.n_tokens <= 1:  # an AR profile: no verification cost was measured
            return self.slope
        # A profile that verified almost no drafts has no cost signal (the numerator is then noise
        # and draft time): never credit fewer than a quarter of the nominal drafts.
        drafts = max((self.verified_tokens or self.n_tokens) - 1.0, 0.25 * (self.n_tokens - 1))
        return max(0.0, (self.step_s / self.t_ar_s - 1.0) / drafts)

    def full_chain_cost(self, n: int) -> float:
        """c(n) of a step verifying a full chain of ``n`` drafts, in AR steps: the measured figures
        (`chain_cost`) interpolated linearly from c(0) = 1, extended past the longest with the
        last segment's slope; ``1 + token_cost * n`` where none was measured."""
        if not self.chain_cost:
            return 1.0 + self.token_cost * n
        points = [(0, 1.0), *sorted((int(k), float(v)) for k, v in self.chain_cost.items())]
        for (n0, c0), (n1, c1) in zip(points, points[1:], strict=False):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        (n0, c0), (n1, c1) = points[-2], points[-1]
        return c1 + max(0.0, (c1 - c0) / (n1 - n0)) * (n - n1)

    def replay_tau(self, n: int, chain: bool = False) -> float:
        return _at_budget(self.chain_replay if chain and self.chain_replay else self.replay, n)

    def speedup(self, n: int, chain: bool = False) -> float:
        """Predicted speedup over AR with ``n`` draft tokens (chain) or tree nodes per step."""
        return self.replay_tau(n, chain) / (1.0 + self.slope * n)

    def drafter_speedup(self, drafter: str, n: int, tree: bool = False) -> float:
        """Predicted speedup over AR of a chain of ``n`` tokens (or a tree of ``n`` nodes, from its tree
        replay) from another replayed drafter. A tree's step is costed as a full chain of as many tokens
        (the same rows verified) and its proposal as the chain's."""
        chain, draft_s = self.drafters[drafter]
        table = self.drafter_trees[drafter] if tree else chain
        return _at_budget(table, n) / (self.full_chain_cost(n) + draft_s / self.t_ar_s)

    @property
    def current(self) -> float:
        return self.tau / (self.step_s / self.t_ar_s)


def predicted_gain(model: StepModel, option: str, value, options: dict, stock: dict) -> float | None:
    """Predicted speedup of setting ``option`` to ``value`` over the current (profiled) system, or None
    when the model cannot say (another drafter's tree that was not replayed, a kernel or overhead
    mechanism, a drafter setting that was not replayed, an option or value this stock does not know, ...).

    ``options``: the candidate's other settings (the best's, plus what the option needs, e.g.
    ``verify = "tree"`` for ``tree_nodes``, plus a step shape the planner pairs a drafter change with);
    ``stock``: the deployment's stock options (defaults). The profiled system is ``model.profiled``
    over stock (``options`` itself when the model does not say). What a step verifies is read from the
    options themselves (`EngineOptions.step_tokens`)."""
    if option not in PREDICTABLE or model.t_ar_s <= 0 or model.step_s <= 0:
        return None
    fields = EngineOptions.__dataclass_fields__
    try:
        base = options_from_dict({k: v for k, v in {**stock, **options}.items() if k in fields})
        new = options_from_dict({option: value}, base=base)
        profiled = base if model.profiled is None else options_from_dict(
            {k: v for k, v in {**stock, **model.profiled}.items() if k in fields})
    except ValueError:
        return None  # e.g. a drafter an agent's patch added: not replayed, nothing to predict
    tree, n = new.verifies_tree, new.step_tokens - 1
    if new.drafter != profiled.drafter:
        if new.drafter not in model.drafters or (tree and new.drafter not in model.drafter_trees):
            return None  # only replayed drafters are predicted
        return model.drafter_speedup(new.drafter, n, tree) / model.current
    if (new.verify, new.step_tokens) == (base.verify, base.step_tokens):
        # A setting of the same drafter (replayed as "option=value"): at the profiled step shape the gain
        # is the ratio of the two chains' replayed tau (same verification, about the same draft cost);
        # at another shape (paired with a block size) the setting's chain is predicted like a drafter.
        key = f"{option}={value}"
        if tree or key not in model.drafters:
            return None
        if (new.verify, new.step_tokens) == (profiled.verify, profiled.step_tokens):
            return _at_budget(model.drafters[key][0], n) / model.replay_tau(n, chain=True)
        return model.drafter_speedup(key, n) / model.current
    return model.speedup(n, chain=not tree) / model.current


def _at_budget(table: dict[int, float], n: int) -> float:
    """A replay table's tau at the largest budget not above ``n`` (1.0, AR, when there is none)."""
    budgets = [b for b in table if b <= n]
    return table[max(budgets)] if budgets else 1.0
