"""A round in which a scripted agent writes the certified exact-argmax LM head, on any deployment.

The services run from a copy of this checkout without the mechanism (`tests.subagent.trajectories`);
the planner (Anthropic SDK) and the coder (OpenAI SDK) talk to local wire servers replaying one
plan and the agent's trajectory (read, apply the mechanism's diff, run the option tests, finish with
``screened_head = True``). The round times the patch against stock, promotes it or not, and runs the
sealed final. Prints ``specpilot round``'s table; the last line is its JSON summary.

    python bench/scripted_round.py --deployment smollm2-cpu --data /tmp/sr-data [round flags]

Needs bubblewrap and a fresh data directory (the copy's stock differs from this checkout's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.subagent import trajectories  # noqa: E402
from tests.subagent.wire import Call, ScriptedServer, Turn  # noqa: E402

TITLE = "certified argmax LM head"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="smollm2-cpu")
    ap.add_argument("--data", required=True, help="a fresh data directory")
    ap.add_argument("--threads", type=int, default=0, help="controller threads (0: its default)")
    args, rest = ap.parse_known_args(argv)
    data = Path(args.data).resolve()
    if data.exists() and any(data.iterdir()):
        raise SystemExit(f"{data} is not empty: the round needs a fresh data directory")
    stock = trajectories.stock_without_mechanism(Path(tempfile.mkdtemp(prefix="sp-stock-")))
    plan = [Turn("", [Call("plan", {"directions": [
        {"title": TITLE, "factor": "kernel", "rationale": "greedy decoding reads only the head's argmax"}]})])]
    with ScriptedServer(plan) as planner, ScriptedServer(by_key={TITLE: trajectories.screened_head_turns(stock)}) as coder:
        env = {**os.environ, "PYTHONPATH": str(stock), "ANTHROPIC_API_KEY": "sk-ant-scripted",
               "ANTHROPIC_BASE_URL": planner.url, "OPENAI_API_KEY": "sk-scripted", "OPENAI_BASE_URL": coder.openai_url}
        cli = [sys.executable, "-c", "from specpilot.app.cli import main; raise SystemExit(main())"]
        cmd = [*cli, "round", "--data", str(data), "--deployment", args.deployment, "--planner", "anthropic:claude-scripted",
               "--coder", "openai:gpt-scripted", "--rounds", "1", "--directions", "1", "--no-shipped-memory",
               *(["--threads", str(args.threads)] if args.threads else []), *rest]
        print("stock without the mechanism:", stock, flush=True)
        try:
            return subprocess.run(cmd, cwd=stock, env=env).returncode
        finally:
            subprocess.run([*cli, "down", "--data", str(data)], cwd=stock, env=env)
            shutil.rmtree(stock, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
