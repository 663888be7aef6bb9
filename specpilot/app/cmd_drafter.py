"""`specpilot drafter train`: train a drafter by self-distillation, on the CPU, in minutes.

``--kind parallel`` (default) trains `specpilot.engine.drafters.parallel`, ``--kind eagle`` the recurrent
`specpilot.engine.drafters.eagle`. Both share steps 1-3 and 5 and the optimisation loop (`fit.fit`).
This module is the command: its flags, where the weights go, the time budget, the log and the output.
The work is the harness's: prompts in `specpilot.harness.corpus`, data in `specpilot.harness.distill`,
training and figures in `specpilot.harness.fit`.

1. Prompts from text on the machine (`corpus.collect_prompts`): code from Python's standard library (the
   lines before a ``def``), HumanEval-shaped prompts (a standard-library function's ``def`` line and
   docstring, parallel drafter) and chat prompts made from standard-library docstrings and functions. With
   ``--dev-prompts`` the parallel drafter also uses the deployment's *dev* requests (never the
   sealed ones); by default no request of the deployment is used. All choices are seeded.
2. Self-distillation data (`distill.generate_data`): the target greedily continues every prompt (batched,
   left-padded, lockstep), recording the hidden state behind each token. Training on the target's *own*
   outputs is what makes drafts match its argmax. Parallel: each generated position t gives
   (hidden state that chose x_{t+1}, last tokens, the target's next K tokens). Eagle: the rows are
   kept as sequences, and the prompt positions count too wherever the prompt text happens to be
   the target's greedy continuation (see `distill.eagle_streams`). With ``--data DIR`` every generated
   batch is also kept there, and a later run with the same prompts reuses them and generates only
   the rest (``--generate-only`` gathers data over several runs, e.g. several calls on a GPU).
3. Draft vocabulary: the most frequent tokens of that data.
4. Training (`fit.train_parallel_drafter`, `fit.train_eagle_drafter`): AdamW, cross-entropy per drafted
   position (earlier positions weigh more), until the time budget; 5% of the sequences are held out. Eagle
   unrolls its recurrent step K times on the target's greedy tokens from its own state, plus a regression
   of that state onto the target's hidden states.
5. Figures: held-out accuracy per position, the chain tau they imply, and tau measured by the
   engine (chain, block 4) on a few dev requests (`fit.measured_tau`). They are saved in the weights file
   with the SHA-256 of the training data and the command line.

Generation and training share one time budget (``--minutes``). Both run on ``--device`` (the CPU by
default); the eagle drafter always trains on the CPU.

`add_commands(subparsers)` registers ``drafter train``; `run(args)` runs it (the deployment is loaded once,
here) and `main(argv)` runs it as ``python -m specpilot.app.cmd_drafter``. It writes the weights file
(``--out`` or where the engine looks; `save_drafter`'s format, with the figures in its ``meta``) and, with
``--data``, the generated batches; progress goes to stderr, and the last line on stdout is one JSON object
(the figures, or with ``--generate-only`` what was generated). Exit status 0; an unwritable weights path, a
``--new-tokens`` that leaves no room for a prompt or a ``--data`` file of other prompts raises
`specpilot.errors.UserError` (the CLI's exit 2, as for a bad flag).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from specpilot.engine.drafters import eagle
from specpilot.engine.drafters.parallel import DEFAULT_WEIGHTS, save_drafter
from specpilot.errors import UserError, non_negative_int, positive_float, positive_int
from specpilot.harness.corpus import collect_prompts
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT, Deployment, load_deployment
from specpilot.harness.distill import data_sha256, generate_data, log
from specpilot.harness.fit import TrainSettings, measured_tau, train_eagle_drafter, train_parallel_drafter

KINDS = {"parallel": DEFAULT_WEIGHTS, "eagle": eagle.DEFAULT_WEIGHTS}  # kind -> shipped file per target


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kind", choices=sorted(KINDS), default="parallel", help="which drafter to train")
    ap.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="its target and dev requests are used")
    ap.add_argument("--out", type=Path, default=None, help="weights file (default: the deployment's [options] drafter_weights if its drafter is this kind, else the shipped "
                    "file for SmolLM2, else <checkpoint>/specpilot/<kind>_drafter.pt for an hf: target, where the "
                    "engine looks)")
    ap.add_argument("--minutes", type=positive_float, default=18.0, help="total time budget (generation + training)")
    ap.add_argument("--gen-share", type=float, default=0.6, help="share of the budget spent generating data")
    ap.add_argument("--batch", type=positive_int, default=16, help="prompts generated in lockstep")
    ap.add_argument("--new-tokens", type=positive_int, default=96, help="tokens generated per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--prompts", type=positive_int, default=2000, help="standard-library prompts of each kind (code, chat)")
    ap.add_argument("--device", default="cpu", help="where the target generates and the drafter trains")
    ap.add_argument("--k", type=int, default=None,
                    help="positions drafted per pass (parallel, default 4) / steps unrolled (eagle, default 6)")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--width", type=int, default=None, help="drafter width (default: the target's hidden size)")
    ap.add_argument("--n-context", type=int, default=3, help="parallel: committed tokens embedded")
    ap.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                    help="parallel: the copy path over the context's earlier occurrences (specpilot.engine.drafters.parallel)")
    ap.add_argument("--lookup-periodic", action=argparse.BooleanOptionalAction, default=False,
                    help="parallel: continue a looked-up repeat past the context's end (SuffixIndex periodic)")
    ap.add_argument("--copy-min-match", type=int, default=3,
                    help="parallel: propose a lookup matched at least this deep as a whole span (0: never; "
                         "ParallelConfig.copy_min_match)")
    ap.add_argument("--dev-prompts", action=argparse.BooleanOptionalAction, default=False,
                    help="parallel: also train on the deployment's dev requests (after the first --eval-requests); "
                         "off, no request of the deployment is seen and tau on any of them is a held-out figure")
    ap.add_argument("--docstrings", type=non_negative_int, default=4000,
                    help="parallel: HumanEval-shaped prompts (a function's def line and docstring) from the standard library")
    ap.add_argument("--docstring-variants", action=argparse.BooleanOptionalAction, default=True,
                    help="parallel: each docstring prompt also with made-up examples, and those with the "
                         "leads the target writes on HumanEval (corpus.docstring_variants)")
    ap.add_argument("--general-chat", type=non_negative_int, default=0,
                    help="parallel: up to this many everyday chat prompts (explanations, advice, short writing; "
                         "corpus.general_chat_prompts), none near a shipped request")
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA: generate with TF32 matmuls (1.46x on an H200; the target's argmax "
                         "differs from fp32 only at near-ties, and the drafter is only trained on it)")
    ap.add_argument("--data", type=Path, default=None,
                    help="keep the generated data here (a file a batch) and reuse what an earlier run with the "
                         "same prompts left: generation resumes where that run stopped")
    ap.add_argument("--generate-only", action="store_true",
                    help="stop after generating (with --data: gather data over several runs, then train "
                         "with --gen-share 0)")
    ap.add_argument("--blocks", type=int, default=1, help="eagle: residual blocks per recurrent step")
    ap.add_argument("--reg-weight", type=float, default=0.5,
                    help="eagle: weight of the state-to-target-hidden regression beside the cross-entropy")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--eval-requests", type=int, default=8,
                    help="first dev requests, kept out of training, on which tau is measured (0 skips)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data-dir", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpilot drafter train", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))



def add_commands(subparsers) -> None:
    d = subparsers.add_parser("drafter", help="drafter tools")
    dsub = d.add_subparsers(dest="drafter_command", required=True)
    t = dsub.add_parser("train", help="train a drafter for the deployment's target (self-distillation on it)")
    add_arguments(t)
    t.set_defaults(func=run)


def _weights_path(args: argparse.Namespace, dep: Deployment) -> Path | None:
    """Where the weights go: --out, else the deployment's drafter file (when it is this kind's), else the
    shipped file (SmolLM2) or the one beside a checkpoint: where the engine looks for it. Unless
    --generate-only, checked writable before any work: a budget spent for nothing otherwise."""
    from specpilot.engine.checkpoint import drafter_file

    own = dep.extra_options.get("drafter_weights") if dep.drafter == args.kind else None
    out_path = args.out or own or KINDS[args.kind].get(dep.target) or drafter_file(dep.target, args.kind)
    out_path = Path(out_path) if out_path else None
    if args.generate_only:
        return out_path
    if out_path is None:
        raise UserError(f"no default weights path for target {dep.target!r}: pass --out")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the drafter to {out_path} ({exc.strerror}): pass --out FILE and set "
                        "[options] drafter_weights = FILE in the deployment") from None
    if not os.access(out_path.parent, os.W_OK):
        raise UserError(f"cannot write the drafter to {out_path.parent} (not writable): pass --out FILE and set "
                        "[options] drafter_weights = FILE in the deployment")
    return out_path


def run(args: argparse.Namespace) -> int:
    from specpilot.engine.weights import load_model

    t_start = time.perf_counter()
    budget = 60.0 * args.minutes
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)  # the prompts' choices, then the batch order: one generator, in that order
    dep = load_deployment(args.deployment)
    out_path = _weights_path(args, dep)
    is_eagle = args.kind == "eagle"
    settings = TrainSettings(k=args.k or (6 if is_eagle else 4), draft_vocab=args.draft_vocab, width=args.width,
                             lr=args.lr, train_batch=args.train_batch, seed=args.seed, weight_decay=args.weight_decay,
                             n_context=args.n_context, lookup=args.lookup, lookup_periodic=args.lookup_periodic,
                             copy_min_match=args.copy_min_match, blocks=args.blocks, reg_weight=args.reg_weight)
    device = torch.device(args.device)
    model, tok = load_model(dep.target, dtype="fp32", device=device, data_dir=args.data_dir)
    cfg = model.cfg

    # The eagle drafter never sees a request of the deployment, dev or sealed: standard library only.
    max_prompt_tokens = min(args.max_prompt_tokens, cfg.max_seq_len - args.new_tokens - 1)
    if max_prompt_tokens < 8:
        raise UserError(f"--new-tokens {args.new_tokens} leaves no room for a prompt in the target's context of "
                        f"{cfg.max_seq_len} tokens: lower it")
    prompts = collect_prompts(dep, tok, rng, max_prompt_tokens, args.prompts, skip_dev=args.eval_requests,
                              include_dev=args.dev_prompts and not is_eagle, prose=is_eagle,
                              docstrings=0 if is_eagle else args.docstrings,
                              variants=args.docstring_variants, general_chat=0 if is_eagle else args.general_chat)
    log(f"{len(prompts)} prompts; generating for up to {args.gen_share * budget:.0f} s")
    gen = generate_data(model, prompts, rng, args.batch, args.new_tokens, t_start + args.gen_share * budget,
                        keep_prompt=is_eagle, half=not is_eagle, data=args.data,
                        tf32=args.tf32 and device.type == "cuda")
    if args.generate_only:
        log(f"generated {gen.generated} tokens in {gen.seconds:.0f} s; {len(gen.batches)} batches in {args.data}")
        print(json.dumps({"data": str(args.data), "batches": len(gen.batches), "prompts": len(gen.prompts),
                          "tokens": gen.tokens, "generated_tokens": gen.generated,
                          "generation_seconds": round(gen.seconds, 1)}, separators=(",", ":")))
        return 0
    data_hash = data_sha256(gen.prompts, gen.batches)

    # Hold out whole batches (sequences), so held-out examples share no sequence with training ones.
    n_val = max(1, len(gen.batches) // 20)
    eval_reserve = 60.0 if args.eval_requests else 5.0
    trainer = train_eagle_drafter if is_eagle else train_parallel_drafter
    net, fit_figs, data_figs = trainer(model, gen.batches[n_val:], gen.batches[:n_val], settings,
                                       t_start + budget - eval_reserve)

    meta = {
        "training_data_sha256": data_hash,
        "command": " ".join(sys.argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "trained_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "figures": {
            "prompts": len(gen.prompts), "generated_tokens": gen.tokens,
            "generation_seconds": round(gen.seconds, 1), **data_figs, **fit_figs,
        },
    }
    save_drafter(out_path, net, meta)
    if args.eval_requests:
        meta["figures"]["measured_tau"] = measured_tau(model, tok, dep, out_path, args.eval_requests, kind=args.kind)
        save_drafter(out_path, net, meta)
    meta["figures"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    save_drafter(out_path, net, meta)
    log(f"wrote {out_path} ({out_path.stat().st_size / 1e6:.1f} MB)")
    print(json.dumps({"drafter": str(out_path), "target": cfg.name, **meta["figures"],
                      "training_data_sha256": data_hash}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
