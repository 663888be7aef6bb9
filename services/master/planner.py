"""Planning, pure: which directions to try next, from the cost model's factors, the deployment's
facts, accepted memory entries and what the ledger says was already tried (docs/DESIGN.md §7).

The offline planner (``rules``) works in this order:
1. accepted memory entries whose requirements hold here, that no direction has applied yet and that were
   found on this kind of machine (``same_machine``: the same device kind, ISA or GPU, worker threads and
   dtype; provider ``memory``); an entry from another kind, or one that does not say, is a hypothesis:
   ranked with the sweeps by the cost model's prediction of its options on the best (last among them
   when it cannot say; not timed when it predicts a clear loss), never first by rule;
2. with an LLM coder, one open direction per wave for the largest factor, written for the LLM;
3. option sweeps (what each `EngineOptions` field's `OptionInfo` says: values, factor, devices, what it
   requires), grouped by the factor they attack, largest factor first, skipping option values
   already tried on this deployment, options the engine does not have and options whose device kinds
   exclude this deployment's (graphs and fusion are CUDA-only, ``linear_backend`` CPU-only).
   Values the cost model can judge (``predict``: draft length, tree size, a replayed drafter or
   drafter setting) are kept only when it predicts a gain; timing a candidate costs minutes,
   predicting it nothing. A value that keeps the step's shape (a drafter, a drafter setting) is also
   predicted paired with each step shape (`shape_options`: block size, tree, tree size); where a pair
   beats the value alone by ``JOINT_MARGIN``, the pair is the candidate (``hints["joint"]``): a drafter
   whose best chain is short is not judged at the current drafter's length. A sweep it cannot rank at
   all (a kernel option) offers its first value a wave, the next one in a later wave.
``devices`` directions per wave (`directions_per_wave`), none setting an option another sets. A
direction is a `Direction` (the master publishes it as ``DirectionPlanned``); ``expected_patches``
tells the master how many verdicts to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specpilot import schema

# A value the cost model predicts to lose more than this is not timed. The step model is crude (linear in
# the drafted tokens; it has called a gain a loss: docs/FIGURES.md, "Lab notes moved from code"), so only
# clear predicted losses are screened out; what is left is timed best-predicted first.
MIN_PREDICTED_GAIN = 0.9
# A mechanism the cost model cannot predict (a kernel, graphs, an untried drafter) is credited this
# share of its factor's gap, in log terms (factor ** share), when ranked against predicted ones: a
# 6x overhead factor puts CUDA graphs (1.57) ahead of a tree predicted at +20%, while a 1.9x kernel
# factor on a CPU (1.17) waits behind a drafter the replay predicts at +22%.
UNPREDICTED_SHARE = 0.25

# A value paired with another step shape must be predicted this much better than alone to be timed as
# the pair: the model's c(n) and replay are measured on 3-4 requests.
JOINT_MARGIN = 1.05

# Predicted values of one option further than this below its best predicted are not timed in the same wave.
ALTERNATIVES_MARGIN = 1.05

LLM_TASKS = {
    "tau": "raise tokens per step (tau): a better drafter or tree shape, without changing what the target accepts",
    "kernel": "make the step's kernels closer to their byte floors (fewer bytes moved, fused work)",
    "overhead": "cut host and launch overhead between kernels in the decode step",
}


@dataclass(frozen=True)
class Direction:
    title: str
    factor: str
    provider: str
    rationale: str = ""
    hints: dict[str, Any] = field(default_factory=dict)
    memory_entry_id: str = ""

    @property
    def expected_patches(self) -> int:
        return len(self.hints.get("values", [])) if self.provider == "sweep" else 1


@dataclass(frozen=True)
class History:
    tried_options: frozenset[tuple[str, str]] = frozenset()  # (option, repr(value)) already proposed
    applied_entries: frozenset[str] = frozenset()
    llm_directions: int = 0


def history_from(events: Sequence[schema.Event], round_id: str) -> History:
    """What a deployment's past directions leave for the planner (``events``: its `schema.DirectionPlanned`,
    `schema.PatchProposed` and `schema.DirectionFailed`; others are ignored): the swept ``(option,
    repr(value))`` pairs and the memory entries applied. A sweep direction of an earlier round that failed
    before any patch (a host whose checkout differed, a crashed subagent) tried nothing, so a later round may
    plan it again; in round ``round_id`` itself it counts, so a failure that repeats cannot fill the waves."""
    planned = [e for e in events if isinstance(e, schema.DirectionPlanned)]
    patched = {e.direction_id for e in events if isinstance(e, schema.PatchProposed)}
    untried = {e.direction_id for e in events
               if isinstance(e, schema.DirectionFailed) and e.round_id != round_id} - patched
    tried = {(d.hints.get("option"), repr(v)) for d in planned if d.provider == "sweep" and d.direction_id not in untried
             for v in d.hints.get("values", [])}
    return History(tried_options=frozenset(tried),
                   applied_entries=frozenset(d.memory_entry_id for d in planned if d.memory_entry_id))


def applicable_entries(entries: list[dict[str, Any]], known_options: set[str], server: bool) -> list[dict[str, Any]]:
    """The entries whose settings this deployment's system can take: an entry learned on a server sets
    that server's flags, one learned on our engine sets engine options (and may carry code). A server
    takes no code delta and only its own options; the engine takes options it knows, or unknown ones
    that the entry's delta adds."""
    out = []
    for e in entries:
        unknown = set(e.get("options") or {}) - known_options
        code = bool((e.get("delta") or "").strip())  # an options-only entry's delta is empty (or a newline)
        if (not unknown and not code) if server else (not unknown or code):
            out.append(e)
    return out


def entries_in_lineage(entries: list[dict[str, Any]], advanced_event_ids: set[str]) -> set[str]:
    """Ids of the entries learned from a promotion of this deployment (their evidence holds one of its
    ``BestAdvanced`` event ids): the deployment's best system already contains them."""
    return {e["entry_id"] for e in entries if advanced_event_ids & set(e.get("evidence", []))}


def plan(*, factors: dict[str, float], facts: dict[str, Any], best_options: dict[str, Any],
         known_options: set[str], entries: list[dict[str, Any]], history: History, coder: str = "sweep",
         devices: int = 1, predict: Callable[[str, Any, dict[str, Any]], float | None] | None = None,
         options: type | None = None, stock_options: dict[str, Any] | None = None) -> list[Direction]:
    """Up to ``devices`` directions for the next wave; [] when nothing is left to try.

    ``predict(option, value, base)``: the cost model's predicted gain over the best of setting
    ``option`` to ``value`` on top of ``base``; None when it cannot say. ``options``: the options class
    whose fields' `OptionInfo` say what to sweep, on which devices, for which factor, and what each
    requires (`specpilot.engine.options.EngineOptions` unless given). ``stock_options``: the deployment's own
    stock values where they differ from the class defaults (its TOML's drafter, block size, [options]): a
    value the system already has, from its stock or its best, is never proposed."""
    from specpilot.engine import options as engine_options

    cls = options or engine_options.EngineOptions
    mode = facts.get("mode") or "batch1"
    sweep_table = engine_options.sweeps(cls, mode=mode, dtype=facts.get("dtype"))
    # the batching mechanisms go first on a batched deployment (on batch 1 the sweeps keep field order)
    own_mode = {name for name, i in engine_options.infos(cls).items()
                if mode != "batch1" and tuple(i.modes) == (mode,)}
    requires = engine_options.requirements(cls)
    shapes = engine_options.shape_options(cls)
    out: list[Direction] = []
    sweeps: list[tuple[float, Direction]] = []  # ranked by predicted gain: sweeps, and entries from elsewhere
    for entry in entries:
        if entry["entry_id"] not in history.applied_entries:
            d = Direction(title=f"apply memory entry {entry['entry_id']}: {entry.get('title', '')}".strip(),
                          factor="memory", provider="memory", memory_entry_id=entry["entry_id"],
                          rationale="validated on a deployment whose facts match this one",
                          hints={"entry": {k: entry.get(k) for k in ("entry_id", "delta", "options")}})
            if entry.get("same_machine"):
                out.append(d)
                continue
            score = _entry_prediction(entry, best_options, predict)
            if score is None or score >= MIN_PREDICTED_GAIN:
                found = entry.get("machine") or {}
                sweeps.append((score if score is not None else 1.0, replace(
                    d, rationale=f"a hypothesis: found on another kind of machine ({_kind_words(found)})"
                    + (f", predicted {score:.2f}x here" if score is not None else ", not predictable here"))))
    order = sorted(factors, key=lambda f: -factors[f]) or list(sweep_table)
    llm = coder not in ("sweep", "memory", "")
    if llm and order:
        top = order[0]
        out.append(Direction(title=f"{top}: {LLM_TASKS.get(top, 'make the decode step faster')}", factor=top,
                             provider=coder, rationale=_why(top, factors),
                             hints={"factors": factors, "best_options": best_options}))
    for factor in order:
        for option, values, kinds in sweep_table.get(factor, []):
            if facts.get("device_kind", "cpu") not in kinds or option not in known_options:
                continue
            current = best_options.get(option, (stock_options or {}).get(option))
            fresh = [v for v in values if (option, repr(v)) not in history.tried_options and current != v]
            base = {**best_options, **requires.get(option, {})}
            predicted = {repr(v): predict(option, v, base) for v in fresh} if predict else {}
            joint: dict[str, dict[str, Any]] = {}
            if predict is not None and option not in shapes:
                for v in fresh:
                    if predicted[repr(v)] is not None:
                        predicted[repr(v)], pair = _best_pair(option, v, base, predicted[repr(v)], shapes, requires,
                                                              predict)
                        if pair:
                            joint[repr(v)] = pair
            fresh = [v for v in fresh if predicted.get(repr(v)) is None or predicted[repr(v)] >= MIN_PREDICTED_GAIN]
            if not fresh:
                continue
            guesses = {k: round(g, 3) for k, g in predicted.items() if g is not None and k in map(repr, fresh)}
            if guesses:
                # One option's values are alternatives: only one can be in the best. Time those the model
                # cannot tell apart from the best predicted, best first; the rest (unpredicted ones too)
                # are planned again, re-predicted against the new best, if it is rejected.
                top = max(guesses.values())
                fresh = sorted((v for v in fresh if guesses.get(repr(v), 0.0) * ALTERNATIVES_MARGIN >= top),
                               key=lambda v: -guesses.get(repr(v), 1.0))
                guesses = {k: g for k, g in guesses.items() if k in map(repr, fresh)}
            elif predict is not None:
                # Values the cost model cannot rank (a kernel, graphs) cost a whole timing each: the first
                # (the prior's best) now, the next in a later wave if it still ranks first then: timing
                # both at once left a round no time for the parallel drafter (docs/FIGURES.md, "Lab notes
                # moved from code").
                fresh = fresh[:1]
            joint = {k: pair for k, pair in joint.items() if k in map(repr, fresh)}
            hints: dict[str, Any] = {"option": option, "values": fresh, "base": base}
            if requires.get(option):
                hints["requires"] = dict(requires[option])
            if joint:
                hints["joint"] = joint
            if guesses:
                hints["predicted_gain"] = guesses
            prior = max(1.0, factors.get(factor, 1.0)) ** UNPREDICTED_SHARE
            sweeps.append((max(guesses.values(), default=prior), Direction(
                title=_sweep_title(option, fresh, joint), factor=factor, provider="sweep",
                rationale=_why(factor, factors), hints=hints)))
    # what the wave's memory entries set counts as set: a sweep of the same option would time it again
    touched: dict[str, set[str]] = {k: {repr(v)} for d in out if d.provider == "memory"
                                    for k, v in (d.hints["entry"].get("options") or {}).items()}
    # stable: this mode's own mechanisms, then the score, then factor and field order among equals
    for _, d in sorted(sweeps, key=lambda sd: (sd[1].hints.get("option") not in own_mode, -sd[0])):
        # Directions of one wave are timed one on top of the other: one that sets an option an earlier
        # one sets (a block size next to a drafter paired with one), or that needs another value of it
        # (an n-gram setting next to another drafter), would undo it; it waits for a wave planned on
        # the new best.
        own, needs = _settings(d)
        if own.keys() & touched.keys() or any(touched.get(k, {v}) != {v} for k, v in needs.items()):
            continue
        touched.update(own)
        for k, v in needs.items():
            touched[k] = {v}
        out.append(d)
    return out[:devices]


def _entry_prediction(entry: dict[str, Any], best_options: dict[str, Any],
                      predict: Callable[[str, Any, dict[str, Any]], float | None] | None) -> float | None:
    """The cost model's predicted speedup of an entry's options over the best (one option predicted with
    the others as its base), or None when it cannot say (code, or options it does not model)."""
    opts = dict(entry.get("options") or {})
    if predict is None or not opts or (entry.get("delta") or "").strip():
        return None
    for option, value in opts.items():
        guess = predict(option, value, {**best_options, **{k: v for k, v in opts.items() if k != option}})
        if guess is not None:
            return guess
    return None


def _kind_words(machine: dict[str, Any]) -> str:
    """An entry's machine kind in words ("not recorded" for an entry that does not carry one)."""
    if not machine:
        return "not recorded"
    return (f"{machine.get('device_kind', '?')} {machine.get('device', '?')}, {machine.get('threads', '?')} threads, "
            f"{machine.get('dtype', '?')}")


MACHINE_KIND_KEYS = ("device_kind", "device", "threads", "dtype")


def same_machine_kind(found: dict[str, Any] | None, here: dict[str, Any] | None) -> bool:
    """Whether a finding made on machine ``found`` is this machine kind's own (both recorded, every
    `MACHINE_KIND_KEYS` equal): only then does the planner apply it first."""
    return bool(found and here) and all(found.get(k) == here.get(k) for k in MACHINE_KIND_KEYS)


def _settings(d: Direction) -> tuple[dict[str, set[str]], dict[str, str]]:
    """The options a sweep direction's candidates change (its option and the step shapes it is paired
    with), or an entry's options, and what they need, with their values (as reprs)."""
    if d.provider == "memory":
        return {k: {repr(v)} for k, v in (d.hints["entry"].get("options") or {}).items()}, {}
    own = {d.hints["option"]: set(map(repr, d.hints["values"]))}
    for pair in d.hints.get("joint", {}).values():
        for k, v in pair.items():
            own.setdefault(k, set()).add(repr(v))
    return own, {k: repr(v) for k, v in d.hints.get("requires", {}).items()}


def _best_pair(option: str, value: Any, base: dict[str, Any], alone: float, shapes: dict[str, list[Any]],
               requires: dict[str, dict[str, Any]], predict: Callable[[str, Any, dict[str, Any]], float | None],
               ) -> tuple[float, dict[str, Any]]:
    """(predicted gain, step-shape settings to pair with) of ``option = value``: the best prediction
    over every step shape, pair or none; a pair only when it beats the value alone by JOINT_MARGIN."""
    best, pair = alone, {}
    for shape, shape_values in shapes.items():
        for sv in shape_values:
            if shape == option or base.get(shape, shape_values[0]) == sv:
                continue
            settings = {**requires.get(shape, {}), shape: sv}
            guess = predict(option, value, {**base, **settings})
            if guess is not None and guess > max(best, alone * JOINT_MARGIN):
                best, pair = guess, settings
    return best, pair


def _sweep_title(option: str, values: list[Any], joint: dict[str, dict[str, Any]] | None = None) -> str:
    paired = "; ".join(f"{v!r} with {', '.join(f'{k}={x!r}' for k, x in joint[repr(v)].items())}"
                       for v in values if joint and repr(v) in joint)
    return f"sweep {option} over {values}" + (f" ({paired})" if paired else "")


def _why(factor: str, factors: dict[str, float]) -> str:
    if not factors:
        return "no cost-model factors yet"
    ranked = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(factors.items(), key=lambda kv: -kv[1]))
    return f"factor {factor} ({ranked})"


# --- the round's time budget -------------------------------------------------------------------------

CANDIDATE_OVERHEAD = 1.25  # a candidate's wall time over its timing's: the default check and a test run
SEALED_REQUESTS_IF_ALL = 8  # assumed when the sealed final runs every sealed request (count unknown here)


@dataclass(frozen=True)
class TimingSample:
    wall_s: float  # the whole timing experiment (TimingMeasured.wall_s)
    trials: int
    requests: int  # per run


def budget_estimates(samples: list[TimingSample], sealed_requests: int, sealed_trials: int,
                     ) -> tuple[float, float] | None:
    """(seconds per candidate, seconds of the sealed final) from earlier timings on this deployment and
    device; None before any. The sealed final runs final, stock and AR ``sealed_trials`` times and the
    transformers peer twice (greedy and prompt lookup), each over ``sealed_requests`` requests."""
    usable = [t for t in samples if t.wall_s > 0 and t.trials > 0 and t.requests > 0]
    if not usable:
        return None
    candidate_s = CANDIDATE_OVERHEAD * sum(t.wall_s for t in usable) / len(usable)
    per_request_run_s = sum(t.wall_s / (2 * t.trials * t.requests) for t in usable) / len(usable)
    sealed_s = per_request_run_s * (sealed_requests or SEALED_REQUESTS_IF_ALL) * (3 * sealed_trials + 2)
    return candidate_s, sealed_s


def directions_per_wave(setting: int, device_kind: str, devices: int) -> int:
    """Directions a wave plans: the round's setting, else 2 on a CPU (one timed while the other's
    patches are written) and one per device on GPUs."""
    if setting > 0:
        return setting
    return 2 if device_kind == "cpu" else max(1, devices)


def fit_to_budget(directions: list[Direction], remaining_s: float, candidate_s: float,
                  timing_devices: int = 1) -> list[Direction]:
    """The directions cut to the candidates that fit in ``remaining_s``: the controller times one
    candidate at a time per timing device, so the wave's candidates share ``remaining_s //
    candidate_s`` slots per device, first directions first; [] when not even one fits."""
    slots = int(remaining_s // candidate_s) * max(1, timing_devices) if candidate_s > 0 else 1 << 30
    return fit_slots(directions, slots)


def fit_slots(directions: list[Direction], slots: int) -> list[Direction]:
    """The directions cut to ``slots`` candidates, first directions first (a sweep to its first values)."""
    out = []
    for d in directions:
        if slots < 1:
            break
        if d.provider == "sweep" and len(d.hints.get("values", [])) > slots:
            values = d.hints["values"][:slots]
            d = replace(d, title=_sweep_title(d.hints["option"], values, d.hints.get("joint")),
                        hints={**d.hints, "values": values})
        slots -= d.expected_patches
        out.append(d)
    return out
