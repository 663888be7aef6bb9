"""The DuckDB ledger: an append-only, hash-chained copy of every event. The only module that
imports ``duckdb``; only the memory service opens it for writing.

Contract:
- ``events`` has one row per event (primary key ``event_id``, so a redelivered event is absorbed),
  in recording order ``pos`` (0, 1, 2, ...), with the stream sequence ``seq`` and
  ``hash = sha256(prev_hash ‖ payload)`` where ``payload`` is the event's canonical bytes.
- ``append`` writes one batch in one statement per table and one transaction; the caller acks the
  messages only after it returns (commit, then ack: a crash in between causes a redelivery that the
  primary key absorbs).
- ``dead_letters`` keeps messages that never decoded; ``projections`` holds the live projections
  (canonical JSON) written in the same transaction as the events they fold.
- ``verify`` recomputes the chain and names the first bad sequence; ``rebuild_projections`` folds
  the log again so it can be compared byte for byte with the live projections.
- ``query_readonly`` runs a single SELECT-like statement and refuses anything else. The database
  runs with external access disabled except for its own export folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from specpilot import projections, schema
from specpilot.errors import UserError

GENESIS = "0" * 64
READ_ONLY_TYPES = {"SELECT", "EXPLAIN"}
READ_TIMEOUT_S = 20.0  # a `sql` read is stopped past this (server side): no reader holds the memory service
# EXPLAIN ANALYZE runs its statement (DuckDB: `EXPLAIN ANALYZE DELETE ...` deletes), so it is refused;
# comments are removed first so that none can hide the keyword.
_SQL_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)
_FIELD = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_EXPLAIN_ANALYZE = re.compile(r"\s*explain\s*(\([^)]*\banaly[sz]e\b|analy[sz]e\b)", re.I)

DDL = """
CREATE TABLE IF NOT EXISTS events (
    event_id VARCHAR PRIMARY KEY,
    pos BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    type VARCHAR NOT NULL,
    source VARCHAR NOT NULL,
    subject VARCHAR NOT NULL,
    ts_ns BIGINT NOT NULL,
    round_id VARCHAR,
    deployment VARCHAR,
    causation_id VARCHAR,
    correlation_id VARCHAR,
    payload VARCHAR NOT NULL,
    hash VARCHAR NOT NULL,
    recorded_ns BIGINT NOT NULL  -- when the recorder appended it (not covered by the hash)
);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq BIGINT PRIMARY KEY,
    subject VARCHAR NOT NULL,
    data BLOB NOT NULL,
    error VARCHAR NOT NULL,
    deliveries INTEGER NOT NULL,
    ts_ns BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS projections (
    name VARCHAR PRIMARY KEY,
    body VARCHAR NOT NULL
);
"""
COLUMNS = ("event_id", "pos", "seq", "type", "source", "subject", "ts_ns", "round_id", "deployment",
           "causation_id", "correlation_id", "payload", "hash", "recorded_ns")


class LedgerError(UserError):
    pass


class LedgerFull(LedgerError):
    """A batch could not be written because the ledger's disk is full; nothing of it was recorded."""


NO_SPACE = ("no space left on device", "disk quota exceeded", "not enough space")


class ReadOnlyViolation(LedgerError):
    pass


@dataclass(frozen=True)
class Incoming:
    """One event to record: its subject, stream sequence and canonical payload."""

    subject: str
    seq: int
    event: schema.Event
    payload: bytes


@dataclass(frozen=True)
class DeadLetter:
    subject: str
    seq: int
    data: bytes
    error: str
    deliveries: int


def sequences_query(table: str, after: int, limit: int = 10_000) -> str:
    """The read-only query for one page of stream sequences a ledger holds: ``events`` (``seq, event_id``) or
    ``dead_letters`` (``seq``), past ``after``, in order (what `specpilot replay --stream` compares)."""
    columns = {"events": "seq, event_id", "dead_letters": "seq"}[table]
    return f"SELECT {columns} FROM {table} WHERE seq > {int(after)} ORDER BY seq LIMIT {int(limit)}"


def sql_literal(text: str) -> str:
    """``text`` as a quoted SQL string literal (quotes doubled), for queries sent to the read-only endpoint."""
    return "'" + str(text).replace("'", "''") + "'"


def chain(prev_hash: str, payload: bytes) -> str:
    return hashlib.sha256(bytes.fromhex(prev_hash) + payload).hexdigest()


def path_in(data: Path) -> Path:
    return Path(data) / "ledger.duckdb"


def export_dir(data: Path) -> Path:
    return Path(data) / "exports"


class Ledger:
    """A writable ledger (memory service) or a read-only view (CLI when no service runs)."""

    def __init__(self, data: Path, read_only: bool = False):
        self.data = Path(data)
        self.path = path_in(self.data)
        if read_only and not self.path.exists():
            raise LedgerError(f"no ledger at {self.path}: has `specpilot up --data {self.data}` run?")
        self.data.mkdir(parents=True, exist_ok=True)
        export_dir(self.data).mkdir(exist_ok=True)
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise LedgerError(f"the ledger {self.path} is in use by the memory service; "
                                  "query it through the service (`specpilot sql`) instead") from exc
            raise LedgerError(f"cannot open the ledger {self.path}: {exc}. If the file is corrupted, "
                              "move it aside and run `specpilot replay --rebuild` to rebuild it from "
                              "the stream") from exc
        except duckdb.Error as exc:
            raise LedgerError(f"the ledger {self.path} is corrupted or unreadable ({exc}); move it aside "
                              "and run `specpilot replay --rebuild` to rebuild it from the stream") from exc
        if not read_only:
            self.con.execute(DDL)
            if self.live_projections().get("version") != str(projections.VERSION):
                self._rebuild_projections()
        allowed = str(export_dir(self.data).resolve()) + "/"
        self.con.execute(f"SET allowed_directories = ['{allowed}']")
        self.con.execute("SET enable_external_access = false")
        self.last_pos, self.last_hash = self._tail()

    def close(self) -> None:
        self.con.close()

    def _tail(self) -> tuple[int, str]:
        row = self.con.execute("SELECT pos, hash FROM events ORDER BY pos DESC LIMIT 1").fetchone()
        return (row[0], row[1]) if row else (-1, GENESIS)

    # --- writing ---------------------------------------------------------------------------------

    def known(self, event_ids: list[str]) -> set[str]:
        if not event_ids:
            return set()
        rows = self.con.execute("SELECT event_id FROM events WHERE event_id IN (SELECT unnest($1))",
                                [event_ids]).fetchall()
        return {r[0] for r in rows}

    def append(self, batch: list[Incoming], dead: list[DeadLetter] = (),
               projection: projections.State | None = None) -> list[Incoming]:
        """Record a batch in one transaction; returns the events that were new (others were known).

        ``projection`` is folded with the new events and written in the same transaction. Most
        batches hold no redelivered event, so the first attempt skips the look-up of known ids; a
        primary-key conflict rolls back and retries with it.
        """
        try:
            return self._append(batch, dead, projection, set())
        except duckdb.ConstraintException:
            return self._append(batch, dead, projection, self.known([i.event.event_id for i in batch]))

    def _append(self, batch: list[Incoming], dead: list[DeadLetter] | tuple, projection: projections.State | None,
                seen: set[str]) -> list[Incoming]:
        fresh: list[Incoming] = []
        for item in batch:
            if item.event.event_id not in seen:
                seen.add(item.event.event_id)
                fresh.append(item)
        cols: dict[str, list] = {c: [] for c in COLUMNS}
        pos, prev = self.last_pos, self.last_hash
        now = time.time_ns()
        for item in fresh:
            pos += 1
            prev = chain(prev, item.payload)
            e = item.event
            for name, value in zip(COLUMNS, (e.event_id, pos, item.seq, e.tag, e.source, item.subject, e.ts_ns,
                                             e.round_id, e.deployment, e.causation_id, e.correlation_id,
                                             item.payload.decode(), prev, now), strict=True):
                cols[name].append(value)
        self.con.execute("BEGIN TRANSACTION")
        try:
            if fresh:
                select = ", ".join(f"unnest(${i + 1}) AS {c}" for i, c in enumerate(COLUMNS))
                self.con.execute(f"INSERT INTO events SELECT * FROM (SELECT {select})", [cols[c] for c in COLUMNS])
            for d in dead:
                self.con.execute("INSERT OR IGNORE INTO dead_letters VALUES (?, ?, ?, ?, ?, epoch_ns(now()))",
                                 [d.seq, d.subject, d.data, d.error, d.deliveries])
            if projection is not None and fresh:
                for item in fresh:
                    projection.fold(item.event)
                self._write_projections(projection)
            self.con.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(duckdb.Error):  # a failed COMMIT has ended the transaction already
                self.con.execute("ROLLBACK")
            if projection is not None and fresh:
                projection.reset_to(self.live_projections())
            if any(text in str(exc).lower() for text in NO_SPACE):
                free = shutil.disk_usage(self.data).free
                raise LedgerFull(f"the disk of {self.data} is full ({free >> 20} MiB free): {exc}") from exc
            raise
        self.last_pos, self.last_hash = pos, prev
        return fresh

    def _rebuild_projections(self) -> None:
        """Fold the whole log into fresh projections and write them: a new ledger, or one whose live
        projections are of another `projections.VERSION` (written by an older SpecPilot)."""
        state = self._fold_log()
        self.con.execute("BEGIN TRANSACTION")
        self.con.execute("DELETE FROM projections")
        self._write_projections(state)
        self.con.execute("COMMIT")

    def _write_projections(self, projection: projections.State) -> None:
        rows = projection.canonical()
        self.con.execute("INSERT OR REPLACE INTO projections SELECT unnest($1), unnest($2)",
                         [list(rows), list(rows.values())])

    # --- reading ---------------------------------------------------------------------------------

    def count(self) -> int:
        return self.con.execute("SELECT count(*) FROM events").fetchone()[0]

    def live_projections(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT name, body FROM projections ORDER BY name").fetchall())

    def projections(self) -> projections.State:
        """The live projections; folded from the log when they are of another version (a read-only
        view of a ledger an older SpecPilot wrote)."""
        live = self.live_projections()
        if live.get("version") != str(projections.VERSION):
            return self._fold_log()
        state = projections.State()
        state.reset_to(live)
        return state

    def _fold_log(self) -> projections.State:
        state = projections.State()
        for *_, payload, _stored in self.iter_payloads():
            state.fold(schema.decode(payload.encode()))
        return state

    def iter_payloads(self, chunk: int = 50_000) -> Iterator[tuple[int, int, str, str, str, str, str]]:
        """(pos, seq, event_id, type, source, payload, hash) in recording order."""
        cur = self.con.cursor()
        cur.execute("SELECT pos, seq, event_id, type, source, payload, hash FROM events ORDER BY pos")
        while rows := cur.fetchmany(chunk):
            yield from rows

    def events(self, where: str = "", params: list | None = None) -> list[schema.Event]:
        sql = "SELECT payload FROM events " + (f"WHERE {where} " if where else "") + "ORDER BY pos"
        return [schema.decode(r[0].encode()) for r in self.con.execute(sql, params or []).fetchall()]

    def select(self, q) -> list[schema.Event] | int:
        """The events a `specpilot.reads.EventQuery` names, in recording order (or their count): the one
        place a typed read becomes SQL. Payload field names are checked, values are parameters."""
        where, params = [], []
        if q.types:
            where.append(f"type IN ({', '.join('?' for _ in q.types)})")
            params += list(q.types)
        for column in ("deployment", "round_id"):  # envelope columns: one value or one of several
            value = getattr(q, column)
            if value is not None:
                values = value if isinstance(value, list) else [value]
                where.append(f"coalesce({column}, '') IN ({', '.join('?' for _ in values)})" if values else "false")
                params += values
        for name, value in q.fields.items():
            if not _FIELD.fullmatch(name):
                raise LedgerError(f"not a payload field name: {name!r}")
            values = value if isinstance(value, list) else [value]
            if not values:
                where.append("false")
                continue
            where.append(f"json_extract_string(payload, '$.{name}') IN ({', '.join('?' for _ in values)})")
            params += [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        if q.count:
            return self.con.execute(f"SELECT count(*) FROM events {clause}", params).fetchone()[0]
        if q.last:  # the last N in recording order, from the ``offset``-th of them on (a later page)
            sql = (f"SELECT payload FROM (SELECT payload, pos FROM events {clause}ORDER BY pos DESC LIMIT {int(q.last)}) "
                   f"ORDER BY pos OFFSET {int(q.offset)}")
        else:
            sql = f"SELECT payload FROM events {clause}ORDER BY pos OFFSET {int(q.offset)}"
        return [schema.decode(r[0].encode()) for r in self.con.execute(sql, params).fetchall()]

    def reader(self) -> Ledger:
        """This ledger over a cursor of its own, for reads in another thread while this connection records
        (DuckDB: a long read never blocks an append). Close it after the read (`close`)."""
        view = object.__new__(Ledger)
        view.__dict__.update(self.__dict__)
        view.con = self.con.cursor()
        return view

    def query_readonly(self, sql: str, limit: int = 10_000, timeout_s: float = READ_TIMEOUT_S) -> dict[str, Any]:
        """Run one read-only statement; refuse anything that could write."""
        try:
            statements = self.con.extract_statements(sql)
        except duckdb.Error as exc:
            raise LedgerError(f"cannot parse query: {exc}") from exc
        if len(statements) != 1:
            raise ReadOnlyViolation(f"refused: exactly one statement per query, got {len(statements)}")
        kind = str(statements[0].type).rsplit(".", 1)[-1]
        if kind not in READ_ONLY_TYPES:
            raise ReadOnlyViolation(f"refused: {kind} statements are not allowed, the ledger is read-only "
                                    "here (SELECT, WITH … SELECT, DESCRIBE, SHOW and EXPLAIN only)")
        if kind == "EXPLAIN" and _EXPLAIN_ANALYZE.match(_SQL_COMMENTS.sub(" ", statements[0].query)):
            raise ReadOnlyViolation("refused: EXPLAIN ANALYZE runs its statement; use EXPLAIN without ANALYZE")
        cur = self.con.cursor()
        stop = threading.Timer(timeout_s, cur.interrupt)  # a server-side limit: no query holds the reader
        stop.daemon = True
        try:
            stop.start()
            # Defence in depth: whatever runs does so in a transaction that is always rolled back.
            cur.execute("BEGIN TRANSACTION")
            res = cur.execute(sql)
            columns = [d[0] for d in res.description or []]
            rows = res.fetchmany(limit)
        except duckdb.InterruptException:
            raise LedgerError(f"the query ran past {timeout_s:.0f} s and was stopped: narrow it (a WHERE, "
                              "a LIMIT)") from None
        except duckdb.Error as exc:
            raise LedgerError(f"query failed: {exc}") from exc
        finally:
            stop.cancel()
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass  # the failed statement already ended the transaction
            cur.close()
        return {"columns": columns, "rows": [[_jsonable(v) for v in r] for r in rows]}

    def audit(self, event_id: str) -> list[schema.Event]:
        """The causal trail of one event: its causes back to the root, the timing a verdict rests on, then
        everything it caused."""
        by_id = {e.event_id: e for e in self._related(event_id)}
        if event_id not in by_id:
            raise LedgerError(f"no event {event_id} in the ledger")
        trail: list[schema.Event] = []
        cur = by_id[event_id]
        while cur.causation_id and cur.causation_id in by_id:
            cur = by_id[cur.causation_id]
            trail.insert(0, cur)
        # What a verdict rests on: the timing event it names (a sibling, caused by the same patch).
        evidence = getattr(by_id[event_id], "timing_event_id", "")
        if evidence and evidence in by_id and by_id[evidence] not in trail:
            trail.append(by_id[evidence])
        trail.append(by_id[event_id])
        frontier = {event_id}
        children = sorted(by_id.values(), key=lambda e: e.event_id)
        while frontier:
            nxt = {e.event_id for e in children if e.causation_id in frontier and e not in trail}
            trail.extend(e for e in children if e.event_id in nxt)
            frontier = nxt
        return trail

    def _related(self, event_id: str) -> list[schema.Event]:
        """Events sharing a correlation with ``event_id``, plus its causal ancestors."""
        found: dict[str, schema.Event] = {}
        todo = [event_id]
        while todo:
            eid = todo.pop()
            if eid in found or not eid:
                continue
            rows = self.events("event_id = ? OR causation_id = ?", [eid, eid])
            for e in rows:
                if e.event_id not in found:
                    found[e.event_id] = e
                    todo.extend([e.causation_id, e.event_id])
        return list(found.values())

    def export_parquet(self, dest: Path) -> list[Path]:
        """Write every table as Parquet into ``dest`` (through the ledger's own export folder)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for table in ("events", "dead_letters", "projections"):
            tmp = export_dir(self.data).resolve() / f"{table}.parquet"
            self.con.execute(f"COPY (SELECT * FROM {table} ORDER BY 1) TO '{tmp}' (FORMAT parquet)")
            target = dest / f"{table}.parquet"
            shutil.move(str(tmp), target)
            out.append(target)
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).hex()
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    rows: int
    first_bad_seq: int | None = None
    first_bad_pos: int | None = None
    reason: str = ""
    projections_match: bool = True
    projection_diff: str = ""
    projections_stale: bool = False  # of another projections.VERSION: not compared (rebuilt on the next writable open)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def verify(ledger: Ledger) -> VerifyResult:
    """Recompute the hash chain and rebuild the projections from the log."""
    prev = GENESIS
    expected_pos = 0
    state = projections.State()
    rows = 0
    for pos, seq, event_id, type_, source, payload, stored in ledger.iter_payloads():
        rows += 1
        raw = payload.encode()
        why = ""
        if pos != expected_pos:
            why = f"expected position {expected_pos}, found {pos} (a row is missing or reordered)"
        elif chain(prev, raw) != stored:
            why = "hash does not match sha256(previous hash ‖ payload)"
        else:
            try:
                event = schema.decode(raw)
            except schema.DecodeError as exc:
                why = str(exc)
            else:
                if (event.event_id, event.tag, event.source) != (event_id, type_, source):
                    why = "row columns disagree with the payload"
                state.fold(event)
        if why:
            return VerifyResult(False, rows, seq, pos, why)
        prev = stored
        expected_pos += 1
    rebuilt = state.canonical()
    live = ledger.live_projections()
    if live.get("version") != rebuilt["version"]:
        return VerifyResult(True, rows, projections_stale=True,
                            reason=f"the live projections are of version {live.get('version', '1')}, this SpecPilot's "
                                   f"are {rebuilt['version']}: the memory service rebuilds them from the log when it "
                                   "next opens the ledger (`specpilot up`)")
    if rebuilt != live:
        names = sorted(n for n in set(rebuilt) | set(live) if rebuilt.get(n) != live.get(n))
        return VerifyResult(True, rows, projections_match=False, projection_diff=", ".join(names),
                            reason="projections rebuilt from the log differ from the live ones")
    return VerifyResult(True, rows)

