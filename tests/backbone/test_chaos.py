"""The chaos bench's short version (`bench/chaos_hosts.py`, issue 53 item 7): a round across separate hosts
while every service and the NATS server (twice) are SIGKILLed and one link is cut; afterwards the stream
equals the ledger message by message, every patch is decided once, nothing is tested or timed twice, and
every promotion is advanced. The bench's full run (30 kills, 3 cuts) is in docs/FIGURES.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.netlab import available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.skipif(bool(available()), reason=available())]


def test_chaos_across_hosts_loses_and_repeats_nothing():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "chaos_hosts.py"), "--kills", "7", "--cuts", "1",
                          "--waves", "1", "--gap", "1", "3", "--json"], capture_output=True, text=True, timeout=1100,
                         cwd=REPO)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0, (summary, res.stderr[-3000:])
    assert summary["kills"] == 7 and all(summary["kills_by_service"].values()), summary["kills_by_service"]
    assert summary["kills_by_service"]["server"] == 2 and summary["link_cuts"] == ["subagent"]
    assert summary["stream_equals_ledger"] and summary["events_lost"] == 0 and summary["events_twice"] == 0
    assert summary["stream_messages"] == summary["events"] and summary["patches"] >= 1
    for bad in ("undecided", "decided_twice", "tested_twice", "timings_repeated", "promotions_not_advanced"):
        assert summary[bad] == [], (bad, summary[bad])
    assert summary["chain_ok"] and summary["projections_match"] and summary["round_lossless"]
