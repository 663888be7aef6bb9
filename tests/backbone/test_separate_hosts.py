"""A round across separate hosts: one network namespace per service, one for the server, one for the
operator, each process seeing only its own folder (`tests.netlab`); the master and the controller are
SIGKILLed mid-round and restarted by their hosts, and the round still finishes with every patch decided
once. docs/SEPARATE_HOSTS.md is written
from this test: the operator runs ``specpilot init``, copies each host its own bundle, and every host
runs one command."""

from __future__ import annotations

import json
import signal
import time

import pytest

from specpilot.schema import SERVICES
from tests.netlab import DATA, Installation, Lab, available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.skipif(bool(available()), reason=available())]

CONTROLLER_FLAGS = ["--trials", "2", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "120", "--threads", "1"]


def operator(inst: Installation, *args: str, timeout: float = 120) -> str:
    res = inst.operator(*args, timeout=timeout)
    assert res.returncode == 0, f"specpilot {' '.join(args)}: {res.stderr[-2000:]}"
    return res.stdout


def wait_for_line(log, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {log} after {timeout:.0f} s")


def test_a_round_across_separate_hosts_survives_killed_services(tmp_path):
    with Lab(tmp_path / "hosts", ["server", *SERVICES, "operator"]) as lab:
        inst = Installation(lab, SERVICES, {"controller": CONTROLLER_FLAGS})
        inst.init()
        for name in ("server", *SERVICES):
            inst.start(name)
        try:
            operator(inst, "provision", timeout=90)
            deadline = time.monotonic() + 120
            while True:
                found = {s["name"] for s in json.loads(operator(inst, "status", "--json"))}
                if set(SERVICES) <= found or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert set(SERVICES) <= found, f"answering: {found}; logs in {lab.root}"
            follower = inst.operator_popen("round", "--deployment", "tiny-cpu", "--rounds", "1", "--sealed-requests",
                                           "2", "--sealed-trials", "2", "--minutes", "0", "--json")
            # Mid-round, the master and the controller die (SIGKILL) and their hosts restart them.
            wait_for_line(lab.root / "subagent.log", "direction ", timeout=300)
            for name in ("master", "controller"):
                inst.procs[name].send_signal(signal.SIGKILL)
                inst.procs[name].wait()
                inst.start(name)
            assert follower.wait(timeout=600) == 0, (lab.root / "operator.log").read_text()[-3000:]
            out = (lab.root / "operator.log").read_text().strip().splitlines()
            result = json.loads(next(line for line in reversed(out) if line.startswith("{")))
            assert result["lossless"] is True and result["stock_over_ar"] > 0
            rows = json.loads(operator(inst, "sql", "--json", "SELECT type, count(*) AS n FROM events GROUP BY type"))
            counts = {r["type"]: r["n"] for r in rows}
            for tag in ("round.started", "profile.measured", "direction.planned", "patch.proposed", "verdict.issued",
                        "sealed.final.reported", "round.finished"):
                assert counts.get(tag), f"{tag} missing: {counts}"
            decided = json.loads(operator(inst, "sql", "--json", (
                "SELECT json_extract_string(payload, '$.patch_id') AS patch, count(*) AS n FROM events "
                "WHERE type IN ('verdict.issued', 'patch.refused') GROUP BY 1")))
            assert decided and all(d["n"] == 1 for d in decided), f"a patch decided twice or never: {decided}"
            assert len(decided) == counts["patch.proposed"]
            replay = json.loads(operator(inst, "replay", "--json"))
            assert replay["ok"] is True and replay["projections_match"] is True, replay
            # the final system crosses from the controller's host as code (its diff, checked against its trees)
            said = operator(inst, "export", "--system", f"{DATA}/final", "--deployment", "tiny-cpu")
            final = lab.folder("operator") / "data" / "final"
            assert (final / "engine" / "options.py").is_file() and (final / "final.patch").exists()
            assert isinstance(json.loads((final / "options.json").read_text()), dict)
            assert result["final_commit"][:12] in said
        finally:
            inst.stop()
        # Each host's folder holds its own state only (a model cache where a host runs the model).
        own = {"server": {"jetstream", "nats.conf"}, "operator": {"bundles", "pki", "rounds", "final"},
               "memory": {"ledger.duckdb", "ledger.duckdb.wal", "memory", "exports"}, "master": {"rounds"},
               "controller": {"controller", "models"}, "forcer": {"forcer", "models"}, "subagent": {"subagent", "models"}}
        for name, allowed in own.items():
            held = {p.name for p in (lab.folder(name) / "data").iterdir()}
            assert held <= allowed, f"{name} holds {sorted(held - allowed)}, which is not its own"
        assert (lab.folder("memory") / "data" / "ledger.duckdb").exists()
        assert (lab.folder("controller") / "data" / "controller" / "systems").is_dir()
