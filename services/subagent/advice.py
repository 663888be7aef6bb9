"""An agent's feedback tools: `quick_time` and `profile` of its workspace. Advice, never a verdict.

`Advisor` runs the workspace's system, and the current best it was built from, as timing workers
(`specpilot.sandbox.Worker`) each in its own `specpilot.sandbox.Sandbox` (the same rules as
`run_tests`: read-only source, no network, cleared environment, the data directory hidden but for its
model cache, bound read-only),
on the first few requests of the deployment's *public* dev split (the controller's secret split is
not known here, and these figures decide nothing).

- ``quick_time(options)``: both workers alive, each request answered by both in turn (the order
  flipped on every other request), timed on this process's clock; says the time ratio and whether the
  tokens are the best's own (when they differ the controller will force them).
- ``profile(options)``: the workspace's system on the same requests through the worker's ``measure``
  request (`specpilot.harness.replay.measure`): tokens per step and milliseconds per kernel class.

The model cache the workers read is converted once per data directory by trusted stock code in a
subprocess (as the controller's `Evaluator.prepare` does); prompts are encoded with stock's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.paths import REPO_ROOT
from specpilot.sandbox import Limits, Sandbox, Worker, WorkerFailed

ADVICE_REQUESTS = 2
ADVICE_TOKENS = 32
ADVICE_LIMITS = Limits(wall_s=300.0, memory_bytes=6 << 30, pids=256)


@dataclass
class Advisor:
    """Feedback runs for one direction: its deployment, the data directory holding the model cache, and
    the best system's options (the base the workspace was built on)."""

    deployment: str
    data: Path
    base_options: dict = field(default_factory=dict)
    threads: int = 1
    limits: Limits = ADVICE_LIMITS
    _prompts: list[list[int]] | None = None
    _visible: list[Path] = field(default_factory=list)  # the deployment's files outside the checkout

    def prompts(self) -> list[list[int]]:
        """The first `ADVICE_REQUESTS` requests of the deployment's public dev split, encoded by stock."""
        if self._prompts is None:
            code = ("import json, sys; from pathlib import Path\n"
                    "from specpilot.harness.deployment import load_deployment, load_engine\n"
                    "from specpilot.harness.requests import encode_requests, load_requests\n"
                    "from specpilot.engine.weights import load_tokenizer\n"
                    "dep = load_deployment(sys.argv[1]); data = Path(sys.argv[2])\n"
                    "load_engine(sys.argv[1], device='cpu', data_dir=data)  # the model cache the workers read\n"
                    "reqs = load_requests(dep, 'dev')[: int(sys.argv[3])]\n"
                    "print(json.dumps({'prompts': encode_requests(reqs, load_tokenizer(dep.target, data_dir=data)),\n"
                    "                  'visible': [str(p) for p in dep.external_paths()]}))\n")
            res = subprocess.run([sys.executable, "-c", code, self.deployment, str(self.data), str(ADVICE_REQUESTS)],
                                 cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise WorkerFailed(f"cannot prepare the deployment {self.deployment!r}: {res.stderr.strip()[-500:]}")
            prepared = json.loads(res.stdout.strip().splitlines()[-1])
            self._prompts = [list(map(int, p)) for p in prepared["prompts"]]
            self._visible = [Path(p) for p in prepared["visible"]]
        return self._prompts

    @contextlib.contextmanager
    def _worker(self, src: Path, options: dict):
        self.prompts()  # also finds what the deployment reads outside the checkout
        with Sandbox(src=src, models=Path(self.data) / "models", hide=[self.data], visible=self._visible,
                     limits=self.limits, threads=self.threads) as sbx:
            worker = Worker(sbx, sys.executable, self.deployment, options, ready_timeout_s=self.limits.wall_s)
            try:
                yield worker
            finally:
                worker.close()

    @contextlib.contextmanager
    def _base(self, workspace: Path, base_commit: str):
        """A read-only copy of the workspace at its base commit (the current best)."""
        with tempfile.TemporaryDirectory(prefix="sp-advice-") as tmp:
            archive = subprocess.run(["git", "-C", str(workspace), "archive", base_commit], capture_output=True,
                                     check=True, timeout=120).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True, timeout=120)
            yield Path(tmp)

    def quick_time(self, workspace: Path, base_commit: str, options: dict) -> str:
        prompts, wall = self.prompts(), self.limits.wall_s
        options = {**self.base_options, **options}
        seconds = {"best": 0.0, "workspace": 0.0}
        tokens: dict[str, list[list[int]]] = {"best": [], "workspace": []}
        with self._base(workspace, base_commit) as base, self._worker(base, self.base_options) as best, \
                self._worker(workspace, options) as mine:
            workers = {"best": best, "workspace": mine}
            for i, p in enumerate(prompts):
                for who in (("best", "workspace") if i % 2 == 0 else ("workspace", "best")):
                    t0 = time.perf_counter()
                    out, _ = workers[who].generate(p, ADVICE_TOKENS, timeout=wall)
                    seconds[who] += time.perf_counter() - t0
                    tokens[who].append(out)
        ratio = seconds["best"] / seconds["workspace"] if seconds["workspace"] > 0 else float("inf")
        same = tokens["best"] == tokens["workspace"]
        return (f"advice, not a verdict: on {len(prompts)} public dev requests x {ADVICE_TOKENS} tokens, one run each, "
                f"the workspace with options {options} took {seconds['workspace']:.2f} s against the current best's "
                f"{seconds['best']:.2f} s ({ratio:.2f}x the best's speed). Its tokens are "
                + ("identical to the best's." if same else "NOT the best's: the controller will force them against "
                   "the target, and a change beyond near-ties is rejected."))

    def profile(self, workspace: Path, options: dict) -> str:
        prompts, options = self.prompts(), {**self.base_options, **options}
        with self._worker(workspace, options) as worker:
            replies = [worker.request({"measure": {"prompt_ids": p, "max_new_tokens": ADVICE_TOKENS}},
                                      timeout=self.limits.wall_s)[0] for p in prompts]
        steps = sum(int(r["steps"]) for r in replies)
        new = sum(len(r["tokens"]) for r in replies) - len(replies)
        classes: dict[str, float] = {}
        for r in replies:
            for k, v in r["profile_ms"].items():
                classes[k] = classes.get(k, 0.0) + float(v) / len(replies)
        top = sorted(classes.items(), key=lambda kv: -kv[1])[:12]
        return (f"advice, not a verdict: the workspace with options {options} on {len(prompts)} public dev requests "
                f"x {ADVICE_TOKENS} tokens: {new / max(1, steps):.2f} tokens per step; ms per request by kernel "
                "class: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
