"""Token forcing on the stock target: the model work behind the forcer's rules.

    forcer = Forcer(load_engine(deployment))        # the *stock* engine, default options
    report = forcer.run(parse_outputs(raw, ...))    # Report(passed, reason, stats, audited)
    fields = force_outputs(deployment, raw)         # the same, forcer loaded once per process

- `Forcer.force(prompt_ids, tokens)` runs prompt + output through the stock model in **one**
  teacher-forced forward (causal mask over the whole sequence, fresh KV cache) and computes the
  LM head in FP32 from the final hidden states: ``hidden.float() @ W_head.float().T``, in chunks
  of positions. Output position ``j`` is predicted from sequence index ``len(prompt) - 1 + j``. It
  returns, per position, the FP32 argmax, the runner-up, the margin of the system's token and the
  top-2 gap.
- Stock's own outputs are forced the same way: given with each output (``stock_tokens``), or
  generated here by the stock engine (greedy, its real options) for the same prompts and the same
  number of tokens. Stock's own mismatch margins calibrate δ (`forcing_rules.calibrate_delta`).
  Where the stock model computes in FP32 on a CPU, where any drafter gives the AR tokens bit for bit
  (the lossless tests), the stock engine drafts the *system's* output while it agrees with it
  (`FollowDraft`), its own drafter after they part: stock's exact tokens at a fraction of the steps.
- Every report carries the rate rule's power (`forcing_rules.rate_power`: the probability of
  rejecting a system one point worse than stock with these counts) and the forced positions a side
  that 90% power needs (`forcing_rules.tokens_for_power`), so the controller can force more.
- `Forcer.stock_pick(prefix)` is the explanation check: the stock engine's own greedy decode of
  one token after that exact prefix (its real dtype, kernels and LM head, through
  `Engine.generate`). An event is explained when it returns the system's token. An FP32 CPU stock's
  pick is its forced FP32 argmax (no decode: `audit`), since its tokens do not depend on the step's
  shape and an event's margin is far above rounding.
- Stock's outputs are kept between processes in the forcing service's own folder of the data directory
  (``forcer/stock-outputs``; ``controller/stock-outputs`` for the sealed final, forced by the controller),
  keyed by the stock runtime's files, its options and the prompt: the controller forces the same dev
  prompts for every candidate.
- `Forcer.run` audits up to ``max_audit`` events per side (a seeded uniform sample beyond that),
  then applies `forcing_rules.verdict`. Both runs use the same model object, so the forcer holds one
  copy of the weights.

What this module does not do: decide the rules (`specpilot.forcing_rules`), talk to NATS (the forcer
service), or trust the
system's code: it only ever runs stock's engine on token ids.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specpilot import forcing_rules
from specpilot.forcing_rules import Output

HEAD_CHUNK = 256  # positions per FP32 head matmul (bounds memory at chunk x vocab x 4 bytes)
MEMO_ENTRIES = 4096  # stock outputs and stock forced passes kept per forcer (the dev prompts repeat)


@dataclass(frozen=True)
class Forced:
    """Per output position of one request, after the teacher-forced pass (numpy arrays, length n)."""

    tokens: np.ndarray  # the forced (system's) tokens
    argmax: np.ndarray  # FP32 argmax
    runner_up: np.ndarray  # FP32 second choice
    margin: np.ndarray  # logit[argmax] - logit[token], >= 0
    top2_gap: np.ndarray  # logit[argmax] - logit[runner_up]

    @property
    def mismatch(self) -> np.ndarray:
        return self.tokens != self.argmax

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Side:
    """One forced run (the system's or stock's) and its audited events."""

    forced: list[Forced]
    outputs: list[Output]
    events: list[tuple[int, int]] = field(default_factory=list)  # (prompt index, position)
    audited: list[dict[str, Any]] = field(default_factory=list)

    def mismatch_margins(self) -> np.ndarray:
        parts = [f.margin[f.mismatch] for f in self.forced]
        return np.concatenate(parts) if parts else np.zeros(0)

    def counts(self) -> forcing_rules.Counts:
        return forcing_rules.Counts(positions=sum(len(f) for f in self.forced),
                            mismatches=int(sum(f.mismatch.sum() for f in self.forced)),
                            events=len(self.events), audited=len(self.audited),
                            unexplained_audited=sum(not a["explained"] for a in self.audited))


@dataclass(frozen=True)
class Report:
    passed: bool
    reason: str
    stats: dict[str, Any]
    audited: list[dict[str, Any]]  # the system's audited events (at most forcing_rules.MAX_AUDITED)
    verdict: forcing_rules.Verdict | None = None

    def fields(self) -> dict[str, Any]:
        """The ``ForcingReported`` fields this report fills."""
        return {"passed": self.passed, "reason": self.reason, "stats": self.stats, "audited": self.audited}


def head_weight_fp32(model: torch.nn.Module) -> torch.Tensor:
    """An FP32 view (or copy) of the stock model's LM head weight, [vocab, dim]."""
    w = getattr(model.lm_head, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"the stock model's LM head ({type(model.lm_head).__name__}) exposes no weight")
    return w.detach().float()


class Forcer:
    """Forcing against one loaded stock engine (an `specpilot.engine.api.Engine` with the deployment's stock options)."""

    def __init__(self, engine, memo_dir: Path | None = None):
        """``memo_dir``: where stock's outputs are kept between processes (None: in memory only), keyed by
        the stock runtime's files, its options and the prompt."""
        self.engine = engine
        self.model = engine.model
        self.head = head_weight_fp32(self.model)
        self._stock_outputs: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # prompt -> (n, tokens)
        self._stock_forced: dict[tuple[tuple[int, ...], tuple[int, ...]], Forced] = {}
        self.memo_dir = Path(memo_dir) if memo_dir is not None else None
        self._stock_identity = ""

    # --- the teacher-forced pass ----------------------------------------------------------------

    @torch.no_grad()
    def force(self, prompt_ids: tuple[int, ...] | list[int], tokens: tuple[int, ...] | list[int]) -> Forced:
        n = len(tokens)
        if n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return Forced(empty, empty, empty, np.zeros(0, np.float32), np.zeros(0, np.float32))
        seq = [*prompt_ids, *tokens[:-1]]  # the last output token is never an input
        if len(seq) + 1 > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt + output of {len(seq) + 1} tokens exceed the stock model's context "
                             f"of {self.model.cfg.max_seq_len}")
        device = self.model.device
        x = torch.tensor([seq], dtype=torch.int64, device=device)
        positions = torch.arange(len(seq), device=device)
        cache = self.model.new_cache(len(seq))
        # last_only: the model's own head runs on one row; the FP32 head below does every position.
        _, hidden = self.model(x, positions, cache, 0, mask=None, last_only=True)
        h = hidden[0, len(prompt_ids) - 1:]
        del cache
        target = torch.tensor(list(tokens), dtype=torch.int64, device=device)
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for s in range(0, n, HEAD_CHUNK):
            logits = h[s:s + HEAD_CHUNK].float() @ self.head.T  # [c, vocab], FP32
            top = logits.topk(2, dim=-1)
            own = logits.gather(1, target[s:s + HEAD_CHUNK, None])[:, 0]
            for out, t in zip(parts, (top.indices[:, 0], top.indices[:, 1], top.values[:, 0] - own,
                                      top.values[:, 0] - top.values[:, 1]), strict=True):
                out.append(t)
        argmax, runner, margin, gap = (torch.cat(p).cpu().numpy() for p in parts)
        # A tie between the argmax and the system's token is not a mismatch.
        argmax = np.where(margin <= 0, np.asarray(tokens), argmax)
        return Forced(np.asarray(tokens, dtype=np.int64), argmax.astype(np.int64), runner.astype(np.int64),
                      np.maximum(margin, 0).astype(np.float32), gap.astype(np.float32))

    # --- stock's own decisions ------------------------------------------------------------------

    def stock_pick(self, prefix: list[int]) -> int:
        """The token the stock engine itself emits next after ``prefix`` (greedy, its real numerics)."""
        return int(self.engine.generate(list(prefix), 1).tokens[0])

    def stock_output(self, prompt_ids: tuple[int, ...], n: int, guess: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Stock's own greedy output of up to ``n`` tokens; ``guess`` (the system's output for the prompt)
        is drafted while stock agrees with it where that is exact (`follows_exactly`). Memoised per prompt:
        greedy decoding makes the first ``n`` tokens of a longer output the output of ``n`` tokens."""
        if n <= 0:
            return ()
        key = tuple(prompt_ids)
        have = self._stock_outputs.get(key) or self._recall(key)
        if have is None or (have[0] < n and len(have[1]) == have[0]):  # (an output that stopped stays)
            own = self.engine.drafter
            if guess and self.follows_exactly:
                self.engine.drafter = FollowDraft(len(prompt_ids), tuple(guess), own)
            try:
                have = (n, tuple(self.engine.generate(list(prompt_ids), n).tokens))
            finally:
                self.engine.drafter = own
            self._keep(key, have)
        _remember(self._stock_outputs, key, have)
        return have[1][:n]

    def _memo_path(self, prompt: tuple[int, ...]) -> Path | None:
        if self.memo_dir is None:
            return None
        if not self._stock_identity:
            from specpilot.entries import tree_hashes
            from specpilot.paths import REPO_ROOT

            runtime = json.dumps(sorted(tree_hashes(REPO_ROOT).items()))
            self._stock_identity = hashlib.sha256(f"{runtime}|{self.engine.options}".encode()).hexdigest()
        key = hashlib.sha256(f"{self._stock_identity}|{list(prompt)}".encode()).hexdigest()[:32]
        return self.memo_dir / f"{key}.json"

    def _recall(self, prompt: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
        path = self._memo_path(prompt)
        try:
            n, tokens = json.loads(path.read_text()) if path is not None else (None, None)
        except (OSError, ValueError):
            return None
        return (int(n), tuple(tokens)) if n is not None else None

    def _keep(self, prompt: tuple[int, ...], have: tuple[int, tuple[int, ...]]) -> None:
        path = self._memo_path(prompt)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps([have[0], list(have[1])]))
        tmp.rename(path)

    @property
    def follows_exactly(self) -> bool:
        """Whether any drafter yields stock's tokens bit for bit: FP32 on a CPU (chains and trees of any
        drafter verify to the AR tokens there; tests/engine/test_lossless.py)."""
        return self.model.device.type == "cpu" and self.model.dtype == torch.float32 and self.engine.drafter is not None

    # --- a whole run ----------------------------------------------------------------------------

    def force_side(self, outputs: list[Output], memo: bool = False) -> Side:
        """Force every output; with ``memo`` (stock's side) reuse and keep earlier passes."""
        forced = []
        for o in outputs:
            key = (tuple(o.prompt_ids), tuple(o.tokens))
            f = self._stock_forced.get(key) if memo else None
            if f is None:
                f = self.force(o.prompt_ids, o.tokens)
                if memo:
                    _remember(self._stock_forced, key, f)
            forced.append(f)
        return Side(forced, outputs)

    def audit(self, side: Side, delta: float, max_audit: int, rng: np.random.Generator) -> None:
        """Find the side's events (margin > 2δ) and check the explanation of up to ``max_audit``."""
        side.events = [(i, int(j)) for i, f in enumerate(side.forced)
                       for j in np.flatnonzero(f.mismatch & (f.margin > forcing_rules.EVENT_FACTOR * delta))]
        chosen = side.events
        if len(chosen) > max_audit:
            idx = np.sort(rng.choice(len(chosen), size=max_audit, replace=False))
            chosen = [chosen[k] for k in idx]
        for i, j in chosen:
            o, f = side.outputs[i], side.forced[i]
            # An FP32 CPU stock emits its FP32 argmax whatever the step's shape (the lossless tests), and an
            # event's margin (> 2δ >= 0.1 logit) is far above what summation order moves: its pick is the
            # forced argmax, with no decode. Elsewhere the stock engine decodes that exact prefix.
            exact = self.follows_exactly
            pick = int(f.argmax[j]) if exact else self.stock_pick([*o.prompt_ids, *o.tokens[:j]])
            side.audited.append({"prompt_index": i, "position": j, "system_token": int(f.tokens[j]),
                                 "argmax_token": int(f.argmax[j]), "margin": float(f.margin[j]),
                                 "stock_token": pick, "explained": pick == int(f.tokens[j]),
                                 "stock_pick": "forced argmax (fp32 CPU stock)" if exact else "stock decode"})

    def run(self, outputs: list[Output], max_audit: int = forcing_rules.MAX_AUDITED, seed: int = 0,
            delta: float | None = None) -> Report:
        """Force the system's outputs and stock's own, calibrate δ, audit events, apply both rules.

        ``delta`` overrides the calibration (tests); stock's tokens come from each output's
        ``stock_tokens`` or are generated here.
        """
        t0 = time.perf_counter()
        stock_outputs = [Output(o.prompt_ids, o.stock_tokens if o.stock_tokens is not None
                                else self.stock_output(o.prompt_ids, len(o.tokens), o.tokens)) for o in outputs]
        stock_s = time.perf_counter() - t0
        stock = self.force_side(stock_outputs, memo=True)
        calibrated = forcing_rules.calibrate_delta(stock.mismatch_margins())
        d = calibrated if delta is None else delta
        system = self.force_side(outputs)
        rng = np.random.default_rng(seed)
        self.audit(stock, d, max_audit, rng)
        self.audit(system, d, max_audit, rng)
        v = forcing_rules.verdict(system.counts(), stock.counts(), d)
        st = v.stats()
        sys_c, stock_c = system.counts(), stock.counts()
        st.update({
            "power": forcing_rules.rate_power(sys_c.positions, stock_c.positions, stock_c.rate),
            "tokens_for_power": forcing_rules.tokens_for_power(stock_c.rate),
            "power_excess": forcing_rules.POWER_EXCESS,
            "calibrated_delta": calibrated, "prompts": len(outputs), "seconds": time.perf_counter() - t0,
            "stock_generation_s": stock_s,
            "stock_generated": sum(o.stock_tokens is None for o in outputs),
            "stock_audited": stock.audited[:20],
            "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device),
        })
        return Report(v.passed, v.reason, st, system.audited, v)


class FollowDraft:
    """A drafter for the stock engine that proposes the system's own output while the committed
    context still agrees with it, and asks stock's own drafter once they part (or None: no guess).
    It changes how fast stock's tokens come, never which: the target verifies every one."""

    def __init__(self, prompt_len: int, tokens: tuple[int, ...], fallback=None):
        self.prompt_len, self.tokens, self.fallback = prompt_len, tokens, fallback

    def reset(self) -> None:
        if self.fallback is not None:
            self.fallback.reset()

    def propose(self, context: list[int], last_hidden, k: int, n: int) -> list:
        from specpilot.engine.tree import Candidate

        done = len(context) - self.prompt_len
        if 0 < done < len(self.tokens) and tuple(context[self.prompt_len:]) == self.tokens[:done]:
            ahead = self.tokens[done:done + k]
            return [Candidate(ahead, tuple(1.0 for _ in ahead))]
        return self.fallback.propose(context, last_hidden, k, n) if self.fallback is not None else []


def _remember(memo: dict, key, value) -> None:
    memo[key] = value
    while len(memo) > MEMO_ENTRIES:
        del memo[next(iter(memo))]  # oldest first


def load_forcer(deployment: str | Path, data_dir: Path | None = None, device: str | None = None,
                owner: str = "forcer") -> Forcer:
    """A forcer over the deployment's stock engine (default options: stock); stock's outputs are kept
    in ``data_dir/<owner>/stock-outputs``, the folder of the service that forces (each its own).

    A server deployment (`specpilot.harness.server`) is forced against its ``target`` in this engine in
    fp32 on the CPU, AR: the reference its weights define. Its stock's own outputs (the stock server's)
    must come with each output as ``stock_tokens``: the reference's own would make stock look perfect."""
    from specpilot.harness.deployment import deployment_or_none, load_engine

    if (dep := deployment_or_none(deployment)) is not None and dep.server:
        engine = load_engine(dep.target, {"drafter": "none"}, device="cpu", data_dir=data_dir)
    else:
        engine = load_engine(deployment, device=device, data_dir=data_dir)
    return Forcer(engine, memo_dir=Path(data_dir) / owner / "stock-outputs" if data_dir is not None else None)


_forcers: dict[tuple[str, str, str, str], Forcer] = {}
_lock = threading.Lock()  # one engine, one request at a time


def forcer_for(deployment: str | Path, data_dir: Path | None = None, device: str | None = None,
               owner: str = "forcer") -> Forcer:
    """The deployment's stock forcer, loaded once per process and kept."""
    key = (str(deployment), str(data_dir or ""), str(device or ""), owner)
    with _lock:
        if key not in _forcers:
            _forcers[key] = load_forcer(deployment, data_dir=data_dir, device=device, owner=owner)
        return _forcers[key]


def _with_server_stock(dep, outputs: list, data_dir: Path | None) -> list:
    """For a server deployment ``dep`` (a `Deployment`, or None for a bare model), stock's own tokens where an
    output lacks them: the stock server's (started here with its default flags), not the fp32 reference's,
    which would make stock look perfect."""
    import dataclasses

    if all(o.stock_tokens is not None for o in outputs):
        return outputs
    if dep is None or not dep.server:
        return outputs
    from specpilot.engine.weights import load_tokenizer
    from specpilot.harness.server import ServerEngine

    with ServerEngine(dep.server_spec(), {}, load_tokenizer(dep.target, data_dir=data_dir)) as stock:
        return [o if o.stock_tokens is not None else
                dataclasses.replace(o, stock_tokens=tuple(stock.generate(list(o.prompt_ids), len(o.tokens)).tokens))
                for o in outputs]


def force_outputs(deployment: str | Path, outputs: list[dict[str, Any]], data_dir: Path | None = None,
                  device: str | None = None, max_audit: int | None = None, seed: int = 0,
                  owner: str = "forcer") -> dict[str, Any]:
    """Force raw outputs (``ForcingRequested.outputs`` dicts, or text as `forcing_rules.parse_outputs` takes)
    against the deployment's stock engine: what the service and ``specpilot force`` both run.

    Returns the ForcingReported fields ``{"passed", "reason", "stats", "audited"}``. Raises
    ValueError for malformed or empty outputs and FileNotFoundError for an unknown deployment.
    """
    from specpilot.harness.deployment import deployment_or_none

    if not outputs:
        raise ValueError("there are no outputs to force")
    dep = deployment_or_none(deployment)  # resolved once for this request (the forcer is cached by name)
    forcer = forcer_for(deployment, data_dir, device, owner)
    with _lock:
        parsed = forcing_rules.parse_outputs(outputs, encode=lambda text, chat: forcer.engine.tokenize(text, chat=chat),
                                     vocab_size=forcer.model.cfg.vocab_size)
        parsed = _with_server_stock(dep, parsed, data_dir)
        report = forcer.run(parsed, max_audit=forcing_rules.MAX_AUDITED if max_audit is None else max_audit, seed=seed)
    return {**report.fields(), "stats": {**report.stats, "deployment": str(deployment)}}
