"""Backbone benchmark: end-to-end recording throughput and latency, and replay of a large ledger.

1. Start a local nats-server and the memory service (a separate process, as in production), publish
   N events from P publisher processes with many publishes in flight, and measure publish → committed
   latency (``recorded_ns - ts_ns`` per row) and sustained events/s (first publish to last commit).
   Then check 0 lost / 0 duplicated against the published ids.
2. Build a ledger of R events directly (batched appends) and time ``verify`` (chain check + projection
   rebuild), as ``specpilot replay`` runs it.

Prints a table and, last, one JSON line. Usage: python bench/backbone_bench.py [--events N] [--replay R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specpilot import bus, ledger, natsd, projections, schema, subjects  # noqa: E402


def _publisher(url: str, creds: str, n: int, offset: int, rate: float, out) -> None:
    async def go():
        b = await bus.connect(url, creds)
        ids = []
        batch_size = bus.ATOMIC_BATCH
        start = time.monotonic()
        for i in range(0, n, batch_size):
            if rate:  # pace to the offered load
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            batch = [schema.DirectionPlanned(direction_id=f"d-{offset + j}", title="bench")
                     for j in range(i, min(n, i + batch_size))]
            ids.extend(e.event_id for e in await b.publish_many(batch))
        await b.close()
        return ids

    out.put(asyncio.run(go()))


def recording(n: int, publishers: int, rate: float) -> dict:
    data = Path(tempfile.mkdtemp(prefix="sp-bench-"))
    srv = natsd.start(data)
    admin_creds = natsd.creds_path(data, subjects.ADMIN)

    async def prov():
        b = await bus.connect(srv.url, admin_creds)
        await bus.provision(b)
        await b.close()

    asyncio.run(prov())
    rec = subprocess.Popen([sys.executable, "-m", "specpilot.services.memory", "--data", str(data), "--nats", srv.url,
                            "--creds", str(natsd.creds_path(data, "memory"))], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    q: mp.Queue = mp.Queue()
    t0 = time.time_ns()
    procs = [mp.Process(target=_publisher, args=(srv.url, str(natsd.creds_path(data, "master")), n // publishers,
                                                 k * n, rate / publishers, q)) for k in range(publishers)]
    for p in procs:
        p.start()
    ids: list[str] = []
    for _ in procs:
        ids.extend(q.get())
    for p in procs:
        p.join()
    t_published = time.time_ns()
    total = len(ids)
    led_rows = 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        rec.terminate()
        rec.wait(timeout=30)
        led = ledger.Ledger(data, read_only=True)
        led_rows = led.count()
        if led_rows >= total:
            break
        led.close()
        rec = subprocess.Popen([sys.executable, "-m", "specpilot.services.memory", "--data", str(data), "--nats", srv.url,
                                "--creds", str(natsd.creds_path(data, "memory"))], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0)
    lat = led.con.execute(
        "SELECT quantile_cont(recorded_ns - ts_ns, [0.5, 0.99]) , max(recorded_ns), min(ts_ns), count(*), "
        "count(DISTINCT event_id) FROM events").fetchone()
    recorded_ids = {r[0] for r in led.con.execute("SELECT event_id FROM events").fetchall()}
    led.close()
    srv.stop()
    (p50, p99), last_commit, first_pub, rows, distinct = lat
    return {
        "events": total, "publishers": publishers, "offered_rate": rate, "rows": rows, "lost": len(set(ids) - recorded_ids),
        "duplicated": rows - distinct,
        "events_per_s": total / ((last_commit - first_pub) / 1e9),
        "publish_events_per_s": total / ((t_published - t0) / 1e9),
        "latency_p50_ms": p50 / 1e6, "latency_p99_ms": p99 / 1e6,
    }


def replay(n: int) -> dict:
    data = Path(tempfile.mkdtemp(prefix="sp-replay-"))
    led = ledger.Ledger(data)
    state = projections.State()
    t0 = time.perf_counter()
    chunk = 20_000
    for i in range(0, n, chunk):
        batch = []
        for j in range(i, min(n, i + chunk)):
            e = schema.DirectionPlanned(direction_id=f"d-{j}", title="replay bench", source="master")
            batch.append(ledger.Incoming(subjects.event_subject("master", e.tag), j + 1, e, schema.encode(e)))
        led.append(batch, projection=state)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = ledger.verify(led)
    verify_s = time.perf_counter() - t0
    led.close()
    return {"replay_events": n, "replay_s": verify_s, "replay_ok": res.ok and res.projections_match,
            "build_s": build_s, "db_mb": os.path.getsize(ledger.path_in(data)) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--publishers", type=int, default=1)
    ap.add_argument("--rate", type=float, default=10_000, help="offered events/s (0: as fast as possible)")
    ap.add_argument("--replay", type=int, default=1_000_000)
    args = ap.parse_args()
    console = Console(stderr=True)
    with console.status(f"recording {args.events} events"):
        rec = recording(args.events, args.publishers, args.rate)
    with console.status(f"building and replaying {args.replay} events"):
        rep = replay(args.replay)
    table = Table(title=f"backbone ({os.cpu_count()} cores)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("recorded events/s (publish → commit)", f"{rec['events_per_s']:.0f}", "≥ 10,000")
    table.add_row("publish events/s", f"{rec['publish_events_per_s']:.0f}", "")
    table.add_row("latency p50 / p99 (ms)", f"{rec['latency_p50_ms']:.1f} / {rec['latency_p99_ms']:.1f}", "")
    table.add_row("lost / duplicated", f"{rec['lost']} / {rec['duplicated']}", "0 / 0")
    table.add_row(f"replay of {rep['replay_events']:,} events (s)", f"{rep['replay_s']:.1f}", "≤ 60")
    Console().print(table)
    print(json.dumps({"bench": "backbone", **rec, **rep}))


if __name__ == "__main__":
    main()
