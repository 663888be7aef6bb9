"""The timing worker's line protocol, run as the controller runs it: a subprocess over pipes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specpilot.harness.deployment import load_engine

REPO = Path(__file__).resolve().parents[2]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specpilot.harness.worker", *args], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_worker_protocol():
    w = _start("--deployment", "tiny-cpu", "--options", '{"verify": "tree"}')
    try:
        assert json.loads(w.stdout.readline()) == {"ready": True}
        prompt = list(b"abcabcabcabc")
        w.stdin.write(json.dumps({"prompt_ids": prompt, "max_new_tokens": 20}) + "\n")
        w.stdin.flush()
        reply = json.loads(w.stdout.readline())
        expected = load_engine("tiny-cpu", {"verify": "tree"}).generate(prompt, 20)
        assert reply == {"tokens": expected.tokens, "steps": expected.steps}
        w.stdin.write(json.dumps({"prompt_ids": [], "max_new_tokens": 5}) + "\n")
        w.stdin.write("not json\n")
        w.stdin.flush()
        assert "the prompt is empty" in json.loads(w.stdout.readline())["error"]
        assert "error" in json.loads(w.stdout.readline())
        w.stdin.close()
        assert w.wait(timeout=30) == 0
    finally:
        w.kill()


def test_worker_refuses_bad_options():
    w = _start("--deployment", "tiny-cpu", "--options", '{"verify": "beam"}')
    out, _ = w.communicate(timeout=60)
    reply = json.loads(out.splitlines()[0])
    assert reply["ready"] is False and "allowed: chain, tree" in reply["error"]
    assert w.returncode == 1


TINY_BATCHED = """name = "tiny-batched"
target = "tiny"
mode = "batched"
concurrency = 3
drafter = "ngram"
[options]
linear_backend = "stream"
ngram_min_match = 1
"""


def test_worker_serves_a_closed_loop_load_for_a_batched_deployment(tmp_path):
    """A batched deployment's worker answers a ``load`` (its concurrency's clients, one forward a step for
    the rows in flight) with every request's tokens in request order: batch-1 AR's tokens, since its rows
    are batch-invariant; with the batching mechanisms on too. A bad load is an error, and the worker goes on."""
    path = tmp_path / "tiny-batched.toml"
    path.write_text(TINY_BATCHED)
    prompts = [list(b"abcabcabcabc"), list(b"hello hello hello"), list(b"xyzxyz"), list(b"0123012301230123"),
               list(b"qq"), list(b"the cat the cat the")]
    reference = load_engine(str(path), {"drafter": "none"})
    expected = [reference.generate(p, 24).tokens for p in prompts]
    for options in ("{}", '{"batch_node_budget": 5, "batch_adaptive_block": true, "prefill_chunk": 7}'):
        w = _start("--deployment", str(path), "--options", options)
        try:
            assert json.loads(w.stdout.readline()) == {"ready": True}
            w.stdin.write(json.dumps({"load": {"requests": prompts, "max_new_tokens": 24, "concurrency": 3}}) + "\n")
            w.stdin.write(json.dumps({"load": {"requests": [], "max_new_tokens": 24, "concurrency": 3}}) + "\n")
            w.stdin.write(json.dumps({"load": {"requests": prompts[:2], "max_new_tokens": 24, "concurrency": 3}}) + "\n")
            w.stdin.flush()
            reply = json.loads(w.stdout.readline())
            assert reply["outputs"] == expected, options
            assert reply["steps"] < sum(map(len, expected))  # rows shared the forwards
            assert "needs requests" in json.loads(w.stdout.readline())["error"]
            assert json.loads(w.stdout.readline())["outputs"] == expected[:2]  # the decoder is reused
            w.stdin.write(json.dumps({"batch_cost": {"rows": 3, "context": 20, "drafts": [1, 4]}}) + "\n")
            w.stdin.flush()
            cost = json.loads(w.stdout.readline())
            assert cost["t_ar_s"] > 0 and set(cost["c"]) == {"1", "4"} and all(c > 0 for c in cost["c"].values())
            assert cost["t_one_row_s"] > 0
            w.stdin.close()
            assert w.wait(timeout=30) == 0
        finally:
            w.kill()
