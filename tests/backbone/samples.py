"""One realistic instance of every event type (used by the round-trip test and the golden file)."""

from __future__ import annotations

from specpilot import schema

ENV = dict(round_id="r-0001", deployment="smollm2-cpu", correlation_id="c-1", causation_id="e-0")


def one_of_each() -> list[schema.Event]:
    s = schema
    return [
        s.DeploymentRegistered(**ENV, source="controller", spec={"target": "smollm2", "device": "cpu"}, stock_commit="abc123"),
        s.RoundStarted(**ENV, source="master", rounds=2, planner="sweep", coder="memory", devices=["cpu"]),
        s.HardwareMeasured(**ENV, source="master", device="cpu", bandwidth_bytes_s=2.1e10, flops_s=1.5e11, method="copy+gemm"),
        s.ProfileMeasured(**ENV, source="master", device="cpu", step_s=0.041, classes_s={"attention": 0.004, "lm_head": 0.009}, tau=2.4, block_size=4),
        s.CeilingComputed(**ENV, source="master", ceiling_speedup=3.2, factors={"tau": 1.4, "kernel": 1.8, "overhead": 1.3}, floors_s={"lm_head": 0.002}, replay_tau={"16": 3.1}),
        s.DirectionPlanned(**ENV, source="master", direction_id="d-1", title="tree verification", rationale="tau factor largest", factor="tau", provider="sweep", device="cpu"),
        s.PatchProposed(**ENV, source="subagent", direction_id="d-1", patch_id="p-1", diff="--- a/engine/x.py\n+++ b/engine/x.py\n", options={"verify": "tree", "tree_nodes": 16}),
        s.DirectionFailed(**ENV, source="subagent", direction_id="d-1", provider="anthropic", reason="ANTHROPIC_API_KEY is not set"),
        s.ConversationUsed(**ENV, source="subagent", purpose="coder", direction_id="d-1", provider="anthropic:claude-test",
                           turns=5, input_tokens=12000, output_tokens=900, wall_s=41.5, ended="finished",
                           tools=["list_files", "read_file", "apply_diff", "run_tests", "finish"]),
        s.PatchRefused(**ENV, source="controller", patch_id="p-2", rule="paths", reason="touches tests/"),
        s.PatchTested(**ENV, source="controller", patch_id="p-1", passed=True, default_outputs_identical=True, detail="12 passed"),
        s.TimingMeasured(**ENV, source="controller", patch_id="p-1", device="cpu", incumbent_s=[1.0, 1.1], candidate_s=[0.8, 0.85], order=["AB", "BA"], load=[0.1, 0.2]),
        s.VerdictIssued(**ENV, source="controller", patch_id="p-1", decision="promote", reason="lower bound 0.12 > bar 0.03", gain=0.2, lower_bound=0.12, upper_bound=0.28, bar=0.03, noise=0.01, n_trials=16),
        s.ForcingRequested(**ENV, source="controller", request_id="f-1", patch_id="p-1", outputs=[{"prompt_ids": [1, 2], "tokens": [3, 4]}]),
        s.ForcingReported(**ENV, source="forcer", request_id="f-1", patch_id="p-1", passed=True, stats={"mismatch_rate": 0.007}, audited=[{"pos": 3, "margin": 0.1}]),
        s.IntegrationProposed(**ENV, source="master", integration_id="i-1", patch_ids=["p-1", "p-3"]),
        s.BestAdvanced(**ENV, source="controller", commit="def456", previous_commit="abc123", patch_id="p-1", options={"verify": "tree"}, gain=0.2),
        s.SealedFinalRequested(**ENV, source="master", requests=8, trials=3),
        s.SealedFinalReported(**ENV, source="controller", final_commit="def456", results={"final_over_stock": 1.4}, lossless=True),
        s.MemoryEntryProposed(**ENV, source="controller", entry_id="m-1", title="tree verification", delta="diff", options={"verify": "tree"}, requirements={"device": "cpu"}, contract="greedy-exact", evidence=["e-1"]),
        s.MemoryEntryAccepted(**ENV, source="memory", entry_id="m-1"),
        s.MemoryEntryRejected(**ENV, source="memory", entry_id="m-2", reason="delta does not reproduce source"),
        s.SecurityViolation(**ENV, source="memory", subject="sp.ev.subagent.verdict.issued", claimed_type="verdict.issued", claimed_source="subagent", reason="subagent may not publish verdict.issued", seq=7),
        s.RoundFinished(**ENV, source="master", summary={"final_over_stock": 1.4}),
    ]
