"""Offline providers: no model, no network.

- ``sweep(hints, validate)``: ``hints = {"option": NAME, "values": [v1, ...], "base": {opt: val, ...},
  "joint": {repr(v): {opt: val}}}`` gives one ``Proposal`` per distinct value, with ``diff=""`` and
  ``options={**requires, NAME: v, **joint[repr(v)]}`` (``joint``, optional: the step shape the planner
  predicted a value best with). A proposal carries only its own settings (the value, ``hints.requires``
  and its pair), so the controller can lay them over whichever best it is timed against; ``base``,
  the best's settings when it was planned, is what they are validated with. Each
  option set is checked by the controller's policy and by ``validate`` (the engine's
  ``options_from_dict``: the host's by default, the workspace's in the service, since promoted patches
  may have added options); an invalid value is skipped with a log line. No valid value at all is a
  ``ProviderError``.
- ``memory(hints, workspace)``: ``hints = {"entry": {"entry_id", "delta", "options"}}``; ``delta`` is a
  diff against stock, applied to the current-best workspace with ``git apply`` (then with recounted
  hunks, then as a 3-way merge: the delta committed on stock and cherry-picked onto the current best, so a
  delta whose context a promotion changed still merges; a real conflict fails). The proposal's diff is the workspace's diff against the current best; its options are
  the entry's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from specpilot import policy
from specpilot.providers import ProviderError
from specpilot.services.subagent.workspace import (
    Workspace,
    WorkspaceError,
    merge_from_stock,
    validate_options,
)

log = logging.getLogger("subagent")

Validator = Callable[[dict], "str | None"]  # why the options are invalid, or None


@dataclass(frozen=True)
class Proposal:
    """What a provider produced: one patch (the service adds the ids and the envelope)."""

    diff: str
    options: dict = field(default_factory=dict)
    notes: str = ""


def host_validator(options: dict) -> str | None:
    """The options checked against this host's own engine (stock plus nothing)."""
    from specpilot.engine.options import options_from_dict

    try:
        options_from_dict(options)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def workspace_validator(workspace: Workspace) -> Validator:
    return lambda options: validate_options(workspace, options)


def sweep(hints: dict, validate: Validator = host_validator) -> list[Proposal]:
    option = hints.get("option")
    values = hints.get("values")
    base = hints.get("base") or {}
    joint = hints.get("joint") or {}
    requires = hints.get("requires") or {}
    if not isinstance(option, str) or not option:
        raise ProviderError("sweep needs hints.option: the name of the engine option to sweep")
    if not isinstance(values, list) or not values:
        raise ProviderError(f"sweep of {option!r} needs hints.values: a non-empty list")
    if not all(isinstance(h, dict) for h in (base, requires, joint, *joint.values())):
        raise ProviderError("sweep hints.base, hints.requires and each hints.joint value must be objects of option settings")
    out: list[Proposal] = []
    seen: list = []
    for v in values:
        if any(v == s and type(v) is type(s) for s in seen):
            continue
        seen.append(v)
        options = {**requires, option: v, **joint.get(repr(v), {})}
        refusal = policy.check("", options)
        problem = f"{refusal.rule}: {refusal.reason}" if refusal else validate({**base, **options})
        if problem:
            log.warning("sweep of %s: skipping %r: %s", option, v, problem)
            continue
        paired = "".join(f", {k}={x!r}" for k, x in joint.get(repr(v), {}).items())
        out.append(Proposal(diff="", options=options, notes=f"sweep {option}={v!r}{paired}"))
    if not out:
        raise ProviderError(f"sweep of {option!r}: none of {values!r} is a valid value")
    return out


def memory(hints: dict, workspace: Workspace) -> Proposal:
    entry = hints.get("entry")
    if not isinstance(entry, dict):
        raise ProviderError("memory needs hints.entry: {entry_id, delta, options} of an accepted entry")
    entry_id = str(entry.get("entry_id", ""))
    delta = entry.get("delta") or ""
    options = entry.get("options") or {}
    if not isinstance(delta, str) or not isinstance(options, dict):
        raise ProviderError(f"memory entry {entry_id!r}: delta must be a diff and options an object")
    delta = policy.current_paths(delta)  # an entry recorded by SpecPilot 0.2 names its old folders
    if refusal := policy.check(delta, options):
        raise ProviderError(f"memory entry {entry_id!r} breaks the policy ({refusal.rule}): {refusal.reason}")
    try:
        how = merge_from_stock(workspace.path, delta)
    except WorkspaceError as exc:
        raise ProviderError(f"memory entry {entry_id!r} does not apply to the current best: {exc}") from exc
    if problem := validate_options(workspace, options):
        raise ProviderError(f"memory entry {entry_id!r}: its options are not valid here: {problem}")
    diff = workspace.diff()
    notes = f"memory entry {entry_id} applied ({how})" + ("; already part of the current best" if not diff else "")
    return Proposal(diff=diff, options=dict(options), notes=notes)
