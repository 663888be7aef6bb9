"""``specpilot memory list|export DIR|import DIR``: memory entries between data directories.

- ``list``: every memory entry of the ledger with its status, requirements and options.
- ``export DIR``: the accepted entries, each with its evidence events (as recorded: patch, timing,
  verdict, promotion) in ``DIR/entries.jsonl``, the files of the stock each was made against in
  ``DIR/stock/<sha256>`` (from the memory service's snapshot store, or this checkout where it still
  holds them), and ``DIR/manifest.json``. Reads the ledger through the memory service when it runs,
  the DuckDB file otherwise.
- ``import DIR``: files the exported stocks into this data directory's snapshot store and asks the
  memory service (it must run: ``specpilot up``) to propose every entry not known here. Each one is
  then validated against its own stock like any entry (never trusted) and served to deployments whose
  facts meet its requirements, where the planner applies it through the ``memory`` coder and the
  controller times it.

``--json`` prints one JSON object last. `add_commands(subparsers)` registers the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from pathlib import Path

from specpilot import entries, output, reads, schema, subjects
from specpilot.app import cli
from specpilot.errors import UserError
from specpilot.paths import REPO_ROOT
from specpilot.service import add_connection_flags

EXPORT_FORMAT = 1


def _ask(args: argparse.Namespace, subject: str, query) -> dict:
    """One typed read: over the memory service when it runs, else from the DuckDB file."""
    from specpilot import ledger

    def local(led: ledger.Ledger) -> dict:
        if subject == subjects.RPC_VIEW:
            return reads.view_reply(led.projections(), query)
        return reads.reply_for(led, query)

    import msgspec

    return cli.ledger_call(args, subject, msgspec.to_builtins(query), local)


def _entries(args: argparse.Namespace) -> tuple[list[schema.MemoryEntryProposed], dict[str, str]]:
    """Every proposed entry (latest proposal per id) and each one's status."""
    rows = _ask(args, subjects.RPC_VIEW, reads.ViewQuery(view="memory_entries"))["rows"]
    status = {k: str(v.get("status", "proposed")) for k, v in rows.items()}
    found = _ask(args, subjects.RPC_EVENTS, reads.query(schema.MemoryEntryProposed))["events"]
    latest: dict[str, schema.MemoryEntryProposed] = {}
    for raw in found:
        e = schema.decode(raw.encode())
        latest[e.entry_id] = e  # type: ignore[attr-defined]
    return list(latest.values()), status


def cmd_list(args: argparse.Namespace) -> int:
    found, status = _entries(args)
    rows = [{"entry_id": e.entry_id, "status": status.get(e.entry_id, "proposed"), "title": e.title,
             "options": dict(e.options), "requirements": dict(e.requirements), "code": bool(e.delta.strip()),
             "origin": e.origin} for e in found]
    table = output.table(f"memory entries ({len(rows)})", ("entry", "status", "options", "requirements", "code"))
    for r in rows:
        table.add_row(r["entry_id"], r["status"], json.dumps(r["options"]), json.dumps(r["requirements"]),
                      "yes" if r["code"] else "")
    output.console(stderr=args.json).print(table)
    if args.json:
        print(json.dumps({"entries": rows}))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from specpilot.services.memory.main import stock_store

    found, status = _entries(args)
    chosen = [e for e in found if status.get(e.entry_id) == "accepted"]
    dest = Path(args.dir)
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest} is not empty: export into a new directory")
    (dest / "stock").mkdir(parents=True, exist_ok=True)
    store = stock_store(cli.data_dir(args))
    lines, missing = [], []
    # An export shipped inside a checkout leaves out the stock files that checkout holds already.
    here = entries.tree_hashes(REPO_ROOT) if args.without_checkout_files else {}
    for e in chosen:
        evidence = [json.loads(raw) for raw in _ask(args, subjects.RPC_EVENTS, reads.query(
            event_id=list(e.evidence)))["events"]] if e.evidence else []
        lines.append(json.dumps({"entry": json.loads(schema.encode(e)),
                                 "evidence": evidence or list(e.imported_evidence)}))
        wanted = {rel: sha for rel, sha in e.stock_files.items() if here.get(rel) != sha}
        for sha in wanted.values():
            target = dest / "stock" / sha
            if not target.exists() and (store / sha).exists():
                shutil.copyfile(store / sha, target)
        entries.snapshot(dest / "stock", wanted)  # what the store lacks, from this checkout
        missing += [f"{e.entry_id}: {rel}" for rel, sha in wanted.items() if not (dest / "stock" / sha).exists()]
    (dest / "entries.jsonl").write_text("".join(line + "\n" for line in lines))
    manifest = {"format": EXPORT_FORMAT, "origin": str(cli.data_dir(args)), "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "entries": [e.entry_id for e in chosen], "stock_files_missing": missing}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    con = output.console(stderr=args.json)
    con.print(f"exported {len(chosen)} accepted entr{'y' if len(chosen) == 1 else 'ies'} "
              f"(of {len(found)}) to {dest}")
    if missing:
        con.print(f"[yellow]{len(missing)} stock file(s) were in neither the snapshot store nor this checkout[/yellow]: "
                  "those entries will be rejected where they are imported")
    if args.json:
        print(json.dumps(manifest))
    return 0


def read_export(src: Path) -> tuple[dict, list[dict]]:
    """The manifest and the entry lines of an export directory; UserError naming what is wrong."""
    try:
        manifest = json.loads((src / "manifest.json").read_text())
        items = [json.loads(line) for line in (src / "entries.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{src} is not a memory export ({exc}): make one with `specpilot memory export DIR`") from None
    if manifest.get("format") != EXPORT_FORMAT:
        raise UserError(f"{src}: export format {manifest.get('format')!r}, this SpecPilot reads {EXPORT_FORMAT}")
    if not all(isinstance(i, dict) and isinstance(i.get("entry"), dict) for i in items):
        raise UserError(f"{src}/entries.jsonl: every line must be {{\"entry\": {{...}}, \"evidence\": [...]}}")
    return manifest, items


def file_stock(src: Path, data: Path) -> int:
    """File an export's stock files into data directory ``data``'s snapshot store; how many were new. An
    export is hostile input: a blob is filed only when it is a regular file (no link followed), its name
    is a sha256 and its content hashes to it (`entries.file_blob`); anything else is left out."""
    from specpilot.services.memory.main import stock_store

    store = stock_store(data)
    store.mkdir(parents=True, exist_ok=True)
    filed = 0
    folder = src / "stock"
    for name in sorted(os.listdir(folder)) if folder.is_dir() and not folder.is_symlink() else []:
        if entries.SHA256.fullmatch(name) and not (store / name).exists():
            blob = entries.read_regular(folder / name)
            filed += blob is not None and entries.file_blob(store, blob, name)
    return filed


def propose_export(args: argparse.Namespace, src: Path, origin: str | None = None) -> tuple[dict | None, int]:
    """File an export's stock files here and ask the memory service to propose its entries: (its reply,
    None when it does not answer; stock files newly filed). ``origin``: the manifest's, unless given."""
    manifest, items = read_export(src)
    filed = file_stock(src, cli.data_dir(args))
    payload = {"entries": items, "origin": origin or str(manifest.get("origin", src))}
    return asyncio.run(cli.call_memory(args, subjects.RPC_IMPORT, payload)), filed


def cmd_import(args: argparse.Namespace) -> int:
    reply, filed = propose_export(args, Path(args.dir))
    if reply is None:
        raise UserError(f"the memory service of {cli.data_dir(args)} does not answer: start it with `specpilot up`, "
                        "then import again")
    con = output.console(stderr=args.json)
    con.print(f"{len(reply['imported'])} entr{'y' if len(reply['imported']) == 1 else 'ies'} proposed, "
              f"{len(reply['known'])} already known; {filed} stock file(s) filed. Each is validated against its "
              "own stock before any round may use it (`specpilot memory list`).")
    if args.json:
        print(json.dumps({**reply, "stock_files_filed": filed}))
    return 0


SHIPPED = REPO_ROOT / "deployments" / "shipped-memory"  # entries recorded by real rounds (an export)


def import_shipped(args: argparse.Namespace, src: Path = SHIPPED) -> list[str]:
    """On a data directory whose ledger holds no memory entry yet, propose the shipped ones (each
    validated before a round may apply it, and timed when applied); the ids proposed."""
    if not (src / "entries.jsonl").exists():
        return []
    rows = asyncio.run(cli.call_memory(args, subjects.RPC_VIEW, {"view": "memory_entries"}))
    if rows is None or rows.get("rows"):
        return []
    reply, _ = propose_export(args, src, origin=f"shipped: {src.name}")
    return list(reply["imported"]) if reply else []


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("memory", help="list, export and import memory entries",
                              description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="memory_command", required=True, metavar="ACTION")
    for name, func, help_ in (("list", cmd_list, "every entry with its status, requirements and options"),
                              ("export", cmd_export, "write the accepted entries, their evidence and stocks into DIR "
                                                     "(on the memory service's host: it reads its snapshot store)"),
                              ("import", cmd_import, "propose the entries of an export DIR here, validated, never "
                                                     "trusted (on the memory service's host: it fills its snapshot store)")):
        q = sub.add_parser(name, help=help_, description=help_)
        add_connection_flags(q)
        if name != "list":
            q.add_argument("dir", metavar="DIR", help="the export directory")
        if name == "export":
            q.add_argument("--without-checkout-files", action="store_true",
                           help="leave out stock files this checkout holds (for an export shipped in the repository)")
        q.add_argument("--json", action="store_true", help="print one JSON object last")
        q.set_defaults(func=func)
