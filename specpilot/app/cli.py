"""specpilot: bring the services up and down, and read the ledger.

Every command takes ``--data DIR`` (default: ``$SPECPILOT_DATA`` or ``~/.local/share/specpilot``) and,
to reach a server on another host, ``--bundle DIR`` (the admin's bundle from ``specpilot init``) and
``--nats URL``. Reads (``sql``, ``audit``, ``replay``,
``export``) go through the memory service when it runs, and open the DuckDB file directly when it
does not. The long commands live in modules of their own beside this one (``cmd_round``, ``cmd_time``,
``cmd_force``, ``cmd_bench``, ``cmd_w12``), each registering itself through ``add_commands(subparsers)``
and imported only when its command runs. Every failure is one line on stderr and an exit code
(`specpilot.output`); this is the app layer, above every service (docs/DESIGN.md §1, §11).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from specpilot import __version__, bundles, bus, ledger, natsd, output, paths, subjects
from specpilot.bundles import Bundle
from specpilot.errors import UserError
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT
from specpilot.layout import RUNTIME_FOLDERS
from specpilot.schema import SERVICES
from specpilot.service import add_connection_flags

console = output.console(stderr=True)
out = output.console()


# --- connection helpers --------------------------------------------------------------------------


def data_dir(args: argparse.Namespace) -> Path:
    data = Path(args.data or paths.default_data_dir())
    if data.exists() and not data.is_dir():
        raise UserError(f"--data {data} is a file, not a data directory: give a folder (it is created if missing)")
    return data


def server_url(args: argparse.Namespace) -> str | None:
    """``--nats``, else the local server of ``--data``, else the URL in ``--bundle``'s bundle."""
    if args.nats:
        return args.nats
    if args.bundle is None:
        server = natsd.running(data_dir(args))
        return server.url if server else None
    return Bundle.load(args.bundle, expect=subjects.ADMIN).nats or None


async def admin_bus(args: argparse.Namespace) -> bus.Bus:
    url = server_url(args)
    if url is None:
        raise UserError(f"no NATS server is running for {data_dir(args)}: run `specpilot up` first, or pass "
                        "--bundle DIR (the admin's bundle) for a server on another host")
    bundle = Bundle.load(args.bundle or bundles.bundle_path(data_dir(args), subjects.ADMIN), expect=subjects.ADMIN)
    return await bus.connect(url, bundle, name="specpilot-cli", connect_timeout_s=args.connect_timeout)


async def call_memory(args: argparse.Namespace, subject: str, payload: dict, timeout: float = 120) -> dict | None:
    """Ask the memory service; None when no server or no memory service answers."""
    if server_url(args) is None:
        return None
    b = await admin_bus(args)
    try:
        return await b.request(subject, payload, timeout=timeout)
    except bus.BusError as exc:
        if "no service answers" in str(exc):
            return None
        raise
    finally:
        await b.close()


# --- process management --------------------------------------------------------------------------


def pid_file(data: Path, name: str) -> Path:
    return data / "run" / f"{name}.pid"


def start_service(data: Path, name: str, url: str, extra: list[str] | None = None) -> subprocess.Popen:
    (data / "logs").mkdir(parents=True, exist_ok=True)
    (data / "run").mkdir(parents=True, exist_ok=True)
    log = open(data / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", f"specpilot.services.{name}", "--data", str(data), "--nats", url,
         "--bundle", str(bundles.bundle_path(data, name)), *(extra or [])],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        cwd=paths.REPO_ROOT,
    )
    log.close()
    pid_file(data, name).write_text(str(proc.pid))
    return proc


async def discover(args: argparse.Namespace, timeout: float = 0.75) -> list[dict]:
    b = await admin_bus(args)
    try:
        return await b.discover(timeout)
    finally:
        await b.close()


async def provision(args: argparse.Namespace) -> None:
    b = await admin_bus(args)
    try:
        await bus.provision(b)
    finally:
        await b.close()


def ensure_up(args: argparse.Namespace, extra_flags: dict[str, list[str]] | None = None,
              timeout: float = 60.0) -> natsd.LocalServer:
    """Start the local server and every service that does not answer; return when all answer.

    ``extra_flags``: per service, flags for a service this call starts (a running one keeps its own). The
    controller and subagent run agent code, so the sandbox is proved first on this host (`canary.require`):
    without one nothing starts (`SandboxUnavailable`, exit 2)."""
    from specpilot import canary

    data = data_dir(args)
    data.mkdir(parents=True, exist_ok=True)
    canary.require(data, what="agent code (the controller's candidates, the subagents' tests)")
    server = natsd.running(data)
    if server is None:
        with console.status("starting nats-server"):
            server = natsd.start(data, detach=True)
    args.nats = server.url
    asyncio.run(provision(args))
    found = {s["name"] for s in asyncio.run(discover(args))}
    procs = {}
    for name in SERVICES:
        if name not in found:
            procs[name] = start_service(data, name, server.url, (extra_flags or {}).get(name))
    deadline = time.monotonic() + timeout
    with console.status("waiting for services to answer"):
        while True:
            found = {s["name"] for s in asyncio.run(discover(args))}
            if set(SERVICES) <= found:
                break
            for name, p in procs.items():
                if p.poll() is not None:
                    last = (data / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
                    raise UserError(f"service {name} exited with code {p.returncode} ({last[0][:300] if last else 'no log'})"
                                    f"; see {data}/logs/{name}.log")
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(set(SERVICES) - found))
                raise UserError(f"services did not answer within {timeout:.0f} s: {missing}; see {data}/logs/")
            time.sleep(0.2)
    return server


def cmd_up(args: argparse.Namespace) -> int:
    server = ensure_up(args, timeout=args.timeout)
    console.print(f"[green]up[/green]: NATS at {server.url}, data in {data_dir(args)}")
    return cmd_status(args)


def cmd_status(args: argparse.Namespace) -> int:
    url = server_url(args)  # once: with --bundle it loads and checks the bundle
    services = [] if url is None else asyncio.run(discover(args))
    rows = []
    for s in services:
        meta = s.get("metadata") or {}  # the version handshake's announcement (specpilot.handshake)
        rows.append({"name": s.get("name"), "version": meta.get("version") or s.get("version"),
                     "host": meta.get("host", ""), "stock_tree": meta.get("stock_tree", ""), "id": s.get("id"),
                     "description": s.get("description", ""), "state": meta.get("recording", ""),
                     "endpoints": [e.get("subject") for e in s.get("endpoints") or []]})
    if args.json:
        print(json.dumps(rows))
        return 0
    table = output.table(f"SpecPilot services ({url or 'no server running'})",
                         ("name", "host", "version", "stock tree", "id", "state", "endpoints"))
    for r in rows:
        state = f"[red]{r['state']}[/red]" if r["state"].startswith("paused") else r["state"]
        table.add_row(r["name"], r["host"], r["version"], r["stock_tree"], r["id"], state, ", ".join(r["endpoints"]))
    out.print(table)
    missing = set(SERVICES) - {r["name"] for r in rows}
    if url is None:
        console.print(f"no NATS server is running for {data_dir(args)}: start everything with `specpilot up`")
    elif missing:
        console.print(f"[yellow]not answering[/yellow]: {', '.join(sorted(missing))}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """Write the CA and one bundle per host without starting anything (compose, separate hosts)."""
    data = data_dir(args)
    host, _, port = args.listen.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--listen must be HOST:PORT such as 0.0.0.0:4222, got {args.listen!r}")
    hosts = tuple(args.host or ()) + bundles.DEFAULT_HOSTS
    where = bundles.create(data, hosts=hosts, port=int(port), renew=args.renew, listen=host or "0.0.0.0")
    table = output.table(f"bundles in {where} (copy each host its own folder, nothing else)", ("bundle", "for"))
    for name in (bundles.SERVER, *bundles.CLIENTS):
        table.add_row(name, {bundles.SERVER: f"the NATS server: `specpilot server --bundle DIR` ({args.listen})",
                             subjects.ADMIN: "the operator's CLI: --bundle DIR"}.get(
                                 name, f"`python -m specpilot.services.{name} --bundle DIR --data OWN_DIR`"))
    out.print(table)
    out.print(f"clients dial {hosts[0]}:{port}; the CA's key stays in {bundles.pki_dir(data)}")
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """Run nats-server in the foreground from a server bundle (this process becomes the server)."""
    data = data_dir(args)
    natsd.serve(args.bundle or bundles.bundle_path(data, bundles.SERVER), args.store or data / "nats")
    return 0


def cmd_provision(args: argparse.Namespace) -> int:
    asyncio.run(provision(args))
    out.print("stream and consumers ready")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    data = data_dir(args)
    for name in SERVICES:
        pf = pid_file(data, name)
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pf.read_text()), signal.SIGTERM)
    deadline = time.monotonic() + 15
    for name in SERVICES:
        pf = pid_file(data, name)
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = int(pf.read_text())
            while natsd.pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if natsd.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            pf.unlink()
    server = natsd.running(data)
    if server:
        server.stop()
    console.print(f"down: {data}")
    return 0


# --- ledger reads ----------------------------------------------------------------------------------


def ledger_call(args: argparse.Namespace, subject: str, payload: dict, local) -> dict:
    reply = asyncio.run(call_memory(args, subject, payload))
    if reply is not None:
        return reply
    led = ledger.Ledger(data_dir(args), read_only=True)
    try:
        return local(led)
    finally:
        led.close()


def cmd_sql(args: argparse.Namespace) -> int:
    res = ledger_call(args, subjects.RPC_SQL, {"query": args.query}, lambda led: led.query_readonly(args.query))
    if args.json:
        print(json.dumps([dict(zip(res["columns"], r, strict=True)) for r in res["rows"]]))
        return 0
    table = output.table(None, res["columns"])
    for r in res["rows"]:
        table.add_row(*(str(v) for v in r))
    out.print(table)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from specpilot import schema

    res = ledger_call(args, subjects.RPC_AUDIT, {"event_id": args.event_id},
                      lambda led: {"events": [schema.encode(e).decode() for e in led.audit(args.event_id)]})
    events = [json.loads(e) for e in res["events"]]
    if args.json:
        print(json.dumps(events))
        return 0
    table = output.table(f"causal trail of {args.event_id}", ("event_id", "type", "source", "causes", "summary"))
    skip = {"event_id", "type", "source", "causation_id", "ts_ns", "correlation_id", "round_id", "deployment"}
    for e in events:
        summary = {k: v for k, v in e.items() if k not in skip}
        table.add_row(e["event_id"], e["type"], e["source"], e.get("causation_id", ""), json.dumps(summary))
    out.print(table)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    if args.rebuild:
        return rebuild(args)
    res = ledger_call(args, subjects.RPC_REPLAY, {}, lambda led: ledger.verify(led).as_dict())
    if args.stream:
        res["stream"] = asyncio.run(against_stream(args)).as_dict()
    if args.json:
        print(json.dumps(res))
    elif not res["ok"]:
        console.print(f"[red]tampered[/red]: first bad sequence {res['first_bad_seq']} "
                      f"(position {res['first_bad_pos']}): {res['reason']}")
    elif not res["projections_match"]:
        console.print(f"[red]projections differ[/red] from the log: {res['projection_diff']}")
    elif res.get("projections_stale"):
        console.print(f"[green]ok[/green]: {res['rows']} events, chain intact; projections not compared: {res['reason']}")
    else:
        console.print(f"[green]ok[/green]: {res['rows']} events, chain intact, projections rebuilt identical")
    if (seen := res.get("stream")) is not None and not args.json:
        console.print((f"[green]stream = ledger[/green]: each of {seen['messages']} messages recorded once"
                       f" ({seen['dead']} dead-lettered)") if seen["ok"] else
                      f"[red]stream and ledger differ[/red]: lost sequences {seen['missing']}, events the stream "
                      f"holds twice {seen['repeated']}, ledger rows not in the stream {seen['strays']}")
    return 0 if res["ok"] and res["projections_match"] and res.get("stream", {"ok": True})["ok"] else 1


async def against_stream(args: argparse.Namespace):
    """The ledger (through the memory service, or the file) against the stream, message by message."""
    from specpilot.services.memory import logic

    def rows(table: str) -> list[list]:
        out, last = [], -1
        while True:  # in pages: one `sql` reply holds at most 10,000 rows
            text = ledger.sequences_query(table, last)
            page = ledger_call(args, subjects.RPC_SQL, {"query": text}, lambda led, q=text: led.query_readonly(q))["rows"]
            out += page
            if len(page) < 10_000:
                return out
            last = page[-1][0]

    recorded = dict(await asyncio.to_thread(rows, "events"))
    dead = {r[0] for r in await asyncio.to_thread(rows, "dead_letters")}
    b = await admin_bus(args)
    try:
        return logic.check_stream([m async for m in bus.raw_stream_messages(b)], recorded, dead)
    finally:
        await b.close()


def rebuild(args: argparse.Namespace) -> int:
    """Rebuild the ledger from the JetStream stream (the memory service must be down), recording exactly
    as the memory service does (`specpilot.services.memory.main.rebuild`)."""
    from specpilot.services.memory import main as memory

    data = data_dir(args)
    path = ledger.path_in(data)
    if path.exists():
        aside = path.with_suffix(f".broken-{int(time.time())}")
        path.rename(aside)
        console.print(f"moved the old ledger aside to {aside}")
    led = ledger.Ledger(data)

    async def go() -> int:
        b = await admin_bus(args)
        try:
            return await memory.rebuild(led, bus.raw_stream_messages(b))
        finally:
            await b.close()

    n = asyncio.run(go())
    led.close()
    console.print(f"rebuilt {path} from {n} stream messages")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.system:
        from specpilot.harness.deployment import load_deployment
        from specpilot.services.controller.systems import export_system

        load_deployment(args.deployment)  # an unknown deployment is an error, not an export of stock
        if args.nats or args.bundle:  # the controller is on another host: its best crosses over NATS
            res = export_system_over_nats(args, Path(args.system).resolve())
        else:
            res = export_system(data_dir(args), args.deployment, Path(args.system).resolve(),
                                lambda commit: promoted_options(args, args.deployment, commit))
        out.print(f"best system of {res['deployment']} ({res['commit'][:12]}, options {res['options']}) "
                  f"written to {res['dir']}")
        return 0
    if not args.parquet:
        raise UserError("say what to export: --parquet DIR (the ledger) or --system DIR (the final system)")
    dest = Path(args.parquet).resolve()
    res = ledger_call(args, subjects.RPC_EXPORT, {"dir": str(dest)},
                      lambda led: {"files": [str(p) for p in led.export_parquet(dest)]})
    for f in res["files"]:
        out.print(f)
    return 0


def export_system_over_nats(args: argparse.Namespace, dest: Path) -> dict:
    """``export --system`` from the controller's ``system`` RPC: its diff applied to this checkout's stock
    and checked against its trees, then written as `export_system` writes it."""
    import shutil
    import tempfile

    from specpilot.services.controller.systems import export_destination, write_export
    from specpilot.services.subagent.workspace import build_workspace

    dest = export_destination(dest)

    async def ask() -> dict:
        b = await admin_bus(args)
        try:
            return await b.request(subjects.RPC_SYSTEM, {"deployment": args.deployment}, timeout=60)
        finally:
            await b.close()

    reply = asyncio.run(ask())
    diff = reply.get("diff", "")
    with tempfile.TemporaryDirectory(prefix="sp-export-") as tmp:
        ws = build_workspace(paths.REPO_ROOT, [("the controller's best", diff)] if diff else [], Path(tmp) / "ws",
                             trees=reply.get("trees") or {})
        for root in RUNTIME_FOLDERS:
            shutil.copytree(ws / root, dest / root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    write_export(dest, diff, reply.get("options") or {})
    return {"deployment": args.deployment, "commit": reply.get("commit") or reply.get("stock") or "stock", "dir": str(dest),
            "options": reply.get("options") or {}}


def promoted_options(args: argparse.Namespace, deployment: str, commit: str) -> dict:
    """The options ``commit`` was promoted with, from the ledger (the memory service, else the file), else
    from the controller's local log (`specpilot time`); {} when neither knows the commit."""
    from specpilot import reads, schema
    from specpilot.services.controller.emit import LocalEmitter

    q = reads.query(schema.BestAdvanced, deployment=deployment, commit=commit, last=1)
    with contextlib.suppress(ledger.LedgerError):
        found = ledger_call(args, subjects.RPC_EVENTS, msgspec.to_builtins(q), lambda led: reads.reply_for(led, q))
        if found["events"]:
            return dict(schema.decode(found["events"][-1].encode()).options)  # type: ignore[attr-defined]
    events = asyncio.run(LocalEmitter(data_dir(args)).history())
    return next((dict(e.options) for e in reversed(events)  # type: ignore[attr-defined]
                 if isinstance(e, schema.BestAdvanced) and e.deployment == deployment and e.commit == commit), {})


def cmd_migrate(args: argparse.Namespace) -> int:
    """Bring a data directory made by an earlier SpecPilot to this version (see `systems.migrate`)."""
    from specpilot.services.controller.systems import migrate

    data = data_dir(args)
    if not data.is_dir():
        raise UserError(f"no data directory at {data}")
    if natsd.running(data):
        raise UserError(f"services are running on {data}: run `specpilot down --data {data}` first")
    for line in migrate(data):
        out.print(line)
    return 0


# --- parser --------------------------------------------------------------------------------------


# Commands that live with the part they drive. Their modules import torch, so each is imported only
# when its command runs; the listing below is what `specpilot --help` shows.
PLUGGED_COMMANDS: dict[str, tuple[str, str]] = {
    "round": ("specpilot.app.cmd_round", "run a round: measure, plan, patch, time, promote, sealed final"),
    "bench": ("specpilot.app.cmd_bench", "measure tau(N), c(N), S(N), tokens/s and speedup over AR on a deployment"),
    "drafter": ("specpilot.app.cmd_drafter", "train a drafter (parallel or EAGLE) for a deployment's target"),
    "model": ("specpilot.app.cmd_model", "check a checkpoint before a deployment uses it; export SmolLM2 as one"),
    "w12": ("specpilot.app.cmd_w12", "pack a model's weights in the lossless 12-bit W12 format and report"),
    "force": ("specpilot.app.cmd_force", "token-force a system's outputs through the stock target"),
    "time": ("specpilot.app.cmd_time", "evaluate a patch like the controller does (policy, tests, timing, verdict)"),
    "memory": ("specpilot.app.cmd_memory", "list, export and import memory entries"),
}


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2) that points at ``--help``; its subparsers are Parsers too."""

    def error(self, message: str):
        output.error_line(f"{message} (see `{self.prog} --help`)", prog=self.prog)
        sys.exit(output.EXIT_BAD_INPUT)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="specpilot", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="exit codes: 0 done (promoted, passed), 1 rejected, 2 refused or bad input, "
                           "3 internal error, 130 interrupted")
    parser.add_argument("--version", action="version", version=f"specpilot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        add_connection_flags(p)
        p.set_defaults(func=func)
        return p

    p = command("up", cmd_up, "start the local NATS server and the five services; return when all answer")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the services")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p = command("status", cmd_status, "list the services that answer NATS micro discovery")
    p.add_argument("--json", action="store_true", help="a JSON list of {name, version, ...}")
    command("down", cmd_down, "stop the services and the local NATS server")
    p = command("init", cmd_init, "write a CA and one bundle per host (server, services, admin) for separate hosts")
    p.add_argument("--listen", default="0.0.0.0:4222", help="HOST:PORT the server will listen on")
    p.add_argument("--host", action="append", metavar="NAME_OR_IP",
                   help="a name or address clients dial the server by (repeat; the first goes in every bundle)")
    p.add_argument("--renew", action="store_true",
                   help="a new CA and new bundles for every host (the old ones stop working: copy each host its new one)")
    p = command("server", cmd_server, "run the NATS server in the foreground from its bundle (another host)")
    p.add_argument("--store", type=Path, default=None, help="JetStream store folder (default: DATA/nats)")
    command("provision", cmd_provision, "create the event stream and the services' consumers (admin)")
    p = command("sql", cmd_sql, "run a read-only SQL query on the ledger")
    p.add_argument("query", help='e.g. "SELECT type, count(*) FROM events GROUP BY 1"')
    p.add_argument("--json", action="store_true", help="print rows as a JSON list of objects")
    p = command("audit", cmd_audit, "show the causal trail of one event (a patch, a verdict, ...)")
    p.add_argument("event_id")
    p.add_argument("--json", action="store_true")
    p = command("replay", cmd_replay, "verify the hash chain and rebuild projections from the log")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild a corrupted ledger from the stream (on the memory service's host; stop it first)")
    p.add_argument("--stream", action="store_true",
                   help="also compare the ledger with the stream message by message (each recorded exactly once)")
    p = command("export", cmd_export, "export the ledger as Parquet files, or the final system as files + patch")
    p.add_argument("--parquet", metavar="DIR", help="write the ledger's tables as Parquet files into DIR")
    p.add_argument("--system", metavar="DIR", help="write the best system's files, final.patch and options.json")
    p.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="whose best system --system writes")

    # Only the module of the command being run is imported (and registers its real parser, with every
    # command it owns); the rest are listed by name so `specpilot --help` shows them.
    command("migrate", cmd_migrate, "bring a data directory made by an earlier SpecPilot to this version (on the "
                                    "controller's host)")

    wanted = next((a for a in (argv or []) if not a.startswith("-")), None)
    if wanted in PLUGGED_COMMANDS:
        importlib.import_module(PLUGGED_COMMANDS[wanted][0]).add_commands(sub)
    for name, (_, help_) in PLUGGED_COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit code (`specpilot.output`)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as exc:
        output.error_line(str(exc))
        return output.EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return output.EXIT_INTERRUPTED
    except Exception as exc:  # a bug, not the user's input: say so in one line, the traceback on request
        if os.environ.get("SPECPILOT_DEBUG"):
            raise
        output.error_line(f"internal error ({type(exc).__name__}: {exc}); rerun with SPECPILOT_DEBUG=1 for the "
                          "traceback and report it")
        return output.EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
