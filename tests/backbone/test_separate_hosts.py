"""A round across separate hosts: one network namespace per service, one for the server, one for the
operator, each process seeing only its own folder (`tests.netlab`). docs/SEPARATE_HOSTS.md is written
from this test: the operator runs ``specpilot init``, copies each host its own bundle, and every host
runs one command."""

from __future__ import annotations

import json
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


def test_a_round_across_separate_hosts(tmp_path):
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
            out = operator(inst, "round", "--deployment", "tiny-cpu", "--rounds", "1", "--sealed-requests", "2",
                           "--sealed-trials", "2", "--minutes", "0", "--json", timeout=600)
            result = json.loads(out.strip().splitlines()[-1])
            assert result["lossless"] is True and result["stock_over_ar"] > 0
            rows = json.loads(operator(inst, "sql", "--json", "SELECT type, count(*) AS n FROM events GROUP BY type"))
            counts = {r["type"]: r["n"] for r in rows}
            for tag in ("round.started", "profile.measured", "direction.planned", "patch.proposed", "verdict.issued",
                        "sealed.final.reported", "round.finished"):
                assert counts.get(tag), f"{tag} missing: {counts}"
            replay = json.loads(operator(inst, "replay", "--json"))
            assert replay["ok"] is True, replay
            # the final system crosses from the controller's host as code (its diff, checked against its trees)
            said = operator(inst, "export", "--system", f"{DATA}/final", "--deployment", "tiny-cpu")
            final = lab.folder("operator") / "data" / "final"
            assert (final / "specpilot_engine" / "options.py").is_file() and (final / "final.patch").exists()
            assert isinstance(json.loads((final / "options.json").read_text()), dict)
            assert result["final_commit"][:12] in said
        finally:
            inst.stop()
        # Each host's folder holds its own state only.
        hosts = ["server", *SERVICES, "operator"]
        held = {name: {p.name for p in (lab.folder(name) / "data").iterdir()} for name in hosts}
        assert "ledger.duckdb" in held["memory"] and not any("ledger.duckdb" in held[n] for n in hosts if n != "memory")
        assert "controller" in held["controller"] and not any("controller" in held[n] for n in hosts if n != "controller")
        assert "bundles" in held["operator"] and not any("bundles" in held[n] for n in hosts if n != "operator")
