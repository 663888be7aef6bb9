"""`specpilot round`'s flags for the controller it starts."""

import argparse

from services.master import cli


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    return parser.parse_args(["round", *argv])


def test_controller_flags_carry_timing_settings_and_interleave_only_when_given():
    flags = cli.controller_flags(_parse("--device", "cuda", "--trials", "9"))
    assert flags[:2] == ["--device", "cuda"]
    assert flags[flags.index("--trials") + 1] == "9"
    assert not any("interleave" in f for f in flags)  # the controller's own default decides
    assert cli.controller_flags(_parse("--interleave"))[-1] == "--interleave"
    assert cli.controller_flags(_parse("--no-interleave"))[-1] == "--no-interleave"
