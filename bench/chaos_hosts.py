"""Chaos across separate hosts: a round on the tiny deployment while every service (and the NATS server,
twice) is SIGKILLed at random points and one service's link is cut for 20 s.

Each host is its own network namespace with only its own bundle and folder (`tests.netlab`, as
`tests/backbone/test_separate_hosts.py`); a supervisor (this script) restarts what it killed after a
short pause, as systemd or compose would. When the round has finished, the operator's queries check
that the ledger holds every event once, the hash chain verifies, and every patch has exactly one
decision. Prints a table and one JSON line: kills, events, lost, duplicated, seconds to recover.

    sudo .venv/bin/python bench/chaos_hosts.py [--kills 12] [--seed 0] [--json]

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
    ap.add_argument("--kills", type=int, default=12, help="SIGKILLs during the round (the server gets two)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cut", default="subagent", help="the service whose link is cut for 20 s")
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
            follower = inst.operator_popen("round", "--deployment", "tiny-cpu", "--rounds", "2", "--sealed-requests", "2",
                                           "--sealed-trials", "2", "--minutes", "0", "--json", "--timeout", "3000")
            time.sleep(8)  # let the round start before the first kill
            cut_at = len(victims) // 2
            for i, name in enumerate(victims):
                if follower.poll() is not None:
                    console.print(f"the round finished after {i} kills")
                    break
                if i == cut_at:
                    console.print(f"{time.time() - t0:6.0f}s cut {args.cut}'s link for 20 s")
                    lab.cut(args.cut)
                    time.sleep(20)
                    lab.mend(args.cut)
                time.sleep(rng.uniform(3.0, 12.0))
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
            rows = sql(inst, "SELECT type, count(*) AS n, count(DISTINCT event_id) AS distinct_ids FROM events GROUP BY type")
            decided = sql(inst, "SELECT json_extract_string(payload, '$.patch_id') AS patch, count(*) AS n FROM events "
                                "WHERE type IN ('verdict.issued', 'patch.refused') GROUP BY 1")
            proposed = sql(inst, "SELECT DISTINCT json_extract_string(payload, '$.patch_id') AS patch FROM events "
                                 "WHERE type = 'patch.proposed'")
            replay = json.loads(inst.operator("replay", "--json", timeout=300).stdout)
        finally:
            inst.stop()
        for k in kills:  # time to recover: from the kill to the restarted process saying it is up
            if k["service"] == "server":
                k["recover_s"] = None
                continue
            later = [t for t in up_times(lab.root / f"{k['service']}.log") if t > k["killed"]]
            k["recover_s"] = round(later[0] - k["killed"], 1) if later else None
    events = sum(r["n"] for r in rows)
    duplicated = sum(r["n"] - r["distinct_ids"] for r in rows)
    counts = {d["patch"]: d["n"] for d in decided}
    lost = [p["patch"] for p in proposed if p["patch"] not in counts]
    twice = [p for p, n in counts.items() if n > 1]
    recovered = [k["recover_s"] for k in kills if k["recover_s"] is not None]
    summary = {"bench": "chaos_hosts", "kills": len(kills), "server_kills": sum(k["service"] == "server" for k in kills),
               "link_cut": args.cut, "events": events, "duplicated_events": duplicated, "patches": len(proposed),
               "verdicts_lost": len(lost), "verdicts_twice": len(twice), "chain_ok": replay.get("ok"),
               "projections_match": replay.get("projections_match"), "round_lossless": result.get("lossless"),
               "wall_s": round(wall, 1), "recover_s_max": max(recovered, default=None),
               "recover_s_mean": round(sum(recovered) / len(recovered), 1) if recovered else None,
               "kill_log": [{k: v for k, v in k.items() if k != "killed"} for k in kills]}
    if not args.json:
        table = Table(title=f"chaos across hosts (seed {args.seed})")
        for col in ("kills", "server kills", "events", "duplicated", "verdicts lost", "verdicts twice", "chain",
                    "recover max s", "round s"):
            table.add_column(col)
        table.add_row(str(summary["kills"]), str(summary["server_kills"]), str(events), str(duplicated), str(len(lost)),
                      str(len(twice)), "ok" if summary["chain_ok"] else "BROKEN", str(summary["recover_s_max"]),
                      str(summary["wall_s"]))
        Console().print(table)
    print(json.dumps(summary))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    ok = summary["chain_ok"] and not duplicated and not lost and not twice and summary["round_lossless"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
