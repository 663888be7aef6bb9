"""Chaos across separate hosts: a round on the tiny deployment while every service and the NATS server
are SIGKILLed at random points and links are cut for 20 s each.

Each host is its own network namespace with only its own bundle and folder (`tests.netlab`, as
`tests/backbone/test_separate_hosts.py`); a supervisor (this script) restarts what it killed after a
short pause, as systemd or compose would. When the round has finished, the operator checks what matters:
the stream against the ledger message by message (`specpilot replay --stream`: every message recorded
exactly once, none lost), the hash chain, exactly one decision per patch, no patch tested twice and no
timing of a patch repeated (a re-timed trial keeps its id: ``timing-<patch>-<n>``), and a
``BestAdvanced`` and memory entry for every promotion. Prints a table and one JSON line.

    sudo .venv/bin/python bench/chaos_hosts.py [--kills 30] [--cuts 3] [--seed 0] [--json]

Needs root (network namespaces), bubblewrap, nsenter and ip.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from specpilot.schema import SERVICES  # noqa: E402
from tests.netlab import Installation, Lab, available  # noqa: E402

CONTROLLER_FLAGS = ["--trials", "2", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "120", "--threads", "1"]
UP_LINE = re.compile(r"^(\S+ \S+) \S+ INFO \S+ up on ")
console = Console(stderr=True)


def sql(inst: Installation, query: str) -> list[dict]:
    res = inst.operator("sql", "--json", query, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"specpilot sql: {res.stderr}")
    return json.loads(res.stdout)


def up_times(log: Path) -> list[float]:
    """Wall-clock times at which a service's log says it is up (one per start)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if m := UP_LINE.match(line):
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30, help="SIGKILLs during the round, spread over the five "
                                                           "services and the server (which gets at least two)")
    ap.add_argument("--cuts", type=int, default=3, help="links cut for 20 s each, the services' in turn")
    ap.add_argument("--waves", type=int, default=4, help="waves of directions in the round")
    ap.add_argument("--gap", type=float, nargs=2, default=(2.0, 8.0), metavar=("MIN", "MAX"),
                    help="seconds between kills, drawn uniformly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the hosts' folders (logs) afterwards")
    ap.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    args = ap.parse_args()
    if why := available():
        raise SystemExit(f"chaos_hosts: {why}")
    rng = random.Random(args.seed)
    victims = [*SERVICES, "server"] * (args.kills // 6 + 1)
    victims = victims[: args.kills]
    if victims.count("server") < 2:
        victims[-1] = "server"
    rng.shuffle(victims)
    cut_order = ["subagent", "controller", "memory", "forcer", "master"]
    cuts = {len(victims) * (k + 1) // (args.cuts + 1): cut_order[k % len(cut_order)] for k in range(args.cuts)}
    root = Path(tempfile.mkdtemp(prefix="chaos-hosts-"))
    kills: list[dict] = []
    with Lab(root / "hosts", ["server", *SERVICES, "operator"]) as lab:
        inst = Installation(lab, SERVICES, {"controller": CONTROLLER_FLAGS})
        inst.init()
        for name in ("server", *SERVICES):
            inst.start(name)
        try:
            if (res := inst.operator("provision", timeout=120)).returncode != 0:
                raise SystemExit(f"provision: {res.stderr}")
            t0 = time.time()
            follower = inst.operator_popen("round", "--deployment", "tiny-cpu", "--rounds", str(args.waves),
                                           "--sealed-requests", "2",
                                           "--sealed-trials", "2", "--minutes", "0", "--json", "--timeout", "3000")
            time.sleep(8)  # let the round start before the first kill
            cut_done: list[str] = []
            for i, name in enumerate(victims):
                if follower.poll() is not None:
                    console.print(f"the round finished after {i} kills")
                    break
                if i in cuts:
                    console.print(f"{time.time() - t0:6.0f}s cut {cuts[i]}'s link for 20 s")
                    lab.cut(cuts[i])
                    time.sleep(20)
                    lab.mend(cuts[i])
                    cut_done.append(cuts[i])
                time.sleep(rng.uniform(*args.gap))
                console.print(f"{time.time() - t0:6.0f}s SIGKILL {name}")
                inst.procs[name].send_signal(signal.SIGKILL)
                inst.procs[name].wait()
                killed_at = time.time()
                time.sleep(rng.uniform(1.0, 3.0))
                inst.start(name)
                kills.append({"service": name, "at_s": round(killed_at - t0, 1), "killed": killed_at})
            follower.wait(timeout=3000)
            wall = time.time() - t0
            out = (lab.root / "operator.log").read_text(errors="replace").strip().splitlines()
            result = json.loads(next(line for line in reversed(out) if line.startswith("{")))
            checks = ledger_checks(inst)
            replay = json.loads(inst.operator("replay", "--stream", "--json", timeout=600).stdout)
        finally:
            inst.stop()
        for k in kills:  # time to recover: from the kill to the restarted process saying it is up
            if k["service"] == "server":
                k["recover_s"] = None
                continue
            later = [t for t in up_times(lab.root / f"{k['service']}.log") if t > k["killed"]]
            k["recover_s"] = round(later[0] - k["killed"], 1) if later else None
    stream = replay.get("stream") or {}
    recovered = [k["recover_s"] for k in kills if k["recover_s"] is not None]
    by_service = {name: sum(k["service"] == name for k in kills) for name in (*SERVICES, "server")}
    summary = {"bench": "chaos_hosts", "seed": args.seed, "kills": len(kills), "kills_by_service": by_service,
               "link_cuts": cut_done, "stream_messages": stream.get("messages"), "events": checks["events"],
               "events_lost": len(stream.get("missing", [])) if stream else None,
               "events_twice": len(stream.get("repeated", [])) if stream else None,
               "stream_equals_ledger": stream.get("ok"), **{k: v for k, v in checks.items() if k != "events"},
               "chain_ok": replay.get("ok"), "projections_match": replay.get("projections_match"),
               "round_lossless": result.get("lossless"), "wall_s": round(wall, 1),
               "recover_s_max": max(recovered, default=None),
               "recover_s_mean": round(sum(recovered) / len(recovered), 1) if recovered else None,
               "kill_log": [{k: v for k, v in k.items() if k != "killed"} for k in kills]}
    if not args.json:
        table = Table(title=f"chaos across hosts (seed {args.seed})")
        cols = {"kills": summary["kills"], "cuts": len(cut_done), "stream msgs": summary["stream_messages"],
                "lost": summary["events_lost"], "twice": summary["events_twice"], "patches": summary["patches"],
                "undecided": summary["undecided"], "decided twice": summary["decided_twice"],
                "tested twice": summary["tested_twice"], "timings repeated": summary["timings_repeated"],
                "promotions not advanced": summary["promotions_not_advanced"],
                "chain": "ok" if summary["chain_ok"] else "BROKEN", "recover max s": summary["recover_s_max"],
                "round s": summary["wall_s"]}
        table.add_column("what")
        table.add_column("found", justify="right")
        for what, value in cols.items():
            table.add_row(what, ", ".join(value) if isinstance(value, list) else str(value))
        Console().print(table)
    print(json.dumps(summary))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return 0 if passed(summary) else 1


def passed(summary: dict) -> bool:
    """What the chaos must leave: every message recorded once, every patch decided once, nothing tested or
    timed twice, every promotion advanced, the chain whole, the round's final lossless."""
    return bool(summary["stream_equals_ledger"] and summary["chain_ok"] and summary["round_lossless"]
                and not any(summary[k] for k in ("undecided", "decided_twice", "tested_twice", "timings_repeated",
                                                 "promotions_not_advanced")))


def ledger_checks(inst: Installation) -> dict:
    """Per patch, from the ledger: decisions (verdicts and refusals), tests, candidate timings, promotions
    and their ``BestAdvanced``."""
    per_patch = sql(inst, "SELECT json_extract_string(payload, '$.patch_id') AS patch, type, count(*) AS n, "
                          "string_agg(event_id, ' ') AS ids FROM events WHERE type IN ('patch.proposed', 'verdict.issued', "
                          "'patch.refused', 'patch.tested', 'best.advanced', 'timing.measured') AND "
                          "json_extract_string(payload, '$.patch_id') != '' GROUP BY 1, 2")
    promoted = {r["patch"] for r in sql(inst, "SELECT json_extract_string(payload, '$.patch_id') AS patch FROM events "
                                              "WHERE type = 'verdict.issued' AND "
                                              "json_extract_string(payload, '$.decision') = 'promote'")}
    events = sql(inst, "SELECT count(*) AS n FROM events")[0]["n"]
    counts: dict[str, dict[str, int]] = {}
    repeated = []
    for r in per_patch:
        counts.setdefault(r["patch"], {})[r["type"]] = r["n"]
        if r["type"] == "timing.measured":  # ids timing-<patch>-<n>: one per trial attempt, n = 0, 1, ...
            ids = r["ids"].split()
            attempts = sorted(int(i.rsplit("-", 1)[-1]) for i in ids if re.search(r"-\d+$", i))
            if attempts != list(range(len(ids))):
                repeated.append(r["patch"])
    proposed = [p for p, c in counts.items() if c.get("patch.proposed")]
    decisions = {p: counts[p].get("verdict.issued", 0) + counts[p].get("patch.refused", 0) for p in proposed}
    return {"events": events, "patches": len(proposed),
            "undecided": sorted(p for p, n in decisions.items() if n == 0),
            "decided_twice": sorted(p for p, n in decisions.items() if n > 1),
            "tested_twice": sorted(p for p in proposed if counts[p].get("patch.tested", 0) > 1),
            "timings_repeated": sorted(repeated),
            "promotions_not_advanced": sorted(p for p in promoted if counts.get(p, {}).get("best.advanced", 0) != 1)}


if __name__ == "__main__":
    raise SystemExit(main())
