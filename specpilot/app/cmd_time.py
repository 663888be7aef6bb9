"""``specpilot time PATCH --deployment NAME``: the controller's whole evaluation of one patch, run locally.

The same code as the service (policy, sandboxed default check, stock-versus-stock noise, paired ABBA
timing, forcing when outputs differ, the promotion rule) without NATS: events are printed instead of
published, and forcing runs in this process. The data directory keeps the systems repository and the
model cache between runs.

Input is checked before anything starts: a missing patch file, ``--options`` that are not a JSON object,
an unknown deployment, a patch that is empty with no options (nothing to time), or, when the patch does
not touch `engine/options.py` (so it cannot add options), an option the engine does not have.
Exit status: 0 promoted, 1 rejected, 2 refused by the policy or bad input (`specpilot.output`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from specpilot import output, paths, policy, schema
from specpilot.errors import UserError, json_object, positive_int
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, load_deployment

OPTIONS_MODULE = "engine/options.py"  # where a patch would add options


def add_commands(sub) -> None:
    p = sub.add_parser("time", help="evaluate a patch like the controller does (policy, tests, timing, verdict)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("patch", type=Path, help="a unified diff (git diff format) against engine/ and kernels/; "
                                            "use /dev/null for options only")
    p.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    p.add_argument("--options", type=json_object, default="{}", help='JSON engine options the patch enables, e.g. \'{"verify": "tree"}\'')
    p.add_argument("--trials", type=positive_int, default=None, help="ABBA trials (default: the controller's)")
    p.add_argument("--requests", type=positive_int, default=4, help="timing requests from the dev split")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", type=Path, default=None, help="data directory (systems repository, model cache)")
    p.add_argument("--json", action="store_true", help="print the events as JSON lines, the verdict last")
    p.set_defaults(func=run)


def read_patch(args: argparse.Namespace) -> schema.PatchProposed:
    """The patch and options of the command line, checked as the module docstring says."""
    try:
        diff = args.patch.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the patch {args.patch}: {exc}") from None
    options = args.options  # a JSON object (`json_object`)
    deployment = load_deployment(args.deployment)
    if not diff.strip() and not options:
        raise UserError(f"nothing to time: {args.patch} is empty and no --options were given")
    if OPTIONS_MODULE not in policy.touched_paths(diff):
        try:
            deployment.check_options(options)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return schema.PatchProposed(direction_id="cli", patch_id=f"cli-{schema.new_event_id()[:13]}", diff=diff,
                                options=options, deployment=args.deployment, source="subagent")


def run(args: argparse.Namespace) -> int:
    from specpilot import canary
    from specpilot.services.controller.main import Controller

    patch = read_patch(args)
    data = Path(args.data or paths.default_data_dir())
    canary.require(data, what="the patch (its default check and timing workers)")  # fail closed: exit 2
    kw = {"n_requests": args.requests, "max_new_tokens": args.max_new_tokens}
    if args.trials:
        kw["trials"] = args.trials
    ctl = Controller(data, None, device=args.device, evaluator_kw=kw)
    with output.console(stderr=True).status("evaluating (noise, default check, paired timing)"):
        asyncio.run(evaluate(ctl, patch))
    if args.json:
        for e in ctl.events:
            print(schema.encode(e).decode())
    else:
        table = output.table(f"patch {args.patch} on {args.deployment}", ("event", "summary"))
        for e in ctl.events:
            d = json.loads(schema.encode(e))
            for k in ("event_id", "ts_ns", "round_id", "deployment", "source", "causation_id", "correlation_id", "type"):
                d.pop(k, None)
            table.add_row(e.tag, json.dumps(d))
        output.console().print(table)
    return exit_status(ctl.events)


async def evaluate(ctl, patch: schema.PatchProposed) -> None:
    await ctl.restore()  # what earlier `specpilot time` runs on this data directory measured (noise, best)
    await ctl.handle(patch)


def exit_status(events: list[schema.Event]) -> int:
    """0 promoted, 1 rejected, 2 refused (the last decision among ``events``)."""
    decision = next((e for e in reversed(events) if isinstance(e, schema.VerdictIssued | schema.PatchRefused)), None)
    if isinstance(decision, schema.VerdictIssued):
        return output.EXIT_OK if decision.decision == "promote" else output.EXIT_REJECTED
    if isinstance(decision, schema.PatchRefused):
        output.error_line(f"refused by the policy ({decision.rule}): {decision.reason}")
    return output.EXIT_BAD_INPUT
