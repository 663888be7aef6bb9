"""Benchmark: every drafter, chain and tree, on one deployment: tau, c, tokens/s and speedup over AR.

Runs `specpilot bench` (``python -m specpilot.app.cmd_bench``) once per (drafter, verification) in a fresh
process each, on the same dev requests, and collects its figures: ``tau`` and ``c`` at the draft
length ``--n`` (for a tree: its depth, with ``--tree-nodes`` nodes), and the end-to-end speedup
over AR with its 95% interval (AR and the system alternate request by request, ABBA). Prints a
table and, last, one JSON line with every row and the tree's tau gain over the chain per drafter.

    python bench/drafter_table.py --deployment smollm2-cpu --limit 8 --max-new-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
DRAFTERS = ("ngram", "parallel", "eagle")


def bench_row(args: argparse.Namespace, drafter: str, verify: str) -> dict:
    cmd = [sys.executable, "-m", "specpilot.app.cmd_bench", "--deployment", args.deployment, "--limit", str(args.limit),
           "--max-new-tokens", str(args.max_new_tokens), "--ns", str(args.n), "--drafter", drafter,
           "--verify", verify, "--no-peer", "--no-profile", "--no-plots", "--out", str(args.out / f"{drafter}-{verify}")]
    if verify == "tree":
        cmd += ["--tree-nodes", str(args.tree_nodes)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = next(r for r in result["sweep"]["rows"] if r["n"] == args.n)
    e2e = result["e2e"]
    return {"drafter": drafter, "verify": verify, "n": args.n, "tau": row["tau"], "c": row["c"], "S": row["S"],
            "tok_s": e2e["sys_tok_s"], "ar_tok_s": e2e["ar_tok_s"], "speedup": e2e["speedup"], "ci95": e2e["ci95"],
            "identical_outputs": e2e["identical_outputs"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default="smollm2-cpu")
    ap.add_argument("--limit", type=int, default=8, help="dev requests")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=4, help="draft length (chain) or depth (tree)")
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: the deployment's")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/drafter_table"), help="folder for each run's bench.json")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    rows = []
    for drafter in args.drafters.split(","):
        for verify in ("chain", "tree"):
            with console.status(f"{drafter} {verify}"):
                rows.append(bench_row(args, drafter, verify))
            r = rows[-1]
            console.print(f"{drafter:8s} {verify:5s} tau {r['tau']:.3f} c {r['c']:.2f} speedup {r['speedup']:.2f}")
    table = Table(title=f"{args.deployment}: {args.limit} dev requests x {args.max_new_tokens} tokens, "
                        f"n = {args.n}, tree of {args.tree_nodes} nodes")
    for col in ("drafter", "verify", "tau", "c", "tok/s (AR)", "speedup over AR (95% CI)", "same tokens"):
        table.add_column(col, justify="left" if col in ("drafter", "verify") else "right")
    for r in rows:
        table.add_row(r["drafter"], r["verify"], f"{r['tau']:.3f}", f"{r['c']:.2f}",
                      f"{r['tok_s']:.1f} ({r['ar_tok_s']:.1f})",
                      f"{r['speedup']:.2f} ({r['ci95'][0]:.2f}-{r['ci95'][1]:.2f})", f"{r['identical_outputs']:.0%}")
    Console().print(table)
    by = {(r["drafter"], r["verify"]): r for r in rows}
    tree_gain = {d: by[d, "tree"]["tau"] / by[d, "chain"]["tau"] - 1 for d in args.drafters.split(",")}
    print(json.dumps({"bench": "drafter_table", "deployment": args.deployment, "limit": args.limit,
                      "max_new_tokens": args.max_new_tokens, "n": args.n, "tree_nodes": args.tree_nodes,
                      "rows": rows, "tree_tau_gain": tree_gain}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
