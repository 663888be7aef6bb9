"""EngineOptions: stock defaults, validation messages, dict and CLI round trips."""

from __future__ import annotations

import argparse

import pytest

from specpilot.engine.options import (
    EngineOptions,
    add_option_flags,
    allowed_options,
    options_from_args,
    options_from_dict,
    overrides_from_args,
)


def test_stock_defaults():
    o = EngineOptions()
    assert (o.drafter, o.block_size, o.verify, o.tree_nodes) == ("ngram", 4, "chain", 16)
    assert (o.dtype, o.weight_format, o.lm_head, o.compile) == (None, "bf16", "default", False)
    assert o.changed() == {}
    assert o.resolved(dtype="bf16").dtype == "bf16"
    assert EngineOptions(dtype="fp32").resolved(dtype="bf16").dtype == "fp32"


def test_unknown_key_lists_allowed():
    with pytest.raises(ValueError) as e:
        options_from_dict({"blocksize": 4})
    msg = str(e.value)
    assert "'blocksize'" in msg
    for name in allowed_options():
        assert name in msg
    assert "chain | tree" in msg


@pytest.mark.parametrize("d, fragment", [
    ({"verify": "graph"}, "unknown value 'graph' for option 'verify'; allowed: chain, tree"),
    ({"drafter": "medusa"}, "allowed: ngram, parallel, eagle, none"),
    ({"dtype": "fp16"}, "allowed: fp32, bf16"),
    ({"block_size": 0}, "must be >= 1"),
    ({"block_size": "four"}, "must be an integer"),
    ({"block_size": True}, "must be an integer"),
    ({"compile": "maybe"}, "must be a boolean"),
    ({"ngram_min_match": 5}, "must not exceed ngram_max_match"),
])
def test_bad_values(d, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("|", r"\|")):
        options_from_dict(d)


def test_dict_coercion_and_base():
    o = options_from_dict({"block_size": "8", "compile": "true", "verify": "tree", "tree_nodes": 32.0})
    assert (o.block_size, o.compile, o.verify, o.tree_nodes) == (8, True, "tree", 32)
    base = EngineOptions(drafter="none", dtype="bf16")
    o = options_from_dict({"block_size": 2}, base)
    assert (o.drafter, o.dtype, o.block_size) == ("none", "bf16", 2)
    assert options_from_dict({"dtype": ""}).dtype is None
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        o.block_size = 3


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="allowed: chain, tree"):
        EngineOptions(verify="beam")
    with pytest.raises(ValueError, match="must be int"):
        EngineOptions(tree_nodes=1.5)


def test_cli_flags_are_generated():
    p = argparse.ArgumentParser()
    add_option_flags(p)
    args = p.parse_args([])
    assert overrides_from_args(args) == {}
    assert options_from_args(args) == EngineOptions()
    args = p.parse_args(["--verify", "tree", "--block-size", "6", "--compile", "--ngram-min-match", "1"])
    assert overrides_from_args(args) == {"verify": "tree", "block_size": 6, "compile": True, "ngram_min_match": 1}
    o = options_from_args(args, EngineOptions(dtype="bf16"))
    assert (o.verify, o.block_size, o.compile, o.dtype) == ("tree", 6, True, "bf16")
    with pytest.raises(SystemExit):
        p.parse_args(["--verify", "graph"])
    assert "--no-compile" in p.format_help()
