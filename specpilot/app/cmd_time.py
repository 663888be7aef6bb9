"""``specpilot time PATCH --deployment NAME``: the controller's whole evaluation of one patch, run locally.

The same code as the service (policy, sandboxed default check, stock-versus-stock noise, paired ABBA
timing, forcing when outputs differ, the promotion rule) without NATS: events are printed instead of
published, and forcing runs in this process. The data directory keeps the systems repository and the
model cache between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from specpilot import paths, schema
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT


def add_commands(sub) -> None:
    p = sub.add_parser("time", help="evaluate a patch like the controller does (policy, tests, timing, verdict)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("patch", type=Path, help="a unified diff (git diff format) against specpilot_engine/ and specpilot_kernels/; "
                                            "use /dev/null for options only")
    p.add_argument("--deployment", default=DEFAULT_DEPLOYMENT)
    p.add_argument("--options", default="{}", help='JSON engine options the patch enables, e.g. \'{"verify": "tree"}\'')
    p.add_argument("--trials", type=int, default=None, help="ABBA trials (default: the controller's)")
    p.add_argument("--requests", type=int, default=4, help="timing requests from the dev split")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", type=Path, default=None, help="data directory (systems repository, model cache)")
    p.add_argument("--json", action="store_true", help="print the events as JSON lines, the verdict last")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specpilot.services.controller.main import Controller

    options = json.loads(args.options)
    diff = args.patch.read_text()
    data = Path(args.data or paths.default_data_dir())
    kw = {"n_requests": args.requests, "max_new_tokens": args.max_new_tokens}
    if args.trials:
        kw["trials"] = args.trials
    ctl = Controller(data, None, device=args.device, evaluator_kw=kw)
    patch = schema.PatchProposed(direction_id="cli", patch_id=f"cli-{schema.new_event_id()[:13]}", diff=diff,
                                 options=options, deployment=args.deployment, source="subagent")
    console = Console(stderr=True)
    with console.status("evaluating (noise, default check, paired timing)"):
        asyncio.run(ctl.handle_patch(patch))
    if args.json:
        for e in ctl.events:
            print(schema.encode(e).decode())
        return 0
    table = Table(title=f"patch {args.patch} on {args.deployment}")
    for c in ("event", "summary"):
        table.add_column(c)
    for e in ctl.events:
        d = json.loads(schema.encode(e))
        for k in ("event_id", "ts_ns", "round_id", "deployment", "source", "causation_id", "correlation_id", "type"):
            d.pop(k, None)
        table.add_row(e.tag, json.dumps(d)[:160])
    Console().print(table)
    verdict = next((e for e in reversed(ctl.events) if isinstance(e, schema.VerdictIssued | schema.PatchRefused)), None)
    return 0 if isinstance(verdict, schema.VerdictIssued) else 2
