"""``specpilot force OUTPUTS --deployment NAME [--json]``: token forcing, run locally (no NATS).

OUTPUTS is a JSONL file (``-`` for stdin), one output per line, either token ids
``{"prompt_ids": [...], "tokens": [...]}`` (optionally ``"stock_tokens": [...]``, stock's own output
for that prompt; otherwise the stock engine generates it) or text
``{"prompt": "...", "output": "...", "chat": true}`` (tokenized with the stock tokenizer, the prompt
in the chat template when ``chat``). It runs exactly what the forcer service runs
(`forcing.Forcer.run` on the deployment's stock engine) and prints a summary table; with
``--json`` the table goes to stderr and stdout gets one JSON line
``{"passed", "reason", "stats", "audited"}``. Exit status: 0 passed, 1 rejected, 2 unusable input (an unknown deployment, a missing or malformed file).

The run itself is `specpilot.harness.forcing.force_outputs` (what the controller also runs on the sealed
outputs). `add_commands(subparsers)` registers the command; torch is imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specpilot import output
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT


def read_jsonl(path: str) -> list[dict]:
    from specpilot.errors import UserError

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not JSON: {exc}") from None
    if not rows:
        raise UserError(f"{path} holds no outputs")
    return rows


def render(report: dict, console) -> None:
    st = report["stats"]
    columns = ("run", "positions", "mismatches", "rate", "events", "audited", "unexplained")
    t = output.table(f"token forcing on {st.get('deployment', '?')} (δ = {st['delta']:.4g}, events: margin > "
                     f"{st['event_threshold']:.4g})", columns, right=columns[1:])
    for name in ("system", "stock"):
        c = st[name]
        t.add_row(name, str(c["positions"]), str(c["mismatches"]), f"{c['rate']:.2%}", str(c["events"]),
                  str(c["audited"]), str(c["unexplained"]))
    console.print(t)
    r, e = st["rate_rule"], st["event_rule"]
    console.print(f"rate rule:  {'pass' if r['passed'] else 'FAIL'}  excess {r['difference']:+.2%}, "
                  f"95% lower bound {r['lower_bound']:+.2%} vs {r['margin']:.1%} (p={r['p_value']:.3g})")
    console.print(f"event rule: {'pass' if e['passed'] else 'FAIL'}  unexplained {e['system_unexplained']} vs "
                  f"stock's {e['stock_unexplained']} (p={e['p_value']:.3g})")
    audited = report["audited"]
    if audited:
        a = output.table(f"audited events (first 20 of {len(audited)})",
                         ("prompt", "position", "system", "argmax", "margin", "stock picks", "explained"))
        for ev in audited[:20]:
            a.add_row(str(ev["prompt_index"]), str(ev["position"]), str(ev["system_token"]),
                      str(ev["argmax_token"]), f"{ev['margin']:.3f}", str(ev["stock_token"]), str(ev["explained"]))
        console.print(a)
    console.print(("[green]PASSED[/green]: " if report["passed"] else "[red]REJECTED[/red]: ") + report["reason"])


def cmd_force(args: argparse.Namespace) -> int:
    from specpilot.errors import UserError
    from specpilot.harness.deployment import load_deployment

    load_deployment(args.deployment)  # an unknown or malformed deployment fails before any file is read
    rows = read_jsonl(args.outputs)
    try:
        from specpilot.harness.forcing import force_outputs

        report = force_outputs(args.deployment, rows, args.data, args.device, args.max_audit, args.seed)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    render(report, output.console(stderr=args.json))
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if report["passed"] else 1


def add_commands(subparsers) -> None:
    from specpilot.forcing_rules import MAX_AUDITED

    help_ = "token-force a system's outputs through the stock target"
    p = subparsers.add_parser("force", help=help_, description=__doc__.split("\n\n")[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outputs", metavar="OUTPUTS", help="JSONL file of outputs ('-' for stdin)")
    p.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="deployment whose stock target forces (default: %(default)s)")
    p.add_argument("--device", default=None, help="override the deployment's device")
    p.add_argument("--max-audit", type=int, default=MAX_AUDITED,
                   help=f"events whose explanation is checked per run (default: {MAX_AUDITED})")
    p.add_argument("--seed", type=int, default=0, help="seed of the audit sample when events exceed --max-audit")
    p.add_argument("--json", action="store_true", help="print the full report as one JSON line")
    p.add_argument("--data", type=Path, default=None,
                   help="data directory holding the model cache (default: $SPECPILOT_DATA or ~/.local/share/specpilot)")
    p.set_defaults(func=cmd_force)
