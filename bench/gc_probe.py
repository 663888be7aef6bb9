"""Time Python's garbage collector during a command: `python bench/gc_probe.py MODULE [ARGS...]` runs
``python -m MODULE ARGS`` with `gc.callbacks` counting each generation's collections, their seconds and the
longest one, and prints them (one JSON line on stderr) at exit. Measures only; the command runs unchanged.

    PYTHONPATH=. python bench/gc_probe.py specpilot.app.cmd_bench --deployment smollm2-h200-batched --ns= ...
"""

from __future__ import annotations

import atexit
import gc
import json
import runpy
import sys
import time

counts, seconds, longest, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0]


def _track(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        g, took = info["generation"], time.perf_counter() - started[0]
        counts[g] += 1
        seconds[g] += took
        longest[g] = max(longest[g], took)


def _report() -> None:
    print(json.dumps({"gc_collections": counts, "gc_seconds": [round(x, 4) for x in seconds],
                      "gc_longest_ms": [round(1e3 * x, 2) for x in longest]}), file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    gc.callbacks.append(_track)
    atexit.register(_report)
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
