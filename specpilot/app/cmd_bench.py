"""Engine commands for the `specpilot` CLI: ``bench`` and ``drafter train``.

`add_commands(subparsers)` registers them on an argparse subparsers object; each parser gets a
``func`` default taking the parsed namespace and returning an exit status:

    sub = parser.add_subparsers(dest="command")
    specpilot.app.cmd_bench.add_commands(sub)
    args = parser.parse_args()
    sys.exit(args.func(args))

Imports of torch and the engine happen when a command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse


def _bench(args: argparse.Namespace) -> int:
    from specpilot.harness import bench

    return bench.run(args)


def _drafter_train(args: argparse.Namespace) -> int:
    from specpilot.harness import train

    return train.run(args)


def add_commands(subparsers) -> None:
    from specpilot.harness import bench

    p = subparsers.add_parser("bench", help="measure tau(N), c(N), S(N), end-to-end speedup and a profile",
                              description=bench.__doc__.split("\n")[0])
    bench.add_arguments(p)
    p.set_defaults(func=_bench)

    d = subparsers.add_parser("drafter", help="drafter tools")
    dsub = d.add_subparsers(dest="drafter_command", required=True)
    t = dsub.add_parser("train", help="train a drafter for the deployment's target (self-distillation on it)")
    from specpilot.harness import train

    train.add_arguments(t)
    t.set_defaults(func=_drafter_train)
