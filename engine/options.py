"""Engine options: one frozen dataclass whose defaults are stock, each field describing itself.

Every knob an optimisation may turn lives here, once, with what the rest of SpecPilot needs to know
about it in its `OptionInfo` (``option(default, ...)``): a help line, the values worth timing, the
cost-model factor it attacks, the device kinds it means something on, whether it changes the loaded
model, which other settings it requires, and whether it may change the output's bits. The CLI flags
(`add_option_flags`), the controller's option dicts (`options_from_dict`), the planner's sweeps and
dependencies (`sweeps`, `requirements`), the model-option list (`model_options`) and the cost model's
predictable options (`factor_options("tau")`) are all generated from the fields below, so adding an
option touches this file alone. A patch that adds a mechanism adds a field whose default reproduces
stock's behaviour exactly. Fields are grouped by the factor they attack and, within a factor, listed
in the order the planner tries them when the cost model ranks them equal.

Fields whose default is ``None`` mean "the deployment's value" (today only ``dtype``); they are
filled in by the harness's ``Deployment.options`` or, without a deployment, by `EngineOptions.resolved`.

This module validates values and converts them between strings, dicts and dataclasses; it does
not know what any option does, and imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

OptionValue = str | int | float | bool
FACTORS = ("tau", "overhead", "kernel")  # the cost model's factors (its ceiling's gaps), in planning order
DEVICE_KINDS = ("cpu", "cuda")
# serving modes of a deployment: one request at a time, or continuous batching (specpilot.engine.batch)
MODES = ("batch1", "batched")


@dataclass(frozen=True)
class OptionInfo:
    """What an option is, beside its type and stock default."""

    help: str
    sweep: tuple[OptionValue, ...] = ()  # values worth timing against the best, in the planner's order
    factor: str | None = None  # the cost-model factor it attacks (FACTORS), None: not a speed mechanism
    devices: tuple[str, ...] = DEVICE_KINDS  # device kinds where setting it means something
    modes: tuple[str, ...] = MODES  # serving modes where setting it means something
    dtypes: tuple[str, ...] = ()  # deployment dtypes where it is worth timing (empty: any)
    model: bool = False  # applied to the loaded target (`apply_model_options`): a different model
    requires: Mapping[str, OptionValue] = field(default_factory=dict)  # settings it only means something with
    may_change_outputs: bool = False  # True: may change the output's bits (forcing decides); False: lossless
    minimum: int | None = None  # the smallest value of an integer option
    # values that carry weights trained for one target (a learned drafter): a memory entry setting one
    # applies only to that target (`specpilot.entries.requirements_for`)
    per_target: tuple[OptionValue, ...] = ()

    def __post_init__(self) -> None:
        if self.factor is not None and self.factor not in FACTORS:
            raise ValueError(f"factor must be one of {FACTORS} or None, got {self.factor!r}")
        if bad := set(self.devices) - set(DEVICE_KINDS):
            raise ValueError(f"unknown device kinds {sorted(bad)}; known: {DEVICE_KINDS}")
        if bad := set(self.modes) - set(MODES):
            raise ValueError(f"unknown serving modes {sorted(bad)}; known: {MODES}")


def option(default: Any, help: str, **info: Any) -> Any:
    """A field of `EngineOptions` (or a subclass): its stock ``default`` and its `OptionInfo`."""
    return field(default=default, metadata={"info": OptionInfo(help=help, **info)})


@dataclass(frozen=True)
class EngineOptions:
    """Stock configuration of the engine; each field's `OptionInfo` says what it is."""

    # --- tau: tokens committed per step. Lossless by construction: the target verifies every token.
    verify: Literal["chain", "tree"] = option(
        "chain", "verify a single chain (stock) or a best-first tree of drafts", sweep=("tree",), factor="tau")
    tree_nodes: int = option(
        16, "draft-node budget of one tree (root excluded) when verify = tree", sweep=(8, 32), factor="tau",
        requires={"verify": "tree"}, minimum=1)
    block_size: int = option(
        4, "draft tokens per step (chain length, or tree depth when verify = tree)", sweep=(2, 6, 8),
        factor="tau", minimum=1)
    ngram_max_match: int = option(
        4, "longest context suffix the n-gram drafter tries to match", factor="tau", minimum=1)
    ngram_min_match: int = option(
        2, "shortest suffix the n-gram drafter matches; below it it proposes nothing", sweep=(1, 3),
        factor="tau", minimum=1, requires={"drafter": "ngram"})
    drafter: Literal["ngram", "parallel", "eagle", "none"] = option(
        "ngram", "who drafts: n-gram lookup, the parallel or eagle drafter, or none (plain AR decoding)",
        sweep=("eagle", "parallel"), factor="tau", per_target=("eagle", "parallel"))
    drafter_weights: str = option("", "parallel drafter weights file; empty: the one shipped for the target")
    # Batched serving (specpilot.engine.batch.BatchPolicy): which rows draft and verify how much. They only
    # choose what is verified, never what is accepted, so they are lossless like the options above.
    batch_node_budget: int = option(
        0, "batched: draft tokens a step over all rows, given to the rows likeliest to accept them "
        "(0: every row drafts block_size, or tree_nodes)", sweep=(12, 8, 16), factor="tau", modes=("batched",))
    batch_adaptive_block: bool = option(
        False, "batched: each row drafts 1 + its recent mean accepted drafts a step, at most block_size",
        sweep=(True,), factor="tau", modes=("batched",))
    batch_spec_max_rows: int = option(
        0, "batched: a step with more decoding rows than this drafts nothing (batched AR under full load; "
        "speculation resumes as the batch thins; 0: always speculate)", sweep=(4, 6), factor="tau",
        modes=("batched",), minimum=0)

    # --- precision: the deployment's choice, never swept.
    dtype: Literal["fp32", "bf16"] | None = option(
        None, "compute dtype; unset: the deployment's", model=True, may_change_outputs=True)
    lm_head: Literal["default", "fp32"] = option(
        "default", "fp32: the LM head computes in fp32 whatever the dtype", model=True, may_change_outputs=True)

    # --- overhead: host and launch time between kernels.
    cuda_graphs: bool = option(
        False, "replay decode steps as captured CUDA graphs (specpilot.engine.graphs); no-op off CUDA. Batched: "
        "a step without prompt segments runs every row padded to the longest tree, its attention one padded "
        "call (as batch_attention = padded: bits may differ from per-row attention)",
        sweep=(True,), factor="overhead", devices=("cuda",), may_change_outputs=True)
    fused_kernels: bool = option(
        False, "fused norm/RoPE/SiLU kernels and concatenated QKV, gate/up GEMMs (specpilot.engine.fused; "
        "batched: every cache row's RoPE and cache writes in one kernel)", sweep=(True,), factor="overhead",
        devices=("cuda",), model=True, may_change_outputs=True)
    fused_gemv: bool = option(
        False, "with fused_kernels: Triton GEMVs at small M, norm and SiLU·mul folded in", sweep=(True,),
        factor="overhead", devices=("cuda",), model=True, requires={"fused_kernels": True},
        may_change_outputs=True, modes=("batch1",))
    prefill_chunk: int = option(
        0, "batched: prompts join in segments of at most this many tokens a step, inside the steps' forwards "
        "(0: each prompt as a forward of its own before the step)", sweep=(64, 128), factor="overhead",
        modes=("batched",), may_change_outputs=True)
    batch_device_drafts: bool = option(
        False, "batched, with CUDA graphs and the parallel drafter's chains: lookups, net and chains run on the "
        "GPU from a device copy of each row's context and the verify step reads the chains in place (one sync "
        "a step, nothing drafted a row on the host; past the net's k a chain goes on with the lookup's tokens)",
        sweep=(True,), factor="overhead", devices=("cuda",), modes=("batched",),
        requires={"drafter": "parallel", "verify": "chain", "cuda_graphs": True})
    batch_compile_drafts: bool = option(
        False, "batch_device_drafts: the device chain proposal through torch.compile before its capture, over "
        "every cache row (one compilation): its ~110 small kernels fused into fewer launches (on an H100 its GPU "
        "time a step went 0.41 -> 0.10 ms); drafts may differ in low bits, outputs cannot (every draft is "
        "verified)", sweep=(True,), factor="overhead", devices=("cuda",), modes=("batched",),
        requires={"batch_device_drafts": True})
    batch_attention: Literal["per_row", "padded"] = option(
        "per_row", "batched: a step's attention as one call a row (stock) or one padded call over all rows "
        "(fewer launches; the sum over keys spans the longest row, so bits may differ)", sweep=("padded",),
        factor="overhead", modes=("batched",), may_change_outputs=True)
    compile: bool = option(
        False, "torch.compile(dynamic=True) the decoder's eager forward (no CUDA graphs)", sweep=(True,),
        factor="overhead", devices=("cuda",), model=True, may_change_outputs=True)

    # --- kernel: each step's kernels against their byte floors.
    weight_format: Literal["bf16", "w12"] = option(
        "bf16", "w12: the lossless 12-bit format of specpilot.kernels.w12 replaces the linears", sweep=("w12",),
        # lossless for bf16 weights only: on an fp32 deployment it would round them (forcing would reject it)
        factor="kernel", devices=("cuda",), dtypes=("bf16",), model=True, may_change_outputs=True)
    # "stream" first: the AVX2/AVX-512/AMX kernel of specpilot.kernels.cpu_gemm beat oneDNN on every CPU
    # measured (docs/FIGURES.md); oneDNN's packed GEMMs come next where it loses.
    linear_backend: Literal["default", "onednn", "onednn_all", "stream"] = option(
        "default", "CPU linears: onednn (packed GEMMs for multi-row blocks), onednn_all (one-row steps too), "
        "stream (specpilot.kernels.cpu_gemm, specpilot.engine.packed)", sweep=("stream", "onednn_all", "onednn"),
        factor="kernel", devices=("cpu",), model=True, may_change_outputs=True)
    screened_head: bool = option(
        False, "greedy argmax of the LM head from a bf16 screen with a certified error bound, exact logits only "
        "where one can win (specpilot.engine.screened_head); no effect off an fp32 CPU head", sweep=(True,),
        factor="kernel", devices=("cpu",), model=True, may_change_outputs=True)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_value(f, getattr(self, f.name), type(self))
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
    def verifies_tree(self) -> bool:
        """Whether a step verifies a tree of drafts (AR, with no drafter, verifies nothing)."""
        return self.verify == "tree" and self.drafter != "none"

    @property
    def step_tokens(self) -> int:
        """Tokens one verification step puts through the target: the root plus a full chain of
        ``block_size`` drafts, or the tree's node budget when it verifies a tree."""
        return 1 + (self.tree_nodes if self.verifies_tree else self.block_size)

    def changed(self) -> dict[str, OptionValue | None]:
        """The fields that differ from stock (what a patch's option settings look like)."""
        stock = EngineOptions()
        return {k: v for k, v in self.to_dict().items() if getattr(stock, k) != v}


def info(f: dataclasses.Field) -> OptionInfo:
    """A field's `OptionInfo`. A field declared without ``option(...)`` (a quick patch) still works: it
    gets an empty one, so nothing sweeps it and it is taken to be lossless and model-free."""
    return f.metadata.get("info") or OptionInfo(help="")


def infos(cls: type[EngineOptions] = EngineOptions) -> dict[str, OptionInfo]:
    """Option name -> its `OptionInfo`, in field order."""
    return {f.name: info(f) for f in fields(cls)}


def sweeps(cls: type[EngineOptions] = EngineOptions, mode: str | None = None, dtype: str | None = None,
           ) -> dict[str, list[tuple[str, list[OptionValue], tuple[str, ...]]]]:
    """The planner's sweeps: factor -> [(option, values worth timing, device kinds)], in field order;
    with ``mode``, only the options that mean something in that serving mode; with ``dtype``, only those
    worth timing at that deployment dtype."""
    out: dict[str, list] = {f: [] for f in FACTORS}
    for name, i in infos(cls).items():
        if (i.factor and i.sweep and (mode is None or mode in i.modes)
                and (dtype is None or not i.dtypes or dtype in i.dtypes)):
            out[i.factor].append((name, list(i.sweep), i.devices))
    return out


def requirements(cls: type[EngineOptions] = EngineOptions) -> dict[str, dict[str, OptionValue]]:
    """Option -> the settings it only means something with (only options that have some)."""
    return {name: dict(i.requires) for name, i in infos(cls).items() if i.requires}


def shape_options(cls: type[EngineOptions] = EngineOptions) -> dict[str, list[OptionValue]]:
    """Swept options that change what a step verifies (`EngineOptions.verifies_tree`, `step_tokens`),
    with their stock value and sweep values: block size, tree and tree size. The planner predicts a
    change of drafter or drafter setting jointly with each of them, since the best draft length
    depends on the drafter (docs/FIGURES.md, "Joint drafter and block-size prediction")."""
    stock, out = cls(), {}
    for name, i in infos(cls).items():
        if not i.sweep:
            continue
        base = dataclasses.replace(stock, **dict(i.requires))
        shape = (base.verifies_tree, base.step_tokens)
        if any((o.verifies_tree, o.step_tokens) != shape for o in (dataclasses.replace(base, **{name: v}) for v in i.sweep)):
            out[name] = [getattr(stock, name), *(v for v in i.sweep if v != getattr(stock, name))]
    return out


def mode_options(mode: str, cls: type[EngineOptions] = EngineOptions) -> tuple[str, ...]:
    """Options that mean nothing in serving ``mode`` (a deployment of that mode refuses them)."""
    return tuple(name for name, i in infos(cls).items() if mode not in i.modes)


def requirement_tables(cls: type[EngineOptions] = EngineOptions) -> dict[str, Any]:
    """What `specpilot.entries.requirements_for` reads of the option table: each option's device
    kinds, the values that carry per-target weights, and every device kind."""
    info = infos(cls)
    return {"devices": {k: i.devices for k, i in info.items()},
            "per_target": {k: i.per_target for k, i in info.items() if i.per_target}, "device_kinds": DEVICE_KINDS}


def model_options(cls: type[EngineOptions] = EngineOptions) -> tuple[str, ...]:
    """Options applied to the loaded model: two systems that differ in one of them need two models."""
    return tuple(name for name, i in infos(cls).items() if i.model and name != "dtype")


def factor_options(factor: str, cls: type[EngineOptions] = EngineOptions) -> tuple[str, ...]:
    """Options that attack ``factor``."""
    return tuple(name for name, i in infos(cls).items() if i.factor == factor)


def _hint(f: dataclasses.Field, cls: type = EngineOptions) -> Any:
    return typing.get_type_hints(cls)[f.name]


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


def _check_value(f: dataclasses.Field, value: Any, cls: type = EngineOptions) -> None:
    hint = _hint(f, cls)
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
    minimum = info(f).minimum or 0
    if base is int and value < minimum:
        raise ValueError(f"option {f.name!r} must be >= {minimum}, got {value}")


def _coerce(f: dataclasses.Field, value: Any, cls: type = EngineOptions) -> Any:
    """Convert a str/int/float/bool from a dict or command line to the field's type."""
    hint = _hint(f, cls)
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


def allowed_options(cls: type[EngineOptions] = EngineOptions) -> dict[str, str]:
    """Option name -> a short description of what it accepts (for error messages and docs)."""
    out = {}
    for f in fields(cls):
        choices, nullable = _choices(_hint(f, cls))
        desc = " | ".join(map(str, choices)) if choices else _base_type(_hint(f, cls)).__name__
        out[f.name] = desc + (" | null" if nullable else "")
    return out


def options_from_dict(d: dict[str, OptionValue | None], base: EngineOptions | None = None) -> EngineOptions:
    """Options from a dict such as the controller sends; unknown keys and values are refused.

    Values may be strings ("4", "true") as well as typed values. ``base`` (stock by default)
    supplies the fields the dict does not name (and the class: a subclass's options are known too).
    """
    base = base if base is not None else EngineOptions()
    cls = type(base)
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        allowed = ", ".join(f"{k} ({v})" for k, v in allowed_options(cls).items())
        raise ValueError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    values = {k: _coerce(names[k], v, cls) for k, v in d.items()}
    return dataclasses.replace(base, **values)


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
        help_ = f"{info(f).help} (stock: {default if default is not None else 'the deployment’s'})"
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
