"""`specpilot bench`: where a deployment's speed comes from, measured on its dev requests.

Figures (all greedy, batch 1, one engine process):
- ``t_AR``: mean time of one AR step (one target forward of one token + argmax), from plain decoding.
- ``tau(N)``, ``t_step(N)``: mean tokens committed per step and mean step time (draft + verify)
  with N draft tokens per step; ``c(N) = t_step(N) / t_AR``; ``S(N) = tau(N) / c(N)``.
- End to end: the system (the deployment's options plus overrides) against AR, request by
  request, alternating which runs first (ABBA); per pair ``r = t_AR / t_system``; the speedup is
  ``exp(mean log r)`` with a 95% t-interval. Also whether the outputs were identical.
- Profile: one request through the system with timers around every module of a kernel class
  (attention core, q/k/v/o/gate/up/down linears, LM head, norms, embedding), the drafter, and host
  overhead = step time minus all of those. On CUDA a class's time is its kernels' device time (the
  PyTorch profiler), so a launch-bound step shows up as host overhead; the CPU uses the wall clock.
- CUDA graphs (``--cuda-graphs``): every shape a run needs is captured in an untimed warm-up pass
  over all the prompts; the end-to-end AR reference keeps the deployment's stock setting, so graphs
  count towards the speedup, while ``c(N)`` compares steps under the same setting. The per-module
  profile is skipped under graphs (a replay runs no module hooks).
- Peer: transformers' assisted generation with prompt lookup (``prompt_lookup_num_tokens``) on the
  same weights, against transformers' own greedy generation, when transformers is installed.
- llama.cpp, side by side (SmolLM2 targets, when ``scripts/build_llamacpp.sh`` has built it here; it is
  never built for a bench): ``llama-server`` with the stock flags of ``llamacpp-smollm2-cpu`` (AR) and
  with ``--llamacpp-spec`` (its n-gram speculation) on the same prompts, paired as above, for each of
  the shipped Q4_1 GGUF and BF16/F32 GGUFs made from it by ``llama-quantize --allow-requantize``
  (cached in the data folder): tokens/s and speedup over its own AR, beside this engine's.

A batched deployment (``mode = "batched"``) is measured by throughput under closed-loop load instead
(`specpilot.harness.batch_bench`): tokens/s, latency, time to first token, tau and ``c(N, B)``.

Prints a rich table, writes ``tau.png`` and ``speedup.png`` (matplotlib) and ``bench.json`` into
``--out``, and prints the whole result as JSON on the last line. This module only measures; it
changes nothing it measures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from specpilot.errors import UserError, json_object, positive_int
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, load_deployment
from specpilot.harness.requests import encode_requests, fit_context, load_requests
from specpilot_engine.api import MODEL_OPTIONS, Engine, apply_model_options
from specpilot_engine.options import EngineOptions, add_option_flags, overrides_from_args
from specpilot_engine.weights import load_model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="deployment name or TOML path")
    ap.add_argument("--limit", type=positive_int, default=None, help="dev requests to use (default: the deployment's bench_requests)")
    ap.add_argument("--set", default=None, help="only dev requests of this request set (e.g. humaneval, chat)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the deployment's")
    ap.add_argument("--ns", default="1,2,4,8", help="draft lengths N for tau(N), c(N), S(N); '' skips the sweep")
    ap.add_argument("--trials", type=positive_int, default=1, help="paired AR/system runs per request")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="folder for plots and bench.json (default: <data>/bench/<deployment>)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-requests", type=positive_int, default=4,
                    help="first requests the peer (transformers' prompt lookup) runs on; the e2e comparison "
                         "covers the same ones when this equals --limit")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--clients", type=positive_int, default=None,
                    help="batched deployments: closed-loop clients (default: the deployment's concurrency; more than "
                         "its rows queue)")
    ap.add_argument("--batch-sizes", default=None,
                    help="batched deployments: rows B of the c(N, B) table (default: 1,2,4,<concurrency>)")
    ap.add_argument("--reps", type=positive_int, default=5, help="batched deployments: timed forwards a c(N, B) cell")
    ap.add_argument("--runs", type=positive_int, default=1,
                    help="batched deployments: closed-loop loads a system, interleaved across systems; the median "
                         "one is reported (one GPU run's throughput moved ~10%% between loads, 2026-12-06)")
    ap.add_argument("--passes", type=positive_int, default=1,
                    help="batched deployments: times a load sends the request set (a longer load shortens its "
                         "drain, where the last requests finish with fewer clients busy)")
    ap.add_argument("--stock-options", type=json_object, default=None,
                    help="batched deployments: JSON of option overrides the 'stock' row runs instead of the "
                         "deployment's stock (batched AR stays the deployment's): two systems A/B'd in one "
                         "process, both beside batched AR in every load, e.g. '{\"drafter\": \"parallel\"}'")
    ap.add_argument("--server-options", default="{}",
                    help="server deployments: JSON of the system's [server.options] settings, e.g. "
                         "'{\"spec_type\": \"ngram-simple\"}' (AR: the deployment's stock flags)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp rows (run when it is built)")
    ap.add_argument("--llamacpp-spec", default=json.dumps(LLAMACPP_SPEC),
                    help="JSON of llamacpp-smollm2-cpu's [server.options]: llama.cpp's speculative system "
                         "in the side-by-side rows")
    add_option_flags(ap)


# llama.cpp's n-gram speculation in the side-by-side rows unless told otherwise: ngram-map-k with a 3-token
# lookup and 8-token drafts, from the hand-run size table (docs/FIGURES.md, "llama.cpp's n-gram sizes by
# hand"). The round's promoted ngram-mod + mod_n_match 8 measured 0.97x of stock on sealed requests.
LLAMACPP_SPEC = {"spec_type": "ngram-map-k", "map_k_size_n": 3, "map_k_size_m": 8}
LLAMACPP_FORMATS = ("q4_1", "bf16", "f32")  # the shipped GGUF's, then made from it


def llamacpp_gguf(fmt: str, data_dir: Path | None) -> Path:
    """SmolLM2's GGUF in ``fmt``: the shipped Q4_1, or made from it by ``llama-quantize --allow-requantize``
    (cached under the data folder's ``models/llamacpp``)."""
    import subprocess

    from specpilot.harness.server import llama_cpp_dir, smollm2_gguf
    from specpilot.paths import default_data_dir

    shipped = smollm2_gguf()
    if fmt == "q4_1":
        return shipped
    out = (data_dir or default_data_dir()) / "models" / "llamacpp" / f"{shipped.stem}-{fmt}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        done = subprocess.run([str(llama_cpp_dir() / "bin" / "llama-quantize"), "--allow-requantize", str(shipped),
                               str(tmp), fmt.upper()], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize to {fmt} failed: {done.stderr[-400:]}")
        tmp.rename(out)
    return out


def draft_lengths(text: str) -> list[int]:
    """``--ns``: comma-separated draft lengths, each at least 1 ('' for none); UserError otherwise."""
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ns must be comma-separated draft lengths such as 1,2,4,8 (or ''), got {text!r}") from None
    if any(n < 1 for n in ns):
        raise UserError(f"--ns draft lengths must be at least 1, got {text!r}")
    return ns


def dev_requests(dep, args: argparse.Namespace) -> list:
    """The deployment's dev requests a bench answers: ``--set`` only, the first ``--limit`` (default: its
    ``bench_requests``); UserError naming its sets when none is left."""
    requests = [r for r in load_requests(dep, "dev") if args.set in (None, r.set)][: args.limit or dep.bench_requests]
    if not requests:
        sets = sorted({r.set for r in load_requests(dep, "dev")})
        raise UserError(f"no dev requests of set {args.set!r} in {dep.name}; its sets: {', '.join(sets)}")
    return requests


def output_dir(args: argparse.Namespace, dep) -> Path:
    """``--out``, else ``<data>/bench/<deployment>``, created."""
    out = args.out
    if out is None:
        from specpilot.paths import default_data_dir

        out = (args.data_dir or default_data_dir()) / "bench" / dep.name
    out.mkdir(parents=True, exist_ok=True)
    return out


def llamacpp_peer_result(args: argparse.Namespace, dep, device: torch.device, run) -> dict | None:
    """llama.cpp's rows beside this engine's (SmolLM2 on the CPU, when it is built here and not
    ``--no-llamacpp``): ``run(spec_options)``'s result, or why there is none; None where it does not apply.
    A comparison, never a reason to lose the bench."""
    if args.no_llamacpp or dep.target != "smollm2-135m" or device.type != "cpu":
        return None
    from specpilot.harness.server import llama_cpp_built

    if llama_cpp_built() is None:
        return {"skipped": "llama.cpp is not built here: bash scripts/build_llamacpp.sh"}
    try:
        return run(json.loads(args.llamacpp_spec))
    except Exception as e:  # noqa: BLE001 - reported in the result
        return {"error": f"{type(e).__name__}: {e}"}


def llamacpp_side_by_side(prompts, max_new: int, trials: int, spec_options: dict, tok, data_dir=None) -> dict:
    """llama.cpp's server, AR against ``spec_options``, per GGUF format (`LLAMACPP_FORMATS`)."""
    import dataclasses

    from specpilot.harness.server import ServerEngine

    base = load_deployment("llamacpp-smollm2-cpu").server_spec()
    base.settings(spec_options)
    rows = {}
    for fmt in LLAMACPP_FORMATS:
        gguf = str(llamacpp_gguf(fmt, data_dir))
        spec = dataclasses.replace(base, command=tuple(c.replace("{smollm2_gguf}", gguf) for c in base.command))
        with ServerEngine(spec, spec_options, tok) as system, ServerEngine(spec, {}, tok) as ar:
            for e in (system, ar):
                warm_up(e, prompts, max_new)
            rows[fmt] = end_to_end(system, ar, prompts, max_new, trials)
    return {"options": spec_options, "threads": base.settings()["threads"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpilot bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(engine: Engine, prompt: list[int], max_new: int):
    _sync(engine.device)
    t = time.perf_counter()
    r = engine.generate(prompt, max_new)
    _sync(engine.device)
    return r, time.perf_counter() - t


def sweep(model, tok, opts: EngineOptions, ns: list[int], prompts, max_new) -> dict:
    """tau(N), t_step(N), c(N), S(N) from real decoding of the prompts (N = draft tokens per step)."""

    def run_all(o: EngineOptions):
        e = Engine(model, tok, o)
        warm_up(e, prompts, max_new)
        taus, steps, times = [], 0, 0.0
        for p in prompts:
            r = e.generate(p, max_new)
            steps += r.steps
            times += sum(r.draft_s) + sum(r.verify_s)
            taus.extend(r.accepted_per_step)
        return sum(taus) / max(1, len(taus)), times / max(1, steps)

    _, t_ar = run_all(opts.replace(drafter="none"))
    rows = []
    for n in ns:
        tau, t_step = run_all(opts.replace(block_size=n))
        c = t_step / t_ar
        rows.append({"n": n, "tau": tau, "t_step_ms": 1e3 * t_step, "c": c, "S": tau / c})
    return {"t_ar_ms": 1e3 * t_ar, "rows": rows}


def warm_up(engine: Engine, prompts, max_new) -> None:
    """First calls at a new shape pay one-off costs; under CUDA graphs every prompt is run once, so
    each (block size, attention length) graph is captured before timing starts."""
    for p in prompts if engine.graphs else prompts[:1]:
        engine.generate(p, max_new)


def paired_speedup(log_ratios: Sequence[float]) -> dict:
    """``{"pairs", "speedup", "ci95"}`` from paired ``log(baseline time / system time)`` (or of system /
    baseline throughput): the geometric mean and its two-sided 95% Student t-interval (infinite with one
    pair)."""
    from scipy import stats

    n = len(log_ratios)
    mean = statistics.fmean(log_ratios)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(log_ratios) / math.sqrt(n) if n > 1 else float("inf")
    return {"pairs": n, "speedup": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)]}


def end_to_end(sys_engine: Engine, ar_engine: Engine, prompts, max_new, trials: int) -> dict:
    """Paired, order-alternating runs of AR and the system on each prompt."""
    from rich.progress import Progress

    logs, same, committed = [], 0, []
    tok = {"ar": 0, "sys": 0}
    secs = {"ar": 0.0, "sys": 0.0}
    from specpilot.harness.loadgen import frozen_heap

    with Progress(transient=True, console=_console()) as progress, frozen_heap():
        task = progress.add_task("end to end (AR, system)", total=trials * len(prompts))
        for t in range(trials):
            for i, p in enumerate(prompts):
                order = ("ar", "sys") if (i + t) % 2 == 0 else ("sys", "ar")
                res = {}
                for who in order:
                    res[who] = _timed(ar_engine if who == "ar" else sys_engine, p, max_new)
                    tok[who] += len(res[who][0].tokens)
                    secs[who] += res[who][1]
                logs.append(math.log(res["ar"][1] / res["sys"][1]))
                same += res["ar"][0].tokens == res["sys"][0].tokens
                committed += res["sys"][0].accepted_per_step
                progress.advance(task)
    return {
        **paired_speedup(logs),
        "ar_tok_s": tok["ar"] / secs["ar"], "sys_tok_s": tok["sys"] / secs["sys"],
        "identical_outputs": same / len(logs),
        "tau": sum(committed) / max(1, len(committed)),  # the system's tokens per step, every request
    }


def _kernel_class(name: str, module: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                "qkv_proj", "gate_up_proj"):  # the last two: fused_kernels (specpilot_engine.fused)
        return leaf
    if leaf == "core":
        return "attention"
    if leaf.endswith("norm"):
        return "norms"
    if leaf == "embed":
        return "embedding"
    return None


def _decode_hooks(model: torch.nn.Module, enter, leave) -> list:
    """Hooks calling ``enter(cls, module)`` / ``leave(cls, module)`` around every kernel-class module
    in the decode steps of one generation (its first forward, the prefill, is skipped)."""
    in_prefill = [True]
    calls = [0]

    def count(mod, args):
        calls[0] += 1
        in_prefill[0] = calls[0] == 1

    def pre(cls):
        def hook(mod, args):  # returns None: a pre-hook's result would replace the module's inputs
            if not in_prefill[0]:
                enter(cls, mod)
        return hook

    def post(cls):
        def hook(mod, args, out):  # returns None: a hook's result would replace the module's output
            if not in_prefill[0]:
                leave(cls, mod)
        return hook

    handles = [model.register_forward_pre_hook(count)]
    for name, mod in model.named_modules():
        if cls := _kernel_class(name, mod):
            handles += [mod.register_forward_pre_hook(pre(cls)), mod.register_forward_hook(post(cls))]
    return handles


PROFILE_RANGE = "specpilot::"  # prefix of the profiler ranges `profile` opens around kernel classes


def profile(engine: Engine, prompt: list[int], max_new: int) -> dict:
    """Mean milliseconds per decode step spent in each kernel class, the drafter and the host.

    On a CPU a class's time is the wall clock inside its modules. On a GPU it is the time its
    kernels ran on the device (the PyTorch profiler's CUPTI records, summed over the kernels
    launched inside the class's modules), not the time between CUDA events around the modules: in
    a launch-bound eager step the device waits for the host, and events would count that wait as
    the class's kernel time. Where the profiler records no kernels (no CUPTI), CUDA events are used."""
    device = engine.device
    cuda = device.type == "cuda"
    if cuda and engine.graphs:
        return _profile_graphed(engine, prompt, max_new)
    if cuda and (out := _profile_device_kernels(engine, prompt, max_new)) is not None:
        return out
    totals: dict[str, float] = defaultdict(float)
    pending: list[tuple[str, object, object]] = []
    starts: dict[int, object] = {}

    def enter(cls, mod):
        if cuda:
            starts[id(mod)] = torch.cuda.Event(enable_timing=True)
            starts[id(mod)].record()
        else:
            starts[id(mod)] = time.perf_counter()

    def leave(cls, mod):
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            pending.append((cls, starts.pop(id(mod)), ev))
        else:
            totals[cls] += time.perf_counter() - starts.pop(id(mod))

    handles = _decode_hooks(engine.model, enter, leave)
    try:
        r = engine.generate(prompt, max_new)
        _sync(device)
    finally:
        for h in handles:
            h.remove()
    for cls, a, b in pending:
        totals[cls] += a.elapsed_time(b) / 1e3
    return _per_step(totals, r)


def _profile_graphed(engine: Engine, prompt: list[int], max_new: int) -> dict:
    """`profile` of a system that replays its steps as CUDA graphs. A replay bypasses the modules, so no
    class would be seen (the cost model's kernel and overhead factors read 1.00 on the H100, 2026-12-05).
    A graph replays the eager step's kernels, so each class's device time comes from the same engine
    run eagerly; the drafter's time, the step's and so the host's share come from the graphed run."""
    graphed = engine.generate(prompt, max_new)
    _sync(engine.device)
    engine.graphs = False
    try:
        eager = profile(engine, prompt, max_new)
    finally:
        engine.graphs = True
    own = _per_step({}, graphed)
    out = {k: v for k, v in eager.items() if k not in own}
    out["drafter"] = own["drafter"]
    out["host_overhead"] = max(0.0, own["step_total"] - sum(out.values()))
    out["step_total"] = own["step_total"]
    return out


def _profile_device_kernels(engine: Engine, prompt: list[int], max_new: int) -> dict | None:
    """`profile` on a GPU from the profiler's kernel records; None when it recorded none."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    open_ranges: list = []

    def enter(cls, mod):
        rf = record_function(PROFILE_RANGE + cls)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(cls, mod):
        open_ranges.pop().__exit__(None, None, None)

    handles = _decode_hooks(engine.model, enter, leave)
    try:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = engine.generate(prompt, max_new)
            _sync(engine.device)
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, float] = defaultdict(float)
    for e in prof.events():
        # The host-side range (the profiler may also mirror it as a device-side annotation, which
        # spans the device's idle gaps too); its device time sums the kernels launched inside it.
        if e.name.startswith(PROFILE_RANGE) and e.device_type == torch.autograd.DeviceType.CPU:
            totals[e.name[len(PROFILE_RANGE):]] += e.device_time_total / 1e6
    return _per_step(totals, r) if any(totals.values()) else None


def _per_step(totals: dict[str, float], r) -> dict:
    """Milliseconds per decode step: the classes' ``totals`` (seconds), the drafter, the host."""
    steps = max(1, r.steps)
    step_s = (sum(r.draft_s) + sum(r.verify_s)) / steps
    out = {k: 1e3 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["drafter"] = 1e3 * sum(r.draft_s) / steps
    out["host_overhead"] = max(0.0, 1e3 * step_s - sum(out.values()))
    out["step_total"] = 1e3 * step_s
    return out


def launches(engine: Engine, prompt: list[int], max_new: int = 16) -> dict[str, float]:
    """Mean operator launches per decode step in each kernel class.

    Every aten operator that is not a view is one launch: on a GPU at least one kernel the host must
    issue, on a CPU one dispatch. The cost model charges ``launches x launch time`` of a class to
    *overhead* rather than *kernel*: a launch-bound class is fixed by fewer launches (graphs, fusion),
    not by faster kernels. Steps replayed as CUDA graphs bypass the modules and count nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    metadata_only = {aten._unsafe_view.default, aten.detach.default, aten.lift_fresh.default}  # not tagged views
    current: list[str] = []
    counts: dict[str, int] = defaultdict(int)

    class CountLaunches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if current and not func.is_view and func not in metadata_only:
                counts[current[-1]] += 1
            return func(*args, **(kwargs or {}))

    handles = _decode_hooks(engine.model, lambda cls, mod: current.append(cls), lambda cls, mod: current.pop())
    try:
        with CountLaunches():
            r = engine.generate(prompt, max_new)
    finally:
        for h in handles:
            h.remove()
    return {cls: n / max(1, r.steps) for cls, n in sorted(counts.items())}


def peer(model, dep, opts: EngineOptions, prompts, max_new, reference: list[list[int]] | None = None) -> dict:
    """transformers' prompt-lookup assisted generation on the same weights, vs its own greedy.

    ``reference``: our engine's AR outputs for the prompts; the share of prompts where
    transformers' greedy output equals them is reported (a cross-check of the weights too)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:  # not installed, or broken (see pyproject.toml's pin)
        return {"skipped": f"transformers cannot be imported ({exc}); pip install -e '.[dev]'"}
    cfg = model.cfg
    if cfg.name.startswith("hf:"):  # a checkpoint on disk: transformers reads it itself
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(cfg.name[3:], dtype=model.dtype, local_files_only=True)
    else:
        hf = _llama_from_ours(model, LlamaConfig, LlamaForCausalLM)
    hf = hf.to(model.device).eval()
    k = opts.block_size
    out: dict = {"prompt_lookup_num_tokens": k}
    for label, extra in (("greedy", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": k})):
        toks, secs = 0, 0.0
        with torch.no_grad():  # warm-up
            ids = torch.tensor([prompts[0]], device=model.device)
            hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids), **extra)
        outputs = []
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            _sync(model.device)
            t = time.perf_counter()
            with torch.no_grad():
                g = hf.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids),
                                **extra)
            _sync(model.device)
            secs += time.perf_counter() - t
            toks += g.shape[1] - len(p)
            outputs.append(g[0, len(p):].tolist())
        out[f"{label}_tok_s"] = toks / secs
        if reference is not None:
            out[f"{label}_matches_engine"] = sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(prompts)
    out["speedup"] = out["prompt_lookup_tok_s"] / out["greedy_tok_s"]
    return out



def _llama_from_ours(model, LlamaConfig, LlamaForCausalLM):  # noqa: N803 - transformers' class names
    """transformers' Llama over our model's own tensors (no copy): the GGUF targets' peer."""
    cfg = model.cfg
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=cfg.bos_id, eos_token_id=list(cfg.stop_ids) or None,
        pad_token_id=cfg.eos_id,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg)
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    sub = {"attn.": "self_attn.", "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("layers."):
            hk = "model." + k
            for a, b in sub.items():
                hk = hk.replace(a, b)
        else:
            hk = names.get(k)
        if hk:
            state[hk] = v
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(state, assign=True, strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    # Rotary buffers were created on the meta device: rebuild them on the real one.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    leftover = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"transformers model has unloaded tensors: {leftover[:5]}")
    return hf

def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sweep"]["rows"]
    ns = [r["n"] for r in rows]
    files = []
    for key, label, fname in (("tau", "tau(N): tokens per step", "tau.png"), ("S", "S(N) = tau / c", "speedup.png")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(ns, [r[key] for r in rows], marker="o")
        if key == "S":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("N (draft tokens per step)")
        ax.set_ylabel(label)
        ax.set_title(f"{result['deployment']} · {result['options']['verify']} · {result['device']}")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        files.append(str(out / fname))
    return files


def _console():
    from specpilot import output

    return output.console(stderr=True)


def _table(result: dict) -> None:
    from rich.table import Table

    console = _console()
    if "sweep" in result:
        t = Table(title=f"{result['deployment']}: t_AR = {result['sweep']['t_ar_ms']:.2f} ms")
        for col in ("N", "tau", "t_step ms", "c", "S"):
            t.add_column(col, justify="right")
        for r in result["sweep"]["rows"]:
            t.add_row(str(r["n"]), f"{r['tau']:.2f}", f"{r['t_step_ms']:.2f}", f"{r['c']:.2f}", f"{r['S']:.2f}")
        console.print(t)
    e = result["e2e"]
    console.print(f"end to end: AR {e['ar_tok_s']:.1f} tok/s, system {e['sys_tok_s']:.1f} tok/s, speedup "
                  f"{e['speedup']:.3f} (95% CI {e['ci95'][0]:.3f}-{e['ci95'][1]:.3f}, {e['pairs']} pairs), "
                  f"tau {e['tau']:.2f}, identical outputs {100 * e['identical_outputs']:.0f}%")
    if "profile_ms" in result:
        t = Table(title="per-step profile (ms)")
        t.add_column("class")
        t.add_column("ms/step", justify="right")
        t.add_column("share", justify="right")
        total = result["profile_ms"]["step_total"]
        for k, v in result["profile_ms"].items():
            if k != "step_total":
                t.add_row(k, f"{v:.3f}", f"{100 * v / total:.1f}%")
        t.add_row("step total", f"{total:.3f}", "100%")
        console.print(t)
    if "llamacpp" in result and "rows" in result["llamacpp"]:
        t = Table(title=f"side by side, {e['pairs']} requests: this engine ({result['options'].get('dtype')}) and "
                        f"llama.cpp ({result['llamacpp']['threads']} threads, {json.dumps(result['llamacpp']['options'])})")
        for col in ("system", "AR tok/s", "system tok/s", "speedup over its AR", "identical"):
            t.add_column(col, justify="right")
        t.add_row("this engine", f"{e['ar_tok_s']:.1f}", f"{e['sys_tok_s']:.1f}", f"{e['speedup']:.2f}x",
                  f"{100 * e['identical_outputs']:.0f}%")
        for fmt, r in result["llamacpp"]["rows"].items():
            t.add_row(f"llama.cpp {fmt}", f"{r['ar_tok_s']:.1f}", f"{r['sys_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{100 * r['identical_outputs']:.0f}%")
        console.print(t)
    elif "llamacpp" in result:
        console.print(f"llama.cpp: {result['llamacpp'].get('skipped') or result['llamacpp'].get('error')}")
    if "peer" in result and "speedup" in result["peer"]:
        p = result["peer"]
        console.print(f"peer (transformers prompt lookup, k={p['prompt_lookup_num_tokens']}): "
                      f"{p['prompt_lookup_tok_s']:.1f} vs greedy {p['greedy_tok_s']:.1f} tok/s = {p['speedup']:.2f}x")


def system_and_stock_models(dep, opts: EngineOptions, device, data_dir=None):
    """(system model, stock model, tokenizer): the target with ``opts``' model options and with the
    deployment's stock ones (`MODEL_OPTIONS`); one model when they agree. AR is measured on the
    stock model, so model options count towards the speedup."""
    stock = dep.options()
    model, tok = load_model(dep.target, dtype=opts.dtype, device=device, data_dir=data_dir)
    stock_model = apply_model_options(model, stock)
    if all(getattr(opts, k) == getattr(stock, k) for k in MODEL_OPTIONS):
        return stock_model, stock_model, tok
    fresh = load_model(dep.target, dtype=opts.dtype, device=device, data_dir=data_dir)[0]
    return apply_model_options(fresh, opts), stock_model, tok


def run_server(args: argparse.Namespace, dep) -> int:
    """`run` for a server deployment: the server with ``--server-options`` against its stock flags (AR,
    when stock runs no speculative decoding), paired end to end on the dev requests; one server each."""
    from specpilot.harness.server import ServerEngine
    from specpilot_engine.weights import load_tokenizer

    try:
        overrides = json.loads(args.server_options)
        spec = dep.server_spec()
        spec.settings(overrides)
    except ValueError as exc:
        raise UserError(f"--server-options: {exc}") from None
    max_new = args.max_new_tokens or dep.max_new_tokens
    tok = load_tokenizer(dep.target, data_dir=args.data_dir)
    prompts = encode_requests(dev_requests(dep, args), tok)
    with ServerEngine(spec, overrides, tok) as system, ServerEngine(spec, {}, tok) as ar:
        for e in (system, ar):
            warm_up(e, prompts, max_new)
        e2e = end_to_end(system, ar, prompts, max_new, args.trials)
        argv = system.argv
    result = {"bench": "server", "deployment": dep.name, "target": dep.target, "api": spec.api,
              "device": f"cpu ({platform.machine()})", "options": spec.settings(overrides), "command": argv,
              "requests": len(prompts), "request_set": args.set or "all", "max_new_tokens": max_new,
              "date": time.strftime("%Y-%m-%d"), "e2e": e2e}
    (output_dir(args, dep) / "bench.json").write_text(json.dumps(result, indent=2))
    _table(result)
    print(json.dumps(result, separators=(",", ":")))
    return 0


def run(args: argparse.Namespace) -> int:
    dep = load_deployment(args.deployment)
    if dep.mode != "batched" and (args.passes > 1 or args.stock_options is not None):
        raise UserError(f"--passes and --stock-options are for batched deployments; {dep.name} is "
                        f"mode {dep.mode!r}")
    if dep.server:
        return run_server(args, dep)
    if dep.mode == "batched":
        from specpilot.harness.batch_bench import run_batched

        return run_batched(args, dep)
    opts = dep.options(overrides_from_args(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or dep.device)
    max_new = args.max_new_tokens or dep.max_new_tokens
    ns = draft_lengths(args.ns)

    model, stock_model, tok = system_and_stock_models(dep, opts, device, args.data_dir)
    stock = dep.options()
    requests = dev_requests(dep, args)
    prompts = fit_context(encode_requests(requests, tok), model.cfg.max_seq_len, max_new)
    sys_engine = Engine(model, tok, opts)
    # AR keeps the deployment's stock model and CUDA-graph setting, so they count towards the speedup too.
    ar_opts = opts.replace(drafter="none", cuda_graphs=stock.cuda_graphs, **{k: getattr(stock, k) for k in MODEL_OPTIONS})
    ar_engine = Engine(stock_model, tok, ar_opts)
    for e in (sys_engine, ar_engine):
        warm_up(e, prompts, max_new)

    result: dict = {
        "bench": "engine", "deployment": dep.name, "target": dep.target,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "options": opts.to_dict(), "requests": len(prompts), "request_set": args.set or "all", "max_new_tokens": max_new,
        "date": time.strftime("%Y-%m-%d"),
    }
    if ns:
        result["sweep"] = sweep(model, tok, opts, ns, prompts, max_new)
    result["e2e"] = end_to_end(sys_engine, ar_engine, prompts, max_new, args.trials)
    if not args.no_profile and sys_engine.graphs:
        result["profile_skipped"] = "CUDA graphs: a replay runs no module hooks"
    elif not args.no_profile:
        result["profile_ms"] = profile(sys_engine, prompts[0], max_new)
    if not args.no_peer:
        try:
            few = prompts[: max(1, min(args.peer_requests, len(prompts)))]
            reference = [ar_engine.generate(p, max_new).tokens for p in few]
            result["peer"] = peer(stock_model, dep, opts, few, max_new, reference)
        except Exception as e:  # the peer is a comparison, never a reason to lose the bench
            result["peer"] = {"error": f"{type(e).__name__}: {e}"}
    peer_rows = llamacpp_peer_result(args, dep, device, lambda spec: llamacpp_side_by_side(
        prompts, max_new, args.trials, spec, tok, args.data_dir))
    if peer_rows is not None:
        result["llamacpp"] = peer_rows
    out = output_dir(args, dep)
    if ns and not args.no_plots:
        result["plots"] = _plots(result, out)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    _table(result)
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
