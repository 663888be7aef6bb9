"""What an agent is told about a deployment before it plans or codes: the evidence, bounded in size.

Pure and torch-free. `attempts` folds a deployment's events into what was tried: per patch its
direction, options, a summary of its diff (files, lines added and removed), and the decision with its
measured gain, lower bound and bar, or the refusal or rejection reason. `bundle` puts beside it the
deployment's facts, the device's measured peaks, the current best's profile (per kernel class, the
replayed tau and c(N) of full chains), the cost model's ceiling and factors, and the memory entries
that apply; then trims it to ``max_bytes`` of JSON (the oldest attempts and the smallest kernel classes
go first, and the bundle says how many were left out). `render` is the text a prompt quotes.
`refuted` says whether the attempts show an option value already rejected from the same base.

The master builds the bundle once per wave from the ledger and sends it with every direction
(`schema.DirectionPlanned.evidence`), so a subagent on another host needs no ledger access.
"""

from __future__ import annotations

import json
from typing import Any

from specpilot import schema

MAX_BYTES = 12_000
MAX_REASON = 300  # characters of a refusal or rejection reason
MAX_CLASSES = 12  # kernel classes of the profile, the most expensive first


def diffstat(diff: str) -> str:
    """``path +added -removed`` per file of a unified diff, comma-separated ('' for an empty diff)."""
    files: dict[str, list[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[4:].removeprefix("b/")
            files.setdefault(current, [0, 0])
        elif current and line.startswith("+") and not line.startswith("+++"):
            files[current][0] += 1
        elif current and line.startswith("-") and not line.startswith("---"):
            files[current][1] += 1
    return ", ".join(f"{path} +{a} -{r}" for path, (a, r) in files.items())


def skeleton(diff: str) -> str:
    """``diff`` without its code: the ``---``/``+++`` file lines whole, every added or removed line as its
    sign alone. ``diffstat(skeleton(d)) == diffstat(d)`` at a few bytes a line: what history reads carry
    (`specpilot.reads.EventQuery.brief`), where every patch's text would outgrow a reply."""
    out = []
    for line in diff.splitlines():
        if line.startswith(("+++ ", "--- ")):
            out.append(line)
        elif line[:1] in ("+", "-"):
            out.append(line[0])
    return "\n".join(out)


def attempts(events: list[schema.Event]) -> list[dict[str, Any]]:
    """What was tried on a deployment, oldest first, from its direction, patch and decision events."""
    titles = {e.direction_id: e.title for e in events if isinstance(e, schema.DirectionPlanned)}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        match e:
            case schema.PatchProposed():
                out[e.patch_id] = {"patch_id": e.patch_id, "direction": titles.get(e.direction_id, e.direction_id),
                                   "options": dict(e.options), "diff": diffstat(e.diff), "decision": "undecided"}
            case schema.PatchRefused() if e.patch_id in out:
                out[e.patch_id].update(decision="refused", reason=f"{e.rule}: {e.reason}"[:MAX_REASON])
            case schema.VerdictIssued() if e.patch_id in out:
                out[e.patch_id].update(decision=e.decision, gain=round(e.gain, 4), lower_bound=round(e.lower_bound, 4),
                                       bar=round(e.bar, 4), reason=e.reason[:MAX_REASON])
            case _:
                pass
    return list(out.values())


def bundle(*, facts: dict[str, Any], best_options: dict[str, Any], attempts: list[dict[str, Any]],
           hardware: schema.HardwareMeasured | None = None, profile: schema.ProfileMeasured | None = None,
           ceiling: schema.CeilingComputed | None = None, entries: list[dict[str, Any]] = (),
           max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """The evidence, at most ``max_bytes`` of JSON (see the module docstring)."""
    out: dict[str, Any] = {"deployment": dict(facts), "best_options": dict(best_options)}
    if hardware is not None:
        out["device"] = {"name": hardware.device, "bandwidth_gb_s": round(hardware.bandwidth_bytes_s / 1e9, 1),
                         "tflop_s": round(hardware.flops_s / 1e12, 2), "launch_us": round(hardware.launch_s * 1e6, 1)}
    if profile is not None:
        classes = sorted(profile.classes_s.items(), key=lambda kv: -kv[1])
        out["profile"] = {"step_ms": round(profile.step_s * 1e3, 2), "ar_step_ms": round(profile.t_ar_s * 1e3, 2),
                          "tau": round(profile.tau, 3), "tokens_per_step": profile.n_tokens,
                          "classes_ms": {k: round(v * 1e3, 3) for k, v in classes[:MAX_CLASSES]},
                          "chain_cost": {str(k): v for k, v in profile.chain_cost.items()}}
    if ceiling is not None:
        out["ceiling"] = {"speedup": round(ceiling.ceiling_speedup, 3),
                          "factors": {k: round(v, 3) for k, v in ceiling.factors.items()},
                          "replay_tau": dict(ceiling.replay_tau), "replay_by": dict(ceiling.replay_by)}
    out["memory_entries"] = [{"entry_id": e.get("entry_id"), "title": e.get("title"), "options": e.get("options", {}),
                              "delta": diffstat(e.get("delta", ""))} for e in entries]
    kept = list(attempts)
    out["tried"] = kept
    while len(json.dumps(out, default=str)) > max_bytes and kept:
        kept.pop(0)  # the oldest attempt first
        out["tried_left_out"] = len(attempts) - len(kept)
    while len(json.dumps(out, default=str)) > max_bytes and out.get("profile", {}).get("classes_ms"):
        out["profile"]["classes_ms"].popitem()  # then the cheapest kernel class
    return out


def render(evidence: dict[str, Any]) -> str:
    """The evidence as a prompt quotes it: one JSON object, keys sorted."""
    return json.dumps(evidence, sort_keys=True, indent=1, default=str) if evidence else "none recorded yet"


def refuted(attempts: list[dict[str, Any]], option: str, value: Any, base: dict[str, Any]) -> bool:
    """Whether ``option = value`` on top of ``base`` was already timed and rejected (or refused)."""
    want = {**base, option: value}
    return any(a["decision"] in ("reject", "refused") and not a["diff"] and a["options"] == want for a in attempts)
