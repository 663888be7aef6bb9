"""Engine options: one frozen dataclass whose defaults are stock.

Every knob an optimisation may turn lives here, once. The CLI flags (`add_option_flags`) and the
controller's option dicts (`options_from_dict`) are both generated from the fields below, so no
default is written twice. A patch that adds a mechanism adds a field whose default reproduces
stock's behaviour exactly.

Fields whose default is ``None`` mean "the deployment's value" (today only ``dtype``); they are
filled in by `specpilot.harness.deployment.Deployment.options` or, without a deployment, by
`EngineOptions.resolved`.

This module validates values and converts them between strings, dicts and dataclasses; it does
not know what any option does.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

OptionValue = str | int | float | bool


@dataclass(frozen=True)
class EngineOptions:
    """Stock configuration of the engine; see the comment beside each field."""

    drafter: Literal["ngram", "parallel", "eagle", "none"] = "ngram"  # "none" is plain AR decoding
    block_size: int = 4  # draft tokens per step (chain length, or tree depth when verify == "tree")
    verify: Literal["chain", "tree"] = "chain"  # stock verifies a single chain
    tree_nodes: int = 16  # draft-node budget of one tree (root excluded) when verify == "tree"
    dtype: Literal["fp32", "bf16"] | None = None  # None: the deployment's dtype
    weight_format: Literal["bf16", "w12"] = "bf16"  # "w12": specpilot_kernels.w12 replaces the linears
    lm_head: Literal["default", "fp32"] = "default"  # "fp32": the head computes in fp32 whatever dtype
    # "onednn": packed CPU GEMMs for multi-row blocks; "onednn_all": one-row decode steps too;
    # "stream": the AVX2 weight-streaming kernel of specpilot_kernels.cpu_gemm (specpilot_engine.packed)
    linear_backend: Literal["default", "onednn", "onednn_all", "stream"] = "default"
    compile: bool = False  # torch.compile(dynamic=True) the decoder's eager forward (no CUDA graphs)
    cuda_graphs: bool = False  # replay decode steps as captured CUDA graphs (specpilot_engine.graphs); no-op off CUDA
    fused_kernels: bool = False  # fused norm/RoPE/SiLU kernels + concatenated QKV, gate/up GEMMs (specpilot_engine.fused)
    fused_gemv: bool = False  # with fused_kernels: Triton GEMVs at small M, norm and SiLU·mul folded in
    ngram_max_match: int = 4  # longest context suffix the n-gram drafter tries to match
    ngram_min_match: int = 2  # shortest; below it the n-gram drafter proposes nothing
    drafter_weights: str = ""  # parallel drafter weights file; "": the one shipped for the target

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_value(f, getattr(self, f.name))
        if self.fused_gemv and not self.fused_kernels:
            raise ValueError("option 'fused_gemv' needs fused_kernels = true (it folds into the fused blocks)")
        if self.ngram_min_match > self.ngram_max_match:
            raise ValueError(
                f"ngram_min_match ({self.ngram_min_match}) must not exceed ngram_max_match ({self.ngram_max_match})"
            )

    def to_dict(self) -> dict[str, OptionValue | None]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> EngineOptions:
        return dataclasses.replace(self, **changes)

    def resolved(self, *, dtype: str = "fp32") -> EngineOptions:
        """These options with every "deployment's value" field filled from the arguments."""
        return self if self.dtype is not None else self.replace(dtype=dtype)

    @property
    def step_tokens(self) -> int:
        """Tokens one verification step puts through the target: the root plus a full chain of
        ``block_size`` drafts, or the tree's node budget when it verifies a tree."""
        tree = self.verify == "tree" and self.drafter != "none"
        return 1 + (self.tree_nodes if tree else self.block_size)

    def changed(self) -> dict[str, OptionValue | None]:
        """The fields that differ from stock (what a patch's option settings look like)."""
        stock = EngineOptions()
        return {k: v for k, v in self.to_dict().items() if getattr(stock, k) != v}


_MIN_INT = {"block_size": 1, "tree_nodes": 1, "ngram_max_match": 1, "ngram_min_match": 1}


def _hint(f: dataclasses.Field) -> Any:
    return typing.get_type_hints(EngineOptions)[f.name]


def _choices(hint: Any) -> tuple[tuple[Any, ...], bool]:
    """(allowed literal values, whether None is allowed) of a field's type hint."""
    nullable = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        nullable = type(None) in args
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint), nullable
    return (), nullable


def _base_type(hint: Any) -> type:
    choices, _ = _choices(hint)
    if choices:
        return type(choices[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _check_value(f: dataclasses.Field, value: Any) -> None:
    hint = _hint(f)
    choices, nullable = _choices(hint)
    if value is None:
        if nullable:
            return
        raise ValueError(f"option {f.name!r} may not be None")
    if choices:
        if value not in choices:
            raise ValueError(f"unknown value {value!r} for option {f.name!r}; allowed: {', '.join(map(str, choices))}")
        return
    base = _base_type(hint)
    # bool is a subclass of int: refuse True for an int field explicitly.
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"option {f.name!r} must be {base.__name__}, got {value!r}")
    if base is int and value < _MIN_INT.get(f.name, 0):
        raise ValueError(f"option {f.name!r} must be >= {_MIN_INT.get(f.name, 0)}, got {value}")


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Convert a str/int/float/bool from a dict or command line to the field's type."""
    hint = _hint(f)
    base = _base_type(hint)
    _, nullable = _choices(hint)
    if nullable and value in (None, "", "none", "None") and "none" not in _choices(hint)[0]:
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"option {f.name!r} must be a boolean, got {value!r}")
    if base is int:
        if isinstance(value, bool):
            raise ValueError(f"option {f.name!r} must be an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"option {f.name!r} must be an integer, got {value!r}") from None
        return value
    if base is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"option {f.name!r} must be a number, got {value!r}") from None
    return value


def allowed_options() -> dict[str, str]:
    """Option name -> a short description of what it accepts (for error messages and docs)."""
    out = {}
    for f in fields(EngineOptions):
        choices, nullable = _choices(_hint(f))
        desc = " | ".join(map(str, choices)) if choices else _base_type(_hint(f)).__name__
        out[f.name] = desc + (" | null" if nullable else "")
    return out


def options_from_dict(d: dict[str, OptionValue | None], base: EngineOptions | None = None) -> EngineOptions:
    """Options from a dict such as the controller sends; unknown keys and values are refused.

    Values may be strings ("4", "true") as well as typed values. ``base`` (stock by default)
    supplies the fields the dict does not name.
    """
    names = {f.name: f for f in fields(EngineOptions)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        allowed = ", ".join(f"{k} ({v})" for k, v in allowed_options().items())
        raise ValueError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    values = {k: _coerce(names[k], v) for k, v in d.items()}
    return dataclasses.replace(base or EngineOptions(), **values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per option. Unset flags stay None so only what the user typed overrides."""
    group = parser.add_argument_group("engine options (defaults are stock)")
    stock = EngineOptions()
    for f in fields(EngineOptions):
        hint = _hint(f)
        choices, _ = _choices(hint)
        default = getattr(stock, f.name)
        help_ = f"stock: {default if default is not None else 'the deployment’s'}"
        dest = "opt_" + f.name
        if _base_type(hint) is bool:
            group.add_argument(_flag(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif choices:
            group.add_argument(_flag(f.name), dest=dest, choices=choices, default=None, help=help_)
        else:
            group.add_argument(_flag(f.name), dest=dest, type=_base_type(hint), default=None, help=help_)


def overrides_from_args(args: argparse.Namespace) -> dict[str, OptionValue]:
    """The options the user set on the command line (flags added by `add_option_flags`)."""
    out = {}
    for f in fields(EngineOptions):
        value = getattr(args, "opt_" + f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def options_from_args(args: argparse.Namespace, base: EngineOptions | None = None) -> EngineOptions:
    """Options from parsed flags on top of ``base`` (stock by default)."""
    return options_from_dict(overrides_from_args(args), base)
