"""TEST ONLY: the controller service with one fault injected into a decision, once.

Run as ``python -m tests.controller.faulty_controller --fault F --marker FILE [controller flags]``:

- ``kill-before-decision``: SIGKILL itself just before a decision's atomic publish (the verdict, the
  ``BestAdvanced``, the memory entry);
- ``kill-after-decision``: just after it, before the patch is acknowledged;
- ``none``: no fault.

The fault fires once (FILE is created first; while it exists the process runs clean), so a supervisor that
restarts the same command gets a clean controller. Every decision is a promotion (`stats.decide` is
wrapped): whether a patch is faster on the tiny model is noise, and what these tests ask is that a
promotion is neither lost nor made twice whatever happens to the processes around it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path

from specpilot.services.controller import main as controller
from specpilot.services.controller import stats

FAULTS = ("none", "kill-before-decision", "kill-after-decision")


def _always_promote(decide):
    def wrapped(*args, **kwargs):
        d = decide(*args, **kwargs)
        return dataclasses.replace(d, decision="promote", rule="promoted", reason=f"(test: forced) {d.reason}")
    return wrapped


def _with_fault(emit_together, fault: str, marker: Path):
    async def wrapped(self, events, cause):
        fire = fault != "none" and not marker.exists()
        if fire:
            marker.write_text(fault)
        if fire and fault == "kill-before-decision":
            os.kill(os.getpid(), signal.SIGKILL)
        stamped = await emit_together(self, events, cause)
        if fire and fault == "kill-after-decision":
            os.kill(os.getpid(), signal.SIGKILL)
        return stamped
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--fault", choices=FAULTS, required=True)
    ap.add_argument("--marker", type=Path, required=True)
    mine, rest = ap.parse_known_args(sys.argv[1:])
    stats.decide = _always_promote(stats.decide)
    controller.Controller.emit_together = _with_fault(controller.Controller.emit_together, mine.fault, mine.marker)
    controller.main(rest)


if __name__ == "__main__":
    main()
