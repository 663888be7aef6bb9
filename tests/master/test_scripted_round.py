"""A round in which scripted agents write real code, through the real Anthropic (planner) and OpenAI
(coder) SDKs against the local wire server, on the head-bound ``tiny-wide-cpu`` deployment.

The services run from a copy of this checkout without the certified exact-argmax LM head
(`tests.subagent.trajectories`): one agent writes it (the engine's own code) and it must be promoted
with a measured gain and become a memory entry; one writes a head over half the vocabulary, which token
forcing must reject; one sends an unknown tool, malformed JSON, a stale diff and an oversized one (each a tool
error) and then a probe patch that tries the network, the services' secrets and data directory,
in its tests and in the controller's workers; one meets a rate-limited provider. The ledger must show all of it, and the round must end
with a lossless sealed final, and memory must serve the promoted entry to ``tiny-cpu`` (whose facts meet
its requirements), as the master asks before planning there. (A second round that applied it through the
memory coder cost CI 80 s; the memory coder's application is `tests/subagent/test_service.py`'s.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from urllib.parse import urlparse

import pytest

from specpilot import ledger, subjects
from specpilot.harness.deployment import load_deployment
from specpilot.kernels import cpu_gemm
from specpilot.sandbox import bwrap_available
from tests.backbone.helpers import sql
from tests.conftest import connect_as, spawn_service, wait_for_services
from tests.master.test_round_e2e import _events, _start_round, _stop, _wait_for
from tests.subagent import trajectories
from tests.subagent.wire import Call, Fail, ScriptedServer, Turn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not bwrap_available(), reason="the sandbox needs bubblewrap (scripts/install.sh)"),
              pytest.mark.skipif(not cpu_gemm.available(), reason="the screened head needs specpilot.kernels.cpu_gemm")]

CONTROLLER_FLAGS = ["--trials", "3", "--requests", "2", "--max-new-tokens", "16", "--wall-s", "180", "--threads", "1"]
TITLES = {"screened": "certified argmax LM head", "pruned": "frequent-token LM head", "messy": "sandbox probe",
          "limited": "rate-limited agent"}
PLAN = [Turn("", [Call("plan", {"directions": [
    {"title": TITLES["screened"], "factor": "kernel", "rationale": "the head is most of a step; greedy needs its argmax"},
    {"title": TITLES["pruned"], "factor": "kernel", "rationale": "frequent tokens have low ids"},
    {"title": TITLES["messy"], "factor": "overhead", "rationale": "a careless agent"},
    {"title": TITLES["limited"], "factor": "overhead", "rationale": "a provider that says no"}]})])]


def _all_events(server) -> list[tuple[str, str, dict]]:
    rows = asyncio.run(sql(server, "SELECT type, event_id, payload FROM events ORDER BY pos"))
    return [(t, i, json.loads(p)) for t, i, p in rows]


def _tool_replies(coder: ScriptedServer, title: str) -> list[str]:
    """The tool results the SDK sent back in the conversation of ``title`` (its longest request)."""
    bodies = [b for b in coder.bodies("/v1/chat/completions") if title in json.dumps(b["messages"][1])]
    return [m["content"] for m in max(bodies, key=lambda b: len(b["messages"]))["messages"] if m["role"] == "tool"]


def _entries_for(server, deployment: str) -> list[dict]:
    """The accepted memory entries the master would be served for ``deployment`` (its facts)."""
    async def go() -> list[dict]:
        master = await connect_as(server, "master")
        try:
            reply = await master.request(subjects.RPC_ENTRIES, {"facts": load_deployment(deployment).facts()}, timeout=30)
        finally:
            await master.close()
        return reply["entries"]

    return asyncio.run(go())


def _after_patches(server, n: int, timeout: float = 300.0):
    """A `Turn.before` that holds its reply until ``n`` patches are in the ledger (or ``timeout``)."""
    def hold() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if asyncio.run(sql(server, "SELECT count(*) FROM events WHERE type = 'patch.proposed'"))[0][0] >= n:
                return
            time.sleep(0.5)

    return hold


def test_scripted_agents_write_real_code_in_a_round(server, tmp_path):
    stock = trajectories.stock_without_mechanism(tmp_path / "stock")
    port = urlparse(server.url).port
    # The screened head's patch comes last: a patch decided after its promotion is integrated onto it, and
    # each such candidate builds cpu_gemm twice more (~25 s on 2 cores). It costs no time (the controller is
    # still busy with the noise and the first patch), and the agents still run at once.
    *screened, finish = trajectories.screened_head_turns(stock)
    scripts = {TITLES["screened"]: [*screened, dataclasses.replace(finish, before=_after_patches(server, 2))],
               TITLES["pruned"]: trajectories.pruned_head_turns(stock),
               TITLES["messy"]: trajectories.messy_turns(stock, server.data, port),
               TITLES["limited"]: Fail(429, "rate_limit_error", "rate limit reached for requests")}
    with ScriptedServer(PLAN) as planner, ScriptedServer(by_key=scripts) as coder:
        envs = {"master": {"ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": planner.url},
                "subagent": {"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": coder.openai_url}}
        extra = {"controller": CONTROLLER_FLAGS, "subagent": ["--test-timeout", "180", "--concurrency", "4"]}
        procs = {name: spawn_service(server, name, env=envs.get(name), extra=extra.get(name), root=stock)
                 for name in ("memory", "forcer", "controller", "subagent", "master")}
        try:
            wait_for_services(server, set(procs), timeout=120)
            # One sealed request: the final's assertion is that it is lossless, which its tokens equal to AR's are.
            round_id = _start_round(server, deployment="tiny-wide-cpu", rounds=1, directions=4, sealed_requests=1,
                                    planner="anthropic:claude-test", coder="openai:gpt-test")
            _wait_for(server, round_id, "round.finished", timeout=1000)
            # What the master of a round on another deployment would be offered from memory.
            served = {name: _entries_for(server, name) for name in ("tiny-cpu", "tiny-wide-cpu")}
            events, everything = _events(server, round_id), _all_events(server)
        finally:
            _stop(procs)
        messy_replies = _tool_replies(coder, TITLES["messy"])

    by: dict[str, list[dict]] = {}
    for t, _, p in events:
        by.setdefault(t, []).append(p)
    directions = {d["title"]: d["direction_id"] for d in by["direction.planned"]}
    assert set(directions) == set(TITLES.values())
    patches = {p["direction_id"]: p for p in by["patch.proposed"]}
    verdicts = {v["patch_id"]: v for v in by["verdict.issued"]}

    # 1. The real code delta: proposed by the coder, promoted with a measured gain, remembered.
    screened = patches[directions[TITLES["screened"]]]
    assert screened["options"] == {"screened_head": True} and "class ScreenedHead" in screened["diff"]
    verdict = verdicts[screened["patch_id"]]
    timing = next((t for t in by.get("timing.measured", []) if t["patch_id"] == screened["patch_id"]), {})
    why = {k: verdict.get(k) for k in ("decision", "reason", "gain", "lower_bound", "bar", "outputs_identical",
                                       "forcing_passed", "ceiling")}
    why["timing"] = {k: timing.get(k) for k in ("incumbent_s", "candidate_s", "incumbent_untimed_s",
                                                 "candidate_untimed_s", "load", "problem")}
    assert verdict["decision"] == "promote" and verdict["gain"] > 0.05, json.dumps(why)  # whole: pytest cuts a dict
    assert any(a["patch_id"] == screened["patch_id"] for a in by["best.advanced"])
    entry = next(e for e in by["memory.entry.proposed"] if "class ScreenedHead" in e["delta"])
    assert entry["options"] == {"screened_head": True} and "engine/screened_head.py" in entry["source_files"]

    # 2. The plausible lossy patch: timed, forced, rejected by forcing.
    pruned = patches[directions[TITLES["pruned"]]]
    forced = [p for t, _, p in everything if t == "forcing.reported" and p["patch_id"] == pruned["patch_id"]]
    assert forced and not forced[-1]["passed"], forced
    rejected = verdicts[pruned["patch_id"]]
    assert rejected["decision"] == "reject" and rejected["forcing_passed"] is False, rejected

    # 3. The careless agent: a tool error for each bad call, its probe contained everywhere.
    unknown, malformed, stale, oversized, probe_applied, tests_ran = messy_replies[:6]
    assert "unknown tool 'shell'" in unknown
    assert "not valid JSON" in malformed
    assert "does not apply" in stale
    assert "refused (size)" in oversized
    assert "applied" in probe_applied and "passed" in tests_ran and "ESCAPED" not in tests_ran
    messy = patches[directions[TITLES["messy"]]]
    assert "ESCAPED" in messy["diff"]  # the probe's code did reach the controller, and ran there
    assert verdicts[messy["patch_id"]]["decision"] == "reject"
    tested = next(t for t in by["patch.tested"] if t["patch_id"] == messy["patch_id"])
    assert tested["passed"] and tested["sandbox"]["network"] == "none", tested
    assert not any("ESCAPED:" in json.dumps(p) for t, _, p in events if t != "patch.proposed")
    assert not (server.data / "pwned").exists()
    usage = {u["direction_id"]: u for u in by["conversation.used"] if u["purpose"] == "coder"}
    assert usage[directions[TITLES["messy"]]]["tools"][:2] == ["shell", "read_file"]

    # 4. A provider that refuses ends its direction with an event naming the cause; the round goes on.
    (failed,) = [f for f in by["direction.failed"] if f["direction_id"] == directions[TITLES["limited"]]]
    assert "RateLimitError" in failed["reason"] and "rate limit reached" in failed["reason"], failed

    # 5. The round went on to a lossless sealed final.
    final = by["sealed.final.reported"][0]
    assert final["lossless"] is True

    # 6. Memory accepted the entry (its delta reproduced on stock) and serves it where its requirements hold.
    for name, found in served.items():
        assert [e["entry_id"] for e in found] == [entry["entry_id"]], name
        assert "class ScreenedHead" in found[0]["delta"]
    led = ledger.Ledger(server.data, read_only=True)
    try:
        assert ledger.verify(led).ok
    finally:
        led.close()
