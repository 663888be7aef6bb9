"""Deployments: one target, one drafter, one device kind, one serving mode, one request set.

A deployment is a TOML file in ``deployments/`` (or any path). `load_deployment(name_or_path)` parses it
into a frozen, typed `Deployment` (a msgspec ``Struct``: a wrong type, a value out of range, a missing
``target`` or an unknown key is refused with one line naming the file and the key), then checks what
only the engine knows (the target exists, the options are valid). Relative paths in the file (an
``hf:`` target's folder, ``[options] drafter_weights``) are relative to the file. The deployment's
``drafter``, ``block_size`` and ``dtype`` (and any ``[options]`` table) are the *stock* engine options of
that deployment, each defaulting to `EngineOptions`' own (written there once): `Deployment.options(overrides)`
layers a patch's option settings on top of them, so ``{}`` always means stock.

An optional ``[timing]`` table (`Timing`: its defaults are `TIMING_DEFAULTS`) sets how the controller
times this deployment's candidates in a round: a GPU needs more requests a trial than a CPU for the
same noise.

A job resolves its deployment once and passes the object on: every function here that takes a
deployment takes a `Deployment` (or, for `load_engine`, also a name or a bare model name).
`load_engine(deployment_or_model, overrides)` builds the runtime's engine for a deployment (its stock
options with the overrides) or for a bare model name; it is the only function here that loads a model.

The embedded default is ``smollm2-cpu``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from specpilot.engine.options import MODES, EngineOptions, OptionValue, mode_options, options_from_dict
from specpilot.errors import UserError
from specpilot.paths import REPO_ROOT

DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
DEFAULT_DEPLOYMENT = "smollm2-cpu"
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class Timing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The controller's timing in a round, the ``[timing]`` table (these defaults where it is silent): the
    most ABBA trials a verdict runs (a sequential verdict stops as soon as the evidence is clear:
    `specpilot.services.controller.sequential`), trials of the stock-versus-stock noise run, dev requests a
    trial, tokens a request, torch CPU threads a worker: enough for low stock-vs-stock noise interleaved on
    2 CPU cores (docs/FIGURES.md, controller statistics)."""

    trials: PositiveInt = 32
    noise_trials: Annotated[int, msgspec.Meta(ge=4)] = 8  # 4 or more: the crossover fit needs both orders twice
    requests: PositiveInt = 3
    max_new_tokens: PositiveInt = 64
    threads: PositiveInt = 1


TIMING_DEFAULTS: dict[str, int] = msgspec.structs.asdict(Timing())


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One deployment file, typed. ``path`` is where it was read from (not a key of the file)."""

    name: str = ""
    target: str  # a model in specpilot.engine.model.CONFIGS, or hf:<checkpoint folder> (relative: to this file)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: Literal["fp32", "bf16"] = "fp32"  # the deployment's stock dtype
    mode: Literal[MODES] = "batch1"  # "batch1" (one request at a time) or "batched" (continuous batching)
    concurrency: PositiveInt = 1  # batched: closed-loop clients (and cache rows) that time and bench it
    drafter: str | None = None  # stock drafter; None: EngineOptions' default
    block_size: PositiveInt | None = None  # stock draft length; None: EngineOptions' default
    request_sets: tuple[str, ...] = ("humaneval", "chat")
    max_new_tokens: PositiveInt = 128
    split_seed: int = 0
    sealed_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.5  # share only the controller may read
    bench_requests: PositiveInt = 8  # dev requests `specpilot bench` times by default
    extra_options: dict[str, OptionValue] = msgspec.field(default_factory=dict, name="options")  # [options]
    timing: Timing = msgspec.field(default_factory=Timing)
    # the [server] table: the system is an external serving engine (`specpilot.harness.server`, which
    # validates it); ``target`` is then the same weights in this engine, the reference forcing checks against
    server: dict[str, Any] = {}
    path: str = ""

    def __post_init__(self) -> None:
        # imports torch: only when a deployment is built
        from specpilot.engine.model import CONFIGS, get_config
        from specpilot.harness.requests import REQUEST_SETS

        if not self.target.startswith("hf:"):
            if self.target not in CONFIGS:
                raise ValueError(f"unknown target {self.target!r}; known: {', '.join(CONFIGS)}, or hf:<checkpoint folder>")
        else:
            try:
                get_config(self.target)
            except ValueError as exc:
                hint = " (a relative folder is relative to the deployment's file)" if "no checkpoint folder" in str(exc) else ""
                raise ValueError(f"{exc}{hint}") from None
        if self.mode == "batched" and self.server:
            raise ValueError("mode 'batched' is this engine's continuous batching; a server deployment batches "
                             "inside its server (give its flags as [server.options])")
        if self.mode == "batch1" and self.concurrency != 1:
            raise ValueError(f"concurrency {self.concurrency} needs mode = 'batched'")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if unknown := [s for s in self.request_sets if s not in REQUEST_SETS]:
            raise ValueError(f"unknown request sets {unknown}; known: {', '.join(REQUEST_SETS)}")
        self.options()  # validates drafter, block_size, dtype and [options] now, not at first use
        if self.server:
            self.server_spec()  # validates the [server] table now

    def external_paths(self) -> list[Path]:
        """What a worker of this deployment reads outside the checkout: this file when it lies outside
        ``deployments/``, the checkpoint folder of an ``hf:`` target, a ``drafter_weights`` file, the
        llama.cpp build a server deployment runs. A sandbox shows them read-only (`Sandbox.visible`)."""
        paths = []
        if self.path and Path(self.path).resolve().parent != DEPLOYMENTS_DIR.resolve():
            paths.append(Path(self.path).resolve())
        if self.target.startswith("hf:"):
            paths.append(Path(self.target[3:]))
        if weights := self.extra_options.get("drafter_weights"):
            paths.append(Path(str(weights)))
        if llama_cpp := self.sandbox_env().get("SPECPILOT_LLAMACPP"):
            paths.append(Path(llama_cpp))
        return paths

    def sandbox_env(self) -> dict[str, str]:
        """Environment a sandboxed worker of this deployment needs: where llama.cpp is built, for a server
        deployment that runs it (the sandbox has another home and no network to build it)."""
        if not self.server or not any("{llama_cpp}" in part for part in self.server.get("command", [])):
            return {}
        from specpilot.harness.server import llama_cpp_dir

        return {"SPECPILOT_LLAMACPP": str(llama_cpp_dir())}

    def check_options(self, overrides: dict[str, OptionValue] | None) -> None:
        """Refuse option settings this deployment's system does not take (`ValueError` naming them): engine
        options, or a server deployment's ``[server.options]``."""
        if self.server:
            self.server_spec().settings(overrides)
        else:
            self.options(overrides)

    def options_class(self) -> type:
        """The class whose fields are this deployment's options, each describing itself (`OptionInfo`):
        `EngineOptions`, or a server deployment's `ServerSpec.options_class`. The planner sweeps and
        validates what it says."""
        return self.server_spec().options_class if self.server else EngineOptions

    def ar_options(self) -> dict[str, OptionValue]:
        """The option settings that turn this deployment's system into plain AR decoding (the AR twin the
        profile and the sealed final measure against): no drafter, or the ``[server] ar_options``."""
        return dict(self.server_spec().ar_options) if self.server else {"drafter": "none"}

    def server_spec(self):
        """The serving engine this deployment runs (`specpilot.harness.server.ServerSpec`), or None."""
        if not self.server:
            return None
        from specpilot.harness.server import ServerSpec

        return ServerSpec.parse(self.server, f"deployment {self.name!r}",
                                base_dir=str(Path(self.path).resolve().parent) if self.path else "")

    def timing_settings(self) -> dict[str, int]:
        """How the controller times this deployment in a round: `TIMING_DEFAULTS` with ``[timing]``."""
        return msgspec.structs.asdict(self.timing)

    def facts(self) -> dict[str, str]:
        """What memory-entry requirements are stated over (see specpilot.entries)."""
        from specpilot.engine.model import get_config

        return {"deployment": self.name, "target": self.target, "model_family": get_config(self.target).family,
                "device_kind": "cuda" if self.device.startswith("cuda") else "cpu", "dtype": self.dtype,
                "mode": self.mode}

    def stock_options(self) -> EngineOptions:
        """This deployment's stock: `EngineOptions` with the file's drafter, block size, dtype and [options]."""
        base = {"drafter": self.drafter, "block_size": self.block_size, "dtype": self.dtype}
        return options_from_dict({**{k: v for k, v in base.items() if v is not None}, **self.extra_options})

    def options(self, overrides: dict[str, OptionValue] | EngineOptions | None = None) -> EngineOptions:
        """Stock options of this deployment with ``overrides`` (a patch's option dict) applied. An option
        that means nothing in this deployment's serving mode is refused when set off its stock value."""
        if isinstance(overrides, EngineOptions):
            opts = overrides.resolved(dtype=self.dtype)
        else:
            opts = options_from_dict(overrides or {}, self.stock_options()).resolved(dtype=self.dtype)
        stock = EngineOptions()
        if off := [k for k in mode_options(self.mode) if getattr(opts, k) != getattr(stock, k)]:
            raise ValueError(f"deployment {self.name!r} (mode {self.mode!r}): option(s) {off} only mean something "
                             f"in mode(s) other than {self.mode!r}")
        return opts


def deployment_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.is_file():
        return p
    return DEPLOYMENTS_DIR / f"{name_or_path}.toml"


def list_deployments() -> list[str]:
    return sorted(p.stem for p in DEPLOYMENTS_DIR.glob("*.toml"))


class DeploymentError(UserError):
    """A deployment that does not exist or does not parse: the message names the file and what to fix."""


def load_deployment(name_or_path: str | Path = DEFAULT_DEPLOYMENT) -> Deployment:
    """Parse a deployment by name (``deployments/<name>.toml``) or path; `DeploymentError` when it cannot,
    naming the file and the first bad key."""
    path = deployment_path(name_or_path)
    if not path.is_file():
        raise DeploymentError(f"no deployment {str(name_or_path)!r} (looked for {path}); "
                              f"known: {', '.join(list_deployments())}, or give a TOML file's path")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeploymentError(f"{path} is not valid TOML: {exc}") from None
    if "path" in data:
        raise DeploymentError(f"{path}: unknown key `path` (a deployment is where its file is)")
    data = {"name": path.stem, **_relative_to(data, path.resolve().parent), "path": str(path)}
    try:
        return msgspec.convert(data, Deployment)
    except msgspec.ValidationError as exc:
        raise DeploymentError(f"{path}: {explain(str(exc))}") from None


def explain(message: str) -> str:
    """A msgspec validation message as a deployment file's reader wants it: the key first, dotted as in the
    TOML (``timing.trials``), and for an unknown key the keys its table allows."""
    what, _, where = message.partition(" - at `$")
    table = where.rstrip("`").lstrip(".")
    if unknown := re.fullmatch(r"Object contains unknown field `(.+)`", what):
        allowed = {"": Deployment, "timing": Timing}.get(table)
        names = sorted(f.encode_name for f in msgspec.structs.fields(allowed) if f.name != "path") if allowed else []
        return (f"unknown key `{'.'.join(filter(None, [table, unknown[1]]))}`"
                + (f"; allowed: {', '.join(names)}" if names else ""))
    if missing := re.fullmatch(r"Object missing required field `(.+)`", what):
        return f"missing required key `{'.'.join(filter(None, [table, missing[1]]))}`"
    if what.startswith("Invalid enum value") and (values := _choices(table)):
        what += f"; allowed: {', '.join(values)}"
    return f"`{table}`: {what[0].lower()}{what[1:]}" if table else what


def _choices(key: str) -> list[str]:
    """The values a top-level key of `Deployment` allows when its type is a fixed set ([] otherwise)."""
    for field in msgspec.inspect.type_info(Deployment).fields:
        if field.encode_name == key and isinstance(field.type, msgspec.inspect.LiteralType):
            return [str(v) for v in field.type.values]
    return []


def _relative_to(data: dict, base: Path) -> dict:
    """``data`` with its relative paths (an ``hf:`` target's folder, ``[options] drafter_weights``) made
    absolute from ``base``, the file's folder; values of the wrong type are left for validation to name."""
    data = dict(data)
    target = data.get("target")
    if isinstance(target, str) and target.startswith("hf:") and not Path(target[3:]).is_absolute():
        data["target"] = f"hf:{(base / target[3:]).resolve()}"
    options = data.get("options")
    weights = options.get("drafter_weights") if isinstance(options, dict) else None
    if isinstance(weights, str) and weights and not Path(weights).is_absolute():
        data["options"] = {**options, "drafter_weights": str((base / weights).resolve())}
    return data


def deployment_or_none(deployment_or_model: str | Path | Deployment) -> Deployment | None:
    """The deployment named (a name, a TOML path or the object itself), or None for a bare model name
    (``CONFIGS`` or ``hf:<folder>``) that no deployment file shadows."""
    from specpilot.engine.model import CONFIGS

    if isinstance(deployment_or_model, Deployment):
        return deployment_or_model
    name = str(deployment_or_model)
    if isinstance(deployment_or_model, str) and (name in CONFIGS or name.startswith("hf:")) \
            and not deployment_path(name).is_file():
        return None
    return load_deployment(deployment_or_model)


def load_engine(deployment_or_model: str | Path | Deployment = DEFAULT_DEPLOYMENT,
                options: EngineOptions | dict[str, OptionValue] | None = None,
                device: str | None = None, data_dir: Path | None = None):
    """A `specpilot.engine.api.Engine` for a deployment (name, path or object) or a bare model name (``CONFIGS``).

    ``options`` are overrides on the deployment's stock options (a dict as the controller sends,
    or EngineOptions); ``device`` overrides the deployment's device. For a bare model name the
    base is `EngineOptions()` with dtype fp32 and device cpu unless given.
    """
    from specpilot.engine.api import build_engine

    dep = deployment_or_none(deployment_or_model)
    if dep is not None and dep.server:
        from specpilot.engine.weights import load_tokenizer
        from specpilot.harness.server import ServerEngine

        if isinstance(options, EngineOptions):
            raise ValueError(f"deployment {dep.name!r} runs a server: its options are the [server.options] settings")
        return ServerEngine(dep.server_spec(), options or {}, load_tokenizer(dep.target, data_dir=data_dir))
    if dep is not None:
        return build_engine(dep.target, dep.options(options), device or dep.device, data_dir)
    opts = options if isinstance(options, EngineOptions) else options_from_dict(options or {})
    return build_engine(str(deployment_or_model), opts.resolved(dtype="fp32"), device or "cpu", data_dir)
