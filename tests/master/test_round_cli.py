"""`specpilot round`'s flags for the controller it starts."""

import argparse

from specpilot.app import cmd_round as cli


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


def _value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_the_deployment_sets_the_device_and_timing_the_command_line_does_not():
    cpu = cli.controller_flags(_parse())
    assert _value(cpu, "--device") == "cpu" and _value(cpu, "--trials") == "32" and _value(cpu, "--requests") == "3"
    assert _value(cpu, "--noise-trials") == "8"
    gpu = cli.controller_flags(_parse("--deployment", "smollm2-h200"))
    assert _value(gpu, "--device") == "cuda" and _value(gpu, "--trials") == "8" and _value(gpu, "--requests") == "8"
    assert _value(gpu, "--max-new-tokens") == "64"  # not in its [timing] table: the default
    mine = cli.controller_flags(_parse("--deployment", "smollm2-h200", "--device", "cuda:1", "--requests", "4"))
    assert _value(mine, "--device") == "cuda:1" and _value(mine, "--requests") == "4"


def test_the_tables_go_where_they_are_told_and_show_where_the_time_went(capsys):
    """With --json the round's tables go to stderr (`cmd_round` passes its stderr console), so stdout holds
    the JSON object only."""
    summary = {"sealed": {}, "candidates": [{"patch_id": "p1", "decision": "reject", "n_trials": 2, "gain": -0.25}],
               "timeline": {"total_s": 100.0, "idle_s": 5.0, "rows": [
                   {"what": "phase 0", "s": 60.0},
                   {"what": "candidate p1", "s": 35.0, "trials": 2, "checks": 5.0, "start_up": 10.0, "measured": 15.0,
                    "timing_other": 2.0, "forcing": 0.0, "other": 3.0}]}}
    cli._table(summary, cli.console)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "where the time went: 100 s" in captured.err and "candidate p1" in captured.err
