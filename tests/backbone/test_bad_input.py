"""Every command, given bad input as a new user would type it, says so in one line on stderr and exits
non-zero, with no traceback (exit codes: `specpilot.output`). The cases run in parallel processes."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from specpilot import output

CLI = [sys.executable, "-m", "specpilot.app.cli"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.patch").write_text("")
    (d / "bad.toml").write_text("target = [\n")
    (d / "bad.jsonl").write_text('{"prompt_ids": [1, 2], "tokens": [3\n')
    (d / "a-file").write_text("not a folder\n")
    (d / "empty-data").mkdir()
    return d


def cases(d) -> dict[str, tuple[list[str], int, str]]:
    """name -> (arguments, expected exit code, a word the error line must hold)."""
    data = ["--data", str(d / "empty-data")]
    bad = output.EXIT_BAD_INPUT
    return {
        "unknown command": (["nosuch"], bad, "invalid choice"),
        "round, unknown deployment": (["round", "--deployment", "nosuch", *data], bad, "no deployment 'nosuch'"),
        "round, negative minutes": (["round", "--minutes", "-3", *data], bad, "--minutes"),
        "bench, unknown deployment": (["bench", "--deployment", "nosuch"], bad, "no deployment"),
        "bench, malformed TOML": (["bench", "--deployment", str(d / "bad.toml")], bad, "not valid TOML"),
        "bench, negative tokens": (["bench", "--max-new-tokens", "-5"], bad, "--max-new-tokens"),
        "bench, bad --ns": (["bench", "--deployment", "tiny-cpu", "--ns", "1,x"], bad, "--ns"),
        "time, missing patch": (["time", str(d / "missing.patch"), *data], bad, "cannot read the patch"),
        "time, nothing to time": (["time", str(d / "empty.patch"), "--deployment", "tiny-cpu", *data], bad,
                                  "nothing to time"),
        "time, options not JSON": (["time", str(d / "empty.patch"), "--options", "not json", *data], bad, "JSON"),
        "time, options not an object": (["time", str(d / "empty.patch"), "--options", "[1]", *data], bad, "object"),
        "time, unknown option": (["time", str(d / "empty.patch"), "--deployment", "tiny-cpu", "--options",
                                  '{"no_such_option": 1}', *data], bad, "unknown engine option"),
        "time, unknown deployment": (["time", str(d / "empty.patch"), "--deployment", "nosuch", "--options",
                                      '{"verify": "tree"}', *data], bad, "no deployment"),
        "force, missing file": (["force", str(d / "missing.jsonl"), "--deployment", "tiny-cpu", *data], bad,
                                "cannot read"),
        "force, empty file": (["force", str(d / "empty.patch"), "--deployment", "tiny-cpu", *data], bad,
                              "no outputs"),
        "force, malformed JSON": (["force", str(d / "bad.jsonl"), "--deployment", "tiny-cpu", *data], bad, "JSON"),
        "force, unknown deployment": (["force", str(d / "bad.jsonl"), "--deployment", "nosuch", *data], bad,
                                      "no deployment"),
        "export, nothing named": (["export", *data], bad, "say what to export"),
        "export, unknown deployment": (["export", "--system", str(d / "out"), "--deployment", "nosuch", *data],
                                       bad, "no deployment"),
        "export, no systems yet": (["export", "--system", str(d / "out"), *data], bad, "no systems"),
        "drafter train, unknown deployment": (["drafter", "train", "--deployment", "nosuch"], bad, "no deployment"),
        "drafter train, negative budget": (["drafter", "train", "--minutes", "-1"], bad, "--minutes"),
        "sql, data is a file": (["sql", "SELECT 1", "--data", str(d / "a-file")], bad, "not a data directory"),
        "sql, no ledger": (["sql", "SELECT 1", *data], bad, "no ledger"),
        "audit, no ledger": (["audit", "nosuch", *data], bad, "no ledger"),
        "replay, no ledger": (["replay", *data], bad, "no ledger"),
        "up, data is a file": (["up", "--data", str(d / "a-file")], bad, "not a data directory"),
        "down, data is a file": (["down", "--data", str(d / "a-file")], bad, "not a data directory"),
        "status, data is a file": (["status", "--data", str(d / "a-file")], bad, "not a data directory"),
        "init, bad listen address": (["init", "--listen", "nowhere", *data], bad, "--listen"),
        "provision, data is a file": (["provision", "--data", str(d / "a-file")], bad, "not a data directory"),
        "migrate, no data directory": (["migrate", "--data", str(d / "nothere")], bad, "no data directory"),
        "w12, missing GGUF": (["w12", "pack", "--gguf", str(d / "missing.gguf")], bad, "missing.gguf"),
    }


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_every_command_refuses_bad_input_in_one_line(files):
    table = cases(files)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(table, pool.map(_run, [args for args, _, _ in table.values()]), strict=True))
    problems = []
    for name, (_, code, word) in table.items():
        r = results[name]
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if (r.returncode != code or len(lines) != 1 or "Traceback" in r.stderr or "error" not in lines[0]
                or word.lower() not in lines[0].lower()):
            problems.append(f"{name}: exit {r.returncode} (want {code}), stderr {r.stderr[-600:]!r}")
    assert not problems, "\n".join(problems)


def test_help_works_for_every_command():
    from specpilot.app.cli import PLUGGED_COMMANDS, build_parser

    names = sorted(build_parser([])._subparsers._group_actions[0].choices)
    assert set(PLUGGED_COMMANDS) <= set(names) and "migrate" in names
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(names, pool.map(_run, [[n, "--help"] for n in names]), strict=True))
    results["drafter train"] = _run(["drafter", "train", "--help"])
    bad = {n: r.stderr[-400:] for n, r in results.items() if r.returncode != 0 or "usage:" not in r.stdout}
    assert not bad, bad
