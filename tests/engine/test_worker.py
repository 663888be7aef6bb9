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
