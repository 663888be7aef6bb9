"""What the two halves of `specpilot bench` share (`specpilot.app.cmd_bench`, `.cmd_bench_batched`): the
``--ns`` draft lengths, whether llama.cpp's rows run, where the output goes, and writing the result
(plots, ``bench.json``, the table on stderr, one JSON line on stdout)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.errors import UserError
from specpilot.harness.deployment import Deployment


def draft_lengths(text: str) -> list[int]:
    """``--ns``: comma-separated draft lengths, each at least 1 ('' for none); UserError otherwise."""
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ns must be comma-separated draft lengths such as 1,2,4,8 (or ''), got {text!r}") from None
    if any(n < 1 for n in ns):
        raise UserError(f"--ns draft lengths must be at least 1, got {text!r}")
    return ns


def output_dir(args: argparse.Namespace, dep: Deployment) -> Path:
    """``--out``, else ``<data>/bench/<deployment>``, created."""
    out = args.out
    if out is None:
        from specpilot.paths import default_data_dir

        out = (args.data_dir or default_data_dir()) / "bench" / dep.name
    out.mkdir(parents=True, exist_ok=True)
    return out


def llamacpp_rows(args: argparse.Namespace, dep: Deployment, device, run) -> dict | None:
    """llama.cpp's rows beside this engine's (SmolLM2 on the CPU, when it is built here and not
    ``--no-llamacpp``): ``run(spec_options)``'s result, or why there is none; None where it does not apply.
    A comparison, never a reason to lose the bench."""
    if args.no_llamacpp or dep.target != "smollm2-135m" or device.type != "cpu":
        return None
    from specpilot.harness.server import llama_cpp_built

    if llama_cpp_built() is None:
        return {"skipped": "llama.cpp is not built here: bash scripts/build_llamacpp.sh"}
    try:
        return run(json.loads(args.llamacpp_spec))
    except Exception as e:  # noqa: BLE001 - reported in the result
        return {"error": f"{type(e).__name__}: {e}"}


def report(result: dict, out: Path, table, plots=None) -> int:
    """Plots (unless ``plots`` is None), ``bench.json`` in ``out``, the table on stderr, the result as one JSON
    line on stdout."""
    if plots is not None:
        result["plots"] = plots(result, out)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    table(result)
    print(json.dumps(result, separators=(",", ":")))
    return 0

