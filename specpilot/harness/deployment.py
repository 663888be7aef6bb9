"""Deployments: one target, one drafter, one device kind, one serving mode, one request set.

A deployment is a TOML file in ``deployments/`` (or any path). `load_deployment(name_or_path)`
parses and validates it into a frozen `Deployment`; unknown keys are refused. The deployment's
``drafter``, ``block_size`` and ``dtype`` (and any ``[options]`` table) are the *stock* engine
options of that deployment: `Deployment.options(overrides)` layers a patch's option settings on
top of them, so ``{}`` always means stock.

An optional ``[timing]`` table sets how the controller times this deployment's candidates in a
round (`TIMING_DEFAULTS` where it is silent): a GPU needs more requests a trial than a CPU for the
same noise.

`load_engine(deployment_or_model, overrides)` builds the runtime's engine for a deployment (its stock options
with the overrides) or for a bare model name; it is the only function here that loads a model.

The embedded default is ``smollm2-cpu``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.errors import UserError
from specpilot.paths import REPO_ROOT
from specpilot_engine.options import MODES, EngineOptions, OptionValue, mode_options, options_from_dict

DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
DEFAULT_DEPLOYMENT = "smollm2-cpu"
# The controller's timing in a round where a deployment's [timing] table is silent: ABBA trials a
# verdict, dev requests a trial, tokens a request, torch CPU threads a worker: enough for low
# stock-vs-stock noise interleaved on 2 CPU cores (docs/FIGURES.md, "Lab notes moved from code").
TIMING_DEFAULTS = {"trials": 6, "requests": 3, "max_new_tokens": 64, "threads": 1}


@dataclass(frozen=True)
class Deployment:
    name: str
    target: str  # a model in specpilot_engine.model.CONFIGS, or hf:<checkpoint folder> (relative: to this file)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "fp32"  # the deployment's stock dtype ("fp32" | "bf16")
    mode: str = "batch1"  # serving mode: "batch1" (one request at a time) or "batched" (continuous batching)
    concurrency: int = 1  # batched: closed-loop clients (and cache rows) that time and bench it
    drafter: str = "ngram"
    block_size: int = 4
    request_sets: tuple[str, ...] = ("humaneval", "chat")
    max_new_tokens: int = 128
    split_seed: int = 0
    sealed_fraction: float = 0.5  # share of each request set only the controller may read
    bench_requests: int = 8  # dev requests `specpilot bench` times by default
    extra_options: dict[str, OptionValue] = field(default_factory=dict)  # the TOML's [options] table
    timing: dict[str, int] = field(default_factory=dict)  # the TOML's [timing] table (keys of TIMING_DEFAULTS)
    # the TOML's [server] table: the system is an external serving engine (`specpilot.harness.server`);
    # ``target`` is then the same weights in this engine, the reference that forcing checks against
    server: dict = field(default_factory=dict)
    path: str = ""

    def __post_init__(self) -> None:
        # imports torch: only when a deployment is built
        from specpilot_engine.model import CONFIGS, get_config

        if not self.target.startswith("hf:"):
            if self.target not in CONFIGS:
                raise ValueError(f"deployment {self.name!r}: unknown target {self.target!r}; known: {', '.join(CONFIGS)}, "
                                 "or hf:<checkpoint folder>")
        else:
            if not Path(self.target[3:]).is_absolute() and self.path:
                # a checkpoint folder relative to the deployment's own file
                object.__setattr__(self, "target", f"hf:{(Path(self.path).parent / self.target[3:]).resolve()}")
            try:
                get_config(self.target)
            except ValueError as exc:
                hint = " (a relative folder is relative to the deployment's file)" if "no checkpoint folder" in str(exc) else ""
                raise ValueError(f"deployment {self.name!r}: {exc}{hint}") from None
        weights = self.extra_options.get("drafter_weights")
        if isinstance(weights, str) and weights and not Path(weights).is_absolute() and self.path:
            # a drafter's weights file relative to the deployment's own file, like the checkpoint
            self.extra_options["drafter_weights"] = str((Path(self.path).parent / weights).resolve())
        if self.mode not in MODES:
            raise ValueError(f"deployment {self.name!r}: unknown mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if not isinstance(self.concurrency, int) or isinstance(self.concurrency, bool) or self.concurrency < 1:
            raise ValueError(f"deployment {self.name!r}: concurrency must be a positive integer, got {self.concurrency!r}")
        if self.mode == "batched" and self.server:
            raise ValueError(f"deployment {self.name!r}: mode 'batched' is this engine's continuous batching; a "
                             "server deployment batches inside its server (give its flags as [server.options])")
        if self.mode == "batch1" and self.concurrency != 1:
            raise ValueError(f"deployment {self.name!r}: concurrency {self.concurrency} needs mode = 'batched'")
        if not 0.0 < self.sealed_fraction < 1.0:
            raise ValueError(f"deployment {self.name!r}: sealed_fraction must be in (0, 1)")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"deployment {self.name!r}: device must be cpu or cuda[:N], got {self.device!r}")
        from specpilot.harness.requests import REQUEST_SETS

        unknown = [s for s in self.request_sets if s not in REQUEST_SETS]
        if unknown:
            raise ValueError(f"deployment {self.name!r}: unknown request sets {unknown}; known: {', '.join(REQUEST_SETS)}")
        self.options()  # validates drafter, block_size, dtype and [options] now, not at first use
        if self.server:
            self.server_spec()  # validates the [server] table now
        bad = sorted(set(self.timing) - set(TIMING_DEFAULTS))
        if bad:
            raise ValueError(f"deployment {self.name!r}: unknown [timing] key(s) {bad}; allowed: {', '.join(TIMING_DEFAULTS)}")
        for k, v in self.timing.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"deployment {self.name!r}: [timing] {k} must be a positive integer, got {v!r}")

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
        return {**TIMING_DEFAULTS, **self.timing}

    def facts(self) -> dict[str, str]:
        """What memory-entry requirements are stated over (see specpilot.entries)."""
        from specpilot_engine.model import get_config

        return {"deployment": self.name, "target": self.target, "model_family": get_config(self.target).family,
                "device_kind": "cuda" if self.device.startswith("cuda") else "cpu", "dtype": self.dtype,
                "mode": self.mode}

    def stock_options(self) -> EngineOptions:
        base = {"drafter": self.drafter, "block_size": self.block_size, "dtype": self.dtype}
        return options_from_dict({**base, **self.extra_options})

    def options(self, overrides: dict[str, OptionValue] | EngineOptions | None = None) -> EngineOptions:
        """Stock options of this deployment with ``overrides`` (a patch's option dict) applied. An option
        that means nothing in this deployment's serving mode is refused when set off its stock value."""
        if isinstance(overrides, EngineOptions):
            opts = overrides.resolved(dtype=self.dtype)
        else:
            opts = options_from_dict(overrides or {}, self.stock_options()).resolved(dtype=self.dtype)
        stock = EngineOptions()
        if off := [k for k in mode_options(self.mode) if getattr(opts, k) != getattr(stock, k)]:
            raise ValueError(f"deployment {self.name!r} (mode {self.mode!r}): option(s) {off} only mean something in "
                             f"mode(s) other than {self.mode!r}")
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
    """Parse a deployment by name (``deployments/<name>.toml``) or path; `DeploymentError` when it cannot."""
    path = deployment_path(name_or_path)
    if not path.is_file():
        raise DeploymentError(f"no deployment {str(name_or_path)!r} (looked for {path}); "
                              f"known: {', '.join(list_deployments())}, or give a TOML file's path")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeploymentError(f"{path} is not valid TOML: {exc}") from None
    data.setdefault("name", path.stem)
    data["extra_options"] = data.pop("options", {})
    allowed = {f.name for f in dataclasses.fields(Deployment)} - {"path", "extra_options"} | {"options"}
    unknown = sorted(set(data) - allowed - {"extra_options"})
    if unknown:
        raise DeploymentError(f"{path}: unknown deployment key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    if "request_sets" in data:
        data["request_sets"] = tuple(data["request_sets"])
    try:
        return Deployment(**data, path=str(path))
    except (TypeError, ValueError) as exc:
        raise DeploymentError(f"{path}: {exc}") from None


def deployment_or_none(deployment_or_model: str | Path | Deployment) -> Deployment | None:
    """The deployment named (a name, a TOML path or the object itself), or None for a bare model name
    (``CONFIGS`` or ``hf:<folder>``) that no deployment file shadows."""
    from specpilot_engine.model import CONFIGS

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
    """A `specpilot_engine.api.Engine` for a deployment (name, path or object) or a bare model name (``CONFIGS``).

    ``options`` are overrides on the deployment's stock options (a dict as the controller sends,
    or EngineOptions); ``device`` overrides the deployment's device. For a bare model name the
    base is `EngineOptions()` with dtype fp32 and device cpu unless given.
    """
    from specpilot_engine.api import build_engine

    dep = deployment_or_none(deployment_or_model)
    if dep is not None and dep.server:
        from specpilot.harness.server import ServerEngine
        from specpilot_engine.weights import load_tokenizer

        if isinstance(options, EngineOptions):
            raise ValueError(f"deployment {dep.name!r} runs a server: its options are the [server.options] settings")
        return ServerEngine(dep.server_spec(), options or {}, load_tokenizer(dep.target, data_dir=data_dir))
    if dep is not None:
        return build_engine(dep.target, dep.options(options), device or dep.device, data_dir)
    opts = options if isinstance(options, EngineOptions) else options_from_dict(options or {})
    return build_engine(str(deployment_or_model), opts.resolved(dtype="fp32"), device or "cpu", data_dir)
