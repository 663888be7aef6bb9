"""The engine's public entry point: load once, then generate token ids.

    engine = build_engine("smollm2-135m", EngineOptions(verify="tree").resolved())   # a model in CONFIGS
    ids = engine.tokenize("Write a haiku.", chat=True)
    result = engine.generate(ids, max_new_tokens=64)          # GenerationResult
    text = engine.detokenize(result.tokens)

Harnesses load an engine for a deployment with `specpilot.harness.deployment.load_engine` (the deployment's
stock options with overrides), which calls `build_engine`. `build_engine` applies every option that changes the model (dtype, weight format, LM head,
compile) and builds the drafter. `Engine.generate` is greedy; it raises ValueError on an empty
prompt or one that does not fit the model's context. `Engine.generate` serves one request at a time and
is not thread-safe; it reuses one KV cache, grown when a request needs more. `Engine.batch_decoder` gives a
continuous-batching decoder over the same model and options (batched deployments).

``cuda_graphs`` makes the engine replay its decode steps as CUDA graphs (`specpilot.engine.graphs`, captured
lazily per block size and attention-length bucket, re-captured when the cache grows); on a device
other than CUDA it is a no-op, noted once in the log, so an options sweep on a CPU does not fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specpilot.engine.batch import BatchDecoder, BatchPolicy
from specpilot.engine.decode import DecodeConfig, Generation, generate
from specpilot.engine.drafters import make_drafter
from specpilot.engine.graphs import GraphRunner, graphs_supported
from specpilot.engine.model import Transformer
from specpilot.engine.options import EngineOptions, model_options
from specpilot.engine.weights import Tokenizer, load_model

log = logging.getLogger(__name__)
_noted_graphs_off_cuda = False


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # output ids (prompt excluded), a final stop token included
    steps: int  # target forwards after the prefill
    accepted_per_step: list[int]  # tokens committed by each step, bonus token included
    draft_s: list[float]
    verify_s: list[float]
    prefill_s: float
    verified_per_step: list[int] = field(default_factory=list)  # tokens in each step's forward, root included

    @property
    def tau(self) -> float:
        """Mean tokens committed per step (the prefill's first token excluded)."""
        return sum(self.accepted_per_step) / max(1, self.steps)

    @classmethod
    def from_generation(cls, g: Generation) -> GenerationResult:
        return cls(g.tokens, g.steps, g.committed, g.draft_s, g.verify_s, g.prefill_s, g.verified)


def _round_up(n: int, m: int = 256) -> int:
    return (n + m - 1) // m * m


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, options: EngineOptions):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.cfg = model.cfg
        self.drafter = make_drafter(options, model)
        self.decode_cfg = DecodeConfig(block_size=options.block_size, tree=options.verify == "tree",
                                       tree_nodes=options.tree_nodes)
        self._cache = None
        self._runner = None
        self._batch: BatchDecoder | None = None
        self.graphs = options.cuda_graphs and graphs_supported(self.device)
        if options.cuda_graphs and not self.graphs:
            _note_graphs_off_cuda(self.device)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def graph_runner(self, cache):
        """The CUDA graph runner over ``cache`` (None unless cuda_graphs is on and usable)."""
        if not self.graphs:
            return None
        if self._runner is None or self._runner.cache is not cache:
            self._runner = None  # release the old graphs before capturing new ones
            self._runner = GraphRunner(self.model, cache)
        return self._runner

    def _cache_for(self, slots: int):
        if self._cache is None or self._cache.max_len < slots:
            self._cache = self._runner = None  # free the old buffers (and graphs over them) first
            self._cache = self.model.new_cache(min(_round_up(slots), self.cfg.max_seq_len + self.options.tree_nodes + 1))
        return self._cache

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: generation needs at least one prompt token")
        if bad := [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(prompt_ids) + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceed "
                             f"the model's context of {self.cfg.max_seq_len} tokens")
        # Room for the longest output plus one tree's worth of speculative slots.
        cache = self._cache_for(len(prompt_ids) + max_new_tokens + self.options.tree_nodes + 1)
        g = generate(self.model, cache, prompt_ids, max_new_tokens, self.drafter, self.decode_cfg,
                     self.cfg.stop_ids, self.graph_runner(cache))
        result = GenerationResult.from_generation(g)
        return result

    def batch_decoder(self, rows: int, max_len: int) -> BatchDecoder:
        """A continuous-batching decoder (`specpilot.engine.batch`) over this engine's model and options: one
        drafter a row, the options' `BatchPolicy`, cache rows of at least ``max_len`` slots plus a step's
        drafts. Kept and reused while ``rows`` and the room suffice (its cache is the big allocation)."""
        room = _round_up(max_len + self.options.step_tokens + 1)
        dec = self._batch
        if dec is None or dec.rows != rows or dec.cache.max_len < room or dec.busy:
            self._batch = None  # free the old rows first
            policy = BatchPolicy(node_budget=self.options.batch_node_budget,
                                 adaptive_block=self.options.batch_adaptive_block,
                                 prefill_chunk=self.options.prefill_chunk,
                                 padded_attention=self.options.batch_attention == "padded",
                                 max_spec_rows=self.options.batch_spec_max_rows,
                                 device_drafts=self.options.batch_device_drafts,
                                 compile_drafts=self.options.batch_compile_drafts)
            first = make_drafter(self.options, self.model)
            fork = getattr(first, "fork", None)  # one trained net for every row, each row its own state
            drafters = [first, *(fork() if fork else make_drafter(self.options, self.model) for _ in range(rows - 1))]
            runner = (lambda cache: GraphRunner(self.model, cache)) if self.graphs else None
            self._batch = BatchDecoder(self.model, drafters, self.decode_cfg, rows, room, self.cfg.stop_ids, policy,
                                       static_steps=runner)
        return self._batch

    def tokenize(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; with ``chat`` wrapped in the model's chat template (one user turn)."""
        return self.tokenizer.encode(self.tokenizer.chat_prompt(text) if chat else text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _note_graphs_off_cuda(device: torch.device) -> None:
    global _noted_graphs_off_cuda
    if not _noted_graphs_off_cuda:
        _noted_graphs_off_cuda = True
        log.warning("cuda_graphs=True has no effect on device %s (CUDA only): decoding stays eager", device)


# The options `apply_model_options` reads (their OptionInfo says model=True): two systems that differ in
# one of them need two models.
MODEL_OPTIONS = model_options()


def apply_model_options(model: Transformer, opts: EngineOptions) -> Transformer:
    """Options that change the target model itself (not the decoding loop): `MODEL_OPTIONS`."""
    if opts.fused_kernels:  # first: it rebuilds the blocks, and later options swap their linears
        from specpilot.engine.fused import fuse_model

        fuse_model(model, gemv=opts.fused_gemv)
    if opts.weight_format == "w12":
        try:
            from specpilot.kernels.w12 import quantize_model_linears
        except ImportError as e:
            raise ImportError(f"weight_format='w12' needs specpilot.kernels.w12.quantize_model_linears ({e})") from e
        quantize_model_linears(model, include_lm_head=False)
    if opts.lm_head == "fp32":
        model.use_fp32_head()
    if opts.linear_backend != "default":
        from specpilot.engine.packed import pack_linears

        pack_linears(model, opts.linear_backend)
    if opts.screened_head:  # after the backend: it wraps the head the backend built
        from specpilot.engine.screened_head import ScreenedHead

        model.lm_head = ScreenedHead(model.lm_head)
    if opts.compile:
        # dynamic=True: block sizes and cache lengths vary step to step; one graph serves them all.
        model.forward = torch.compile(model.forward, dynamic=True)
    return model


def build_engine(target: str, options: EngineOptions, device: str = "cpu", data_dir: Path | None = None) -> Engine:
    """An engine for the model ``target`` (a name in ``CONFIGS``) with resolved ``options`` (its dtype set)."""
    if options.dtype is None:
        raise ValueError("build_engine needs resolved options (dtype set): use EngineOptions.resolved()")
    model, tokenizer = load_model(target, dtype=options.dtype, device=device, data_dir=data_dir)
    engine = Engine(apply_model_options(model, options), tokenizer, options)
    return engine
