"""`specpilot bench` end to end on the tiny deployment: every figure present and consistent."""

from __future__ import annotations

import json

import pytest

from specpilot.app import cmd_bench as bench
from specpilot.errors import UserError
from specpilot.harness.profile import profile


def test_bench_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    rc = bench.main(["--deployment", "tiny-cpu", "--limit", "2", "--max-new-tokens", "24", "--ns", "1,3",
                     "--threads", "1", "--out", str(tmp_path), "--verify", "tree"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads(last)
    assert r["bench"] == "engine" and r["options"]["verify"] == "tree" and r["requests"] == 2
    rows = r["sweep"]["rows"]
    assert [row["n"] for row in rows] == [1, 3]
    for row in rows:
        assert 1.0 <= row["tau"] <= row["n"] + 1
        assert row["S"] == pytest.approx(row["tau"] / row["c"])
    e = r["e2e"]
    assert e["pairs"] == 2 and e["identical_outputs"] == 1.0 and e["ci95"][0] <= e["speedup"] <= e["ci95"][1]
    assert 1.0 <= e["tau"] <= r["options"]["block_size"] + 1 and r["request_set"] == "all"
    prof = r["profile_ms"]
    for cls in ("attention", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head", "norms", "drafter", "host_overhead"):
        assert prof[cls] >= 0.0, cls
    assert prof["step_total"] > 0
    # transformers' greedy decoding on our converted weights emits our AR tokens.
    assert r["peer"]["greedy_matches_engine"] == 1.0, r["peer"]
    assert (tmp_path / "tau.png").stat().st_size > 1000 and (tmp_path / "speedup.png").is_file()
    assert json.loads((tmp_path / "bench.json").read_text())["e2e"] == e


def test_bench_one_request_set_and_an_unknown_one(tmp_path, capsys):
    args = ["--deployment", "tiny-cpu", "--limit", "1", "--max-new-tokens", "8", "--ns", "", "--threads", "1",
            "--no-profile", "--no-peer", "--no-plots", "--out", str(tmp_path)]
    assert bench.main([*args, "--set", "chat"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["request_set"] == "chat" and r["requests"] == 1
    with pytest.raises(UserError, match="no dev requests of set 'poems' in tiny-cpu; its sets: chat"):
        bench.main([*args, "--set", "poems"])


def test_cli_registers_bench():
    import argparse

    from specpilot.app.cmd_bench import add_commands

    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--deployment", "tiny-cpu", "--block-size", "2"])
    assert args.func is bench.run and args.opt_block_size == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda_counts_kernel_time_not_the_hosts():
    """Eager steps of the tiny model on a GPU are launch-bound: the classes' device kernel time is
    a small share of the step, the rest is host overhead (CUDA events would charge it to the classes)."""
    from specpilot.harness.deployment import load_engine

    engine = load_engine("tiny-cuda", {})
    prompt = engine.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    engine.generate(prompt, 8)  # warm-up
    prof = profile(engine, prompt, 32)
    kernel_ms = sum(v for k, v in prof.items() if k not in ("drafter", "host_overhead", "step_total"))
    assert prof["q_proj"] > 0 and prof["norms"] > 0
    assert kernel_ms < 0.5 * prof["step_total"], prof
    assert prof["host_overhead"] > kernel_ms, prof


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_profile_of_a_graphed_system_sees_its_classes():
    """A CUDA graph replay bypasses the modules: the classes come from the same engine run eagerly, the
    step and the host's share from the graphed run (so the host's share is small next to eager's)."""
    from specpilot.harness.deployment import load_engine

    engine = load_engine("tiny-cuda", {"cuda_graphs": True})
    assert engine.graphs
    prompt = engine.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    engine.generate(prompt, 32)  # warm-up: captures
    prof = profile(engine, prompt, 32)
    assert engine.graphs  # left as it was
    assert prof["q_proj"] > 0 and prof["norms"] > 0, prof
    engine.graphs = False
    eager = profile(engine, prompt, 32)
    assert prof["step_total"] < eager["step_total"], (prof, eager)
    assert prof["q_proj"] == pytest.approx(eager["q_proj"], rel=0.5)


def test_bench_applies_every_model_option_to_the_system_and_none_to_ar():
    # Session 10 found `--linear-backend` (and fused kernels) silently left out of the system's model.
    from specpilot.engine.packed import PackedLinear
    from specpilot.harness.deployment import load_deployment
    from specpilot.harness.speed import system_and_stock_models

    dep = load_deployment("tiny-cpu")
    system, stock, _ = system_and_stock_models(dep, dep.options({"linear_backend": "onednn_all"}), "cpu")
    assert any(isinstance(m, PackedLinear) for m in system.modules())
    assert not any(isinstance(m, PackedLinear) for m in stock.modules())
    system, stock, _ = system_and_stock_models(dep, dep.options({"drafter": "none"}), "cpu")
    assert system is stock  # no model option differs: one model


def test_drafter_settings_bench_on_the_tiny_deployment():
    """bench/drafter_settings.py: every setting beside AR on the same requests; fp32 on a CPU is
    lossless, so every output equals AR's, and a setting that rebuilds the model is refused."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "bench/drafter_settings.py", "--deployment", "tiny-cpu", "--limit", "3",
           "--max-new-tokens", "20", "--threads", "1", "--setting", "block_size=2",
           "--setting", "drafter=ngram,block_size=6,verify=tree,tree_nodes=8"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "drafter_settings" and r["requests"] == 3
    assert [row["setting"] for row in r["rows"]] == [
        "AR", "block_size=2", "drafter=ngram,block_size=6,verify=tree,tree_nodes=8"]
    assert r["rows"][0]["speedup"] == 1.0 and r["rows"][0]["T"] == 1.0
    assert all(row["identical"] == "3/3" for row in r["rows"])
    assert r["rows"][2]["T"] > r["rows"][1]["T"] > 1.0  # a tree of 8 verifies more than a chain of 2
    bad = subprocess.run([*cmd[:2], "--deployment", "tiny-cpu", "--setting", "linear_backend=onednn"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "put it in --options" in bad.stderr


def test_a_batched_bench_ab_tests_two_systems_beside_batched_ar(tmp_path, capsys):
    """``--stock-options``: the 'stock' row runs the named options (here chains of 2 n-gram drafts) and the
    system the flags (chains of 3), both lossless beside the deployment's batched AR; a malformed value is
    refused with what to write."""
    toml = tmp_path / "tiny-batched.toml"
    toml.write_text('target = "tiny"\nmode = "batched"\nconcurrency = 2\nbench_requests = 4\n'
                    '[options]\nlinear_backend = "stream"\nngram_min_match = 1\n')
    common = ["--deployment", str(toml), "--max-new-tokens", "12", "--ns", "", "--threads", "1", "--no-plots",
              "--out", str(tmp_path)]
    assert bench.main([*common, "--stock-options", '{"block_size": 2}', "--block-size", "3"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["stock_options"]["block_size"] == 2 and r["systems"]["stock"]["options"]["block_size"] == 2
    assert r["systems"]["system"]["options"]["block_size"] == 3 and "drafter" in r["systems"]["batched AR"]["options"]
    assert all(s["lossless"] for s in r["systems"].values())
    for bad in ("[1, 2]", "{"):  # refused by the flag's type, as argparse refuses it: exit 2, one message
        with pytest.raises(SystemExit) as refused:
            bench.main([*common, "--stock-options", bad])
        assert refused.value.code == 2 and "must be a JSON object" in capsys.readouterr().err
    with pytest.raises(UserError, match="unknown engine option"):
        bench.main([*common, "--stock-options", '{"no_such_option": 1}'])
    one = tmp_path / "tiny.toml"
    one.write_text('target = "tiny"\n')
    with pytest.raises(UserError, match="for batched deployments"):
        bench.main(["--deployment", str(one), "--passes", "2"])


def test_bench_on_a_batched_deployment_times_throughput_under_load(tmp_path, capsys):
    """A batched deployment's bench: batched AR, stock speculation and the system under the same closed-loop
    load, each lossless (batch-invariant rows) in every one of its interleaved runs, the median run reported
    with its time split and steady rate, the c(N, B) table and its ceiling, plots; more clients than rows queue
    and the bench says so; two passes send each request twice."""
    toml = tmp_path / "tiny-batched.toml"
    toml.write_text('target = "tiny"\nmode = "batched"\nconcurrency = 2\nbench_requests = 5\n'
                    '[options]\nlinear_backend = "stream"\nngram_min_match = 1\n')
    rc = bench.main(["--deployment", str(toml), "--max-new-tokens", "16", "--ns", "1,3", "--batch-sizes", "1,2",
                     "--reps", "2", "--clients", "3", "--threads", "1", "--out", str(tmp_path),
                     "--batch-node-budget", "3", "--runs", "2", "--passes", "2"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["bench"] == "batched" and r["rows"] == 2 and r["clients"] == 3 and "wait in the queue" in r["queued"]
    assert set(r["systems"]) == {"batched AR", "stock", "system"} and r["options"] == {
        "dtype": "fp32", "linear_backend": "stream", "ngram_min_match": 1, "batch_node_budget": 3}
    for name, s in r["systems"].items():
        # two passes over the 5 requests, every answer checked; the steady window ends at the 10th send
        assert s["requests"] == 10 and s["lossless"] and s["tok_s"] > 0, name
        assert 0 < s["steady_s"] < s["wall_s"] and s["steady_tok_s"] > 0 and s["steady_speedup_over_batched_ar"] > 0
        assert s["max_waiting"] >= 1  # a third client's request waited for a row
        assert s["latency_p99_s"] >= s["latency_p50_s"] > 0 and s["ttft_p50_s"] > 0
        assert len(s["tok_s_runs"]) == 2 and s["tok_s"] == min(s["tok_s_runs"])  # the (lower) median of two loads
        assert abs(sum(s["time_split"].values()) - 1) < 1e-3 and s["time_split"]["prefill"] > 0
    assert r["systems"]["batched AR"]["tau"] == 1.0 and r["systems"]["batched AR"]["speedup_over_batched_ar"] == 1.0
    assert r["systems"]["stock"]["tau"] > 1.0  # the n-gram drafts were accepted
    # each load against the batched-AR load beside it: a geometric mean inside its own interval
    ar_runs = r["systems"]["batched AR"]["tok_s_runs"]
    for s in r["systems"].values():
        paired = s["paired_over_batched_ar"]
        ratios = [a / b for a, b in zip(s["tok_s_runs"], ar_runs, strict=True)]
        assert paired["pairs"] == 2 and paired["speedup"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
        assert paired["ci95"][0] <= paired["speedup"] <= paired["ci95"][1]
    cost = r["cost"]["rows"]
    assert [row["b"] for row in cost] == [1, 2] and cost[0]["ar_scaling"] == 1.0
    for row in cost:
        for n in ("1", "3"):
            assert row["ceiling"][n] == pytest.approx((int(n) + 1) / row["c"][n])
    assert (tmp_path / "batch_throughput.png").stat().st_size > 1000 and (tmp_path / "c_nb.png").is_file()
