"""Peers: other engines on the same weights and prompts, measured beside ours (comparisons, never verdicts).

- `peer(model, dep, opts, prompts, max_new, reference)`: transformers' assisted generation with prompt
  lookup (``prompt_lookup_num_tokens`` = the system's block size) against transformers' own greedy
  generation, on our model's tensors (GGUF targets) or the checkpoint itself (``hf:`` targets); with our
  AR outputs as ``reference``, the share of prompts where transformers' greedy output equals ours. The
  sealed final's and `specpilot bench`'s peer.
- llama.cpp's ``llama-server`` with the stock flags of the ``llamacpp-smollm2-cpu`` deployment (AR) and with
  its n-gram speculation (`LLAMACPP_SPEC`): `llamacpp_side_by_side` pairs them request by request for each
  GGUF format (`LLAMACPP_FORMATS`: the shipped Q4_1 and BF16/F32 made from it by ``llama-quantize``, cached
  in the data folder); `llamacpp_closed_loop` runs them under closed-loop clients, one slot a client
  (`server_closed_loop`). Only where ``scripts/build_llamacpp.sh`` built llama.cpp; never built here.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specpilot.engine.options import EngineOptions
from specpilot.harness.speed import end_to_end, sync, warm_up

# llama.cpp's n-gram speculation in the side-by-side rows unless told otherwise: ngram-map-k with a 3-token
# lookup and 8-token drafts, from the hand-run size table (docs/FIGURES.md, serving engines). The round's
# promoted ngram-mod + mod_n_match 8 measured 0.97x of stock on sealed requests.
LLAMACPP_SPEC = {"spec_type": "ngram-map-k", "map_k_size_n": 3, "map_k_size_m": 8}
LLAMACPP_FORMATS = ("q4_1", "bf16", "f32")  # the shipped GGUF's, then made from it
LLAMACPP_DEPLOYMENT = "llamacpp-smollm2-cpu"  # whose [server] table the peer runs


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
            sync(model.device)
            t = time.perf_counter()
            with torch.no_grad():
                g = hf.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids),
                                **extra)
            sync(model.device)
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


def llamacpp_side_by_side(prompts, max_new: int, trials: int, spec_options: dict, tok, data_dir=None) -> dict:
    """llama.cpp's server, AR against ``spec_options``, per GGUF format (`LLAMACPP_FORMATS`)."""
    import dataclasses

    from specpilot.harness.deployment import load_deployment
    from specpilot.harness.server import ServerEngine

    base = load_deployment(LLAMACPP_DEPLOYMENT).server_spec()
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


def server_closed_loop(server, prompts: list[list[int]], clients: int, max_new: int) -> dict:
    """``clients`` threads, each sending the next unsent prompt as soon as its last one is answered (in
    prompt order), to one running server; output tokens/s of wall time and latency percentiles."""
    import threading

    from specpilot.harness.loadgen import _percentile

    lock, latencies, outputs = threading.Lock(), [], {}
    state = {"next": 0, "error": None}

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= len(prompts) or state["error"]:
                    return
                state["next"] += 1
            t0 = time.perf_counter()
            try:
                done = server.generate(prompts[i], max_new)
            except Exception as exc:  # noqa: BLE001 - reported once, the other clients stop
                state["error"] = f"{type(exc).__name__}: {exc}"
                return
            with lock:
                latencies.append(time.perf_counter() - t0)
                outputs[i] = done.tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if state["error"]:
        raise RuntimeError(state["error"])
    lat = sorted(latencies)
    return {"tok_s": sum(map(len, outputs.values())) / wall, "wall_s": round(wall, 3),
            "latency_p50_s": _percentile(lat, 50), "latency_p99_s": _percentile(lat, 99),
            "outputs": [outputs[i] for i in range(len(prompts))]}


def llamacpp_closed_loop(prompts: list[list[int]], max_new: int, clients: int, spec_options: dict, tok) -> dict:
    """llama.cpp's server with ``clients`` slots, AR and with ``spec_options``, under the closed-loop load."""
    import dataclasses

    from specpilot.harness.deployment import load_deployment
    from specpilot.harness.server import ServerEngine

    base = load_deployment(LLAMACPP_DEPLOYMENT).server_spec()
    base.settings(spec_options)
    command = list(base.command)
    for flag, value in (("--parallel", str(clients)), ("--ctx-size", str(1024 * clients))):
        command[command.index(flag) + 1] = value  # one slot a client, each with 1024 positions
    spec = dataclasses.replace(base, command=tuple(command))
    rows = {}
    for name, options in (("AR", {}), ("speculative", spec_options)):
        with ServerEngine(spec, options, tok) as server:
            server_closed_loop(server, prompts[:clients], clients, 8)  # warm up every slot
            rows[name] = server_closed_loop(server, prompts, clients, max_new)
    rows["speculative"]["speedup_over_ar"] = rows["speculative"]["tok_s"] / rows["AR"]["tok_s"]
    rows["speculative"]["identical_to_ar"] = rows["speculative"]["outputs"] == rows["AR"]["outputs"]
    for r in rows.values():
        del r["outputs"]
    return {"format": "q4_1", "slots": clients, "threads": base.settings()["threads"], "options": spec_options,
            "rows": rows}

