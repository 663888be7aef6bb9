"""The checks a candidate passes before it is timed, and the completeness rule every timed answer meets.

`default_check` applies a patch on the best commit (merged 3-way when the patch was written on an
earlier best: `Systems.integrate`; its option *changes* from that base go over the best's options),
then in sandboxes: the candidate with the *best's*
options must emit the best's reference tokens exactly (new code is off by default: an option's
default reproduces stock), and the candidate with its own options must start and answer.
`incomplete` (pure) says why an answer is not whole: an answer runs to ``max_new_tokens`` or ends on a
stop token, because returning less (lazily, truncated) is less work, not more speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specpilot import schema
from specpilot.sandbox import WorkerFailed
from specpilot.services.controller.systems import PatchDoesNotApply
from specpilot.services.controller.workers import System

if TYPE_CHECKING:
    from specpilot.services.controller.evaluate import Evaluator


def default_check(ev: Evaluator, patch: schema.PatchProposed, best: System,
                  base_options: dict | None = None) -> tuple[dict, System | None]:
    """Apply and check a patch; returns the `schema.PatchTested` fields and the candidate (None if it failed).

    ``base_options``: the options of the system the patch was written on (the best's when None)."""
    base = best.options if base_options is None else base_options
    moved = bool(patch.base_commit) and ev.systems.resolve(patch.base_commit) not in (None, best.commit)
    integrated = {"integrated_onto": best.commit} if moved else {}
    try:
        commit = ev.systems.integrate(best.commit, patch.base_commit, patch.diff,
                                      f"candidate {patch.patch_id}: {patch.direction_id}")
    except PatchDoesNotApply as exc:
        return {"passed": False, "detail": str(exc), **integrated}, None
    changes = {k: v for k, v in patch.options.items() if k not in base or base[k] != v}
    candidate = System(commit, {**best.options, **changes})
    integrated["options"] = dict(candidate.options)
    try:
        defaults, _ = ev.workers.run(System(commit, best.options), ev.prompts())
    except WorkerFailed as exc:
        return {"passed": False, "detail": f"candidate with default options failed: {exc}",
                "sandbox": ev.workers.last_sandbox, **integrated}, None
    info = ev.workers.last_sandbox  # the default check's sandbox (reference() may start another)
    identical = defaults == ev.reference(best)
    if not identical:
        return {"passed": False, "default_outputs_identical": False, "sandbox": info, **integrated,
                "detail": "with default options the candidate's tokens differ from the incumbent's: "
                          "new behaviour must be off unless its option is set"}, None
    try:
        ev.workers.run(candidate, ev.prompts()[:1])
    except WorkerFailed as exc:
        return {"passed": False, "default_outputs_identical": True, "sandbox": info, **integrated,
                "detail": f"candidate with its options failed: {exc}"}, None
    return {"passed": True, "default_outputs_identical": True, "sandbox": info, **integrated,
            "detail": "default check passed; candidate runs with its options"
                      + (f" (integrated onto the best {best.commit[:12]}, past its base)" if moved else "")}, candidate


def incomplete(outputs: list[list[int]], reference: list[list[int]], stop_ids: set[int], max_new_tokens: int) -> str:
    """Why some output is not a whole answer ('' if all are).

    ``stop_ids`` are the target's own stop tokens; any token a reference itself ended on early counts
    too (a candidate whose outputs differ may stop on a token no reference happened to end with)."""
    stops = set(stop_ids) | {r[-1] for r in reference if r and len(r) < max_new_tokens}
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        if len(out) != max_new_tokens and not (out and out[-1] in stops) and out != ref:
            return f"output {i} is incomplete: {len(out)} tokens, not {max_new_tokens} and no stop token at the end"
    return ""
