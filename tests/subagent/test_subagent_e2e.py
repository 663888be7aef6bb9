"""A direction becomes a verdict over a real nats-server: the master's ``DirectionPlanned`` reaches the
subagent service, whose Anthropic provider (the real SDK, pointed through ``ANTHROPIC_BASE_URL`` at a
local server replaying a scripted transcript) writes a patch; the controller tests and times it on the
tiny deployment and issues a verdict. The ledger must tell the whole story."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from specpilot import bundles, natsd, schema
from specpilot.sandbox import bwrap_available
from tests.backbone.helpers import sql
from tests.conftest import REPO, connect_as, spawn_service, wait_for_services
from tests.subagent import scripts
from tests.subagent.wire import ScriptedServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)")]

CONTROLLER_FLAGS = ["--trials", "2", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "120", "--threads", "1"]
KEY = "sk-ant-test"


def spawn_subagent(srv: natsd.LocalServer, env: dict[str, str]) -> subprocess.Popen:
    """``spawn_service`` with extra environment variables (the provider's key and base URL)."""
    log = open(srv.data / "subagent.log", "ab")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "specpilot.services.subagent", "--data", str(srv.data), "--nats", srv.url,
         "--bundle", str(bundles.bundle_path(srv.data, "subagent")), "--test-timeout", "120"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def _story(server, correlation_id: str) -> list[tuple[str, str, dict]]:
    rows = asyncio.run(sql(server, "SELECT type, source, payload FROM events WHERE correlation_id = "
                                   f"'{correlation_id}' OR event_id = '{correlation_id}' ORDER BY pos"))
    return [(t, s, json.loads(p)) for t, s, p in rows]


def test_direction_to_verdict_through_the_anthropic_sdk(server):
    with ScriptedServer(scripts.agent_turns()) as llm_server:
        procs = [spawn_service(server, "memory"), spawn_service(server, "controller", extra=CONTROLLER_FLAGS),
                 spawn_subagent(server, {"ANTHROPIC_API_KEY": KEY, "ANTHROPIC_BASE_URL": llm_server.url})]
        try:
            wait_for_services(server, {"memory", "controller", "subagent"}, timeout=120)
            direction = schema.DirectionPlanned(direction_id="d-e2e", title="add a demo flag", factor="overhead",
                                                provider="anthropic:claude-test", deployment="tiny-cpu",
                                                round_id="r-e2e", device="cpu")

            async def plan() -> schema.Event:
                b = await connect_as(server, "master")
                try:
                    return (await b.publish(direction))[0]
                finally:
                    await b.close()

            published = asyncio.run(plan())
            deadline = time.monotonic() + 420
            while time.monotonic() < deadline:
                done = asyncio.run(sql(server, "SELECT count(*) FROM events WHERE type IN ('verdict.issued', "
                                               "'patch.refused') AND json_extract_string(payload, '$.patch_id') = 'd-e2e-p0'"))
                if done[0][0]:
                    break
                assert all(p.poll() is None for p in procs), "a service died: see the logs in the data directory"
                time.sleep(2)
            else:
                raise AssertionError("no verdict within 420 s")
            story = _story(server, published.event_id)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
        sent = llm_server.bodies("/v1/messages")

    types = [t for t, _, _ in story]
    assert types[0] == "direction.planned" and types.index("patch.proposed") < types.index("patch.tested") \
        < types.index("verdict.issued"), types
    patch = next(p for t, s, p in story if t == "patch.proposed")
    assert next(s for t, s, _ in story if t == "patch.proposed") == "subagent"
    assert patch["patch_id"] == "d-e2e-p0" and patch["direction_id"] == "d-e2e"
    assert patch["provider"] == "anthropic:claude-test" and patch["options"] == {"demo_flag": True}
    assert patch["deployment"] == "tiny-cpu" and patch["round_id"] == "r-e2e" and patch["base_commit"] == ""
    assert patch["causation_id"] == published.event_id and "+" + scripts.DEMO_FIELD in patch["diff"]
    tested = next(p for t, _, p in story if t == "patch.tested")
    assert tested["passed"] and tested["default_outputs_identical"], tested
    verdict = next(p for t, s, p in story if t == "verdict.issued")
    assert verdict["decision"] in ("promote", "reject") and verdict["n_trials"] == 2, verdict
    assert all(p["deployment"] == "tiny-cpu" for _, _, p in story)
    # what the conversation cost is in the ledger, for `specpilot sql` to sum
    used = next(p for t, s, p in story if t == "conversation.used")
    assert (used["purpose"], used["direction_id"], used["turns"], used["ended"]) == ("coder", "d-e2e", 5, "finished")
    assert used["input_tokens"] == sum(100 + n for n in range(5)) and used["tools"][-1] == "finish"
    # the SDK sent five model calls, each after the first answering the previous tool call
    assert len(sent) == 5
    assert [m["content"][0]["tool_use_id"] for m in (b["messages"][-1] for b in sent[1:])] == \
        [f"toolu_{i}_0" for i in range(4)]
