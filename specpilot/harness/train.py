"""`specpilot drafter train`: train a drafter by self-distillation, on the CPU, in minutes.

``--kind parallel`` (default) trains `specpilot_engine.drafters.parallel`, ``--kind eagle`` the recurrent
`specpilot_engine.drafters.eagle`. Both share steps 1-3 and 5 and the optimisation loop (`fit`).

1. Prompts from text on the machine: code from Python's standard library (the lines before a
   ``def``), HumanEval-shaped prompts (a standard-library function's ``def`` line and docstring,
   parallel drafter) and chat prompts made from standard-library docstrings and functions. With
   ``--dev-prompts`` the parallel drafter also uses the deployment's *dev* requests (never the
   sealed ones); by default no request of the deployment is used. All choices are seeded.
2. Self-distillation data: the target greedily continues every prompt (batched, left-padded,
   lockstep), recording the hidden state behind each token. Training on the target's *own*
   outputs is what makes drafts match its argmax. Parallel: each generated position t gives
   (hidden state that chose x_{t+1}, last tokens, the target's next K tokens). Eagle: the rows are
   kept as sequences, and the prompt positions count too wherever the prompt text happens to be
   the target's greedy continuation (see `eagle_streams`). With ``--data DIR`` every generated
   batch is also kept there, and a later run with the same prompts reuses them and generates only
   the rest (``--generate-only`` gathers data over several runs, e.g. several calls on a GPU).
3. Draft vocabulary: the most frequent tokens of that data.
4. Training: AdamW, cross-entropy per drafted position (earlier positions weigh more), until the
   time budget; 5% of the sequences are held out. Eagle unrolls its recurrent step K times on the
   target's greedy tokens from its own state, plus a regression of that state onto the target's
   hidden states.
5. Figures: held-out accuracy per position, the chain tau they imply, and tau measured by the
   engine (chain, block 4) on a few dev requests. They are saved in the weights file with the
   SHA-256 of the training data and the command line.

Generation and training share one time budget (``--minutes``). Both run on ``--device`` (the CPU by
default); the eagle drafter always trains on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.errors import UserError, non_negative_int, positive_float, positive_int
from specpilot.harness.deployment import DEFAULT_DEPLOYMENT
from specpilot_engine.drafters import eagle
from specpilot_engine.drafters.ngram import SuffixIndex
from specpilot_engine.drafters.parallel import (
    DEFAULT_WEIGHTS,
    ParallelConfig,
    ParallelDrafterNet,
    copy_span,
    padded_lookup,
    save_drafter,
)

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
                    help="parallel: the copy path over the context's earlier occurrences (specpilot_engine.drafters.parallel)")
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
                         "leads the target writes on HumanEval (train.docstring_variants)")
    ap.add_argument("--general-chat", type=non_negative_int, default=0,
                    help="parallel: up to this many everyday chat prompts (explanations, advice, short writing; "
                         "train.general_chat_prompts), none near a shipped request")
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


def _log(msg: str) -> None:
    print(f"[drafter train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# 1. Prompts


def _stdlib_files(rng: random.Random) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    rng.shuffle(files)
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _is_def(line: str) -> bool:
    """A one-line ``def`` header (a method's too)."""
    return line.lstrip().startswith("def ") and line.rstrip().endswith(":")


def stdlib_code_prompts(rng: random.Random, n: int) -> list[str]:
    """The ~24 lines up to and including a ``def`` line (and its docstring's first line).

    Three ``def``s a file first; when that gives fewer than ``n``, a second pass takes the files'
    other ``def``s (so a small ``n`` picks the same prompts as before the second pass existed)."""
    out, rest = [], []

    def prompt(lines: list[str], i: int) -> str:
        end = i + 2 if i + 1 < len(lines) and '"""' in lines[i + 1] else i + 1
        return "\n".join(lines[max(0, i - 24): end]) + "\n"

    for f in _stdlib_files(rng):
        if (text := _read(f)) is None:
            continue
        lines = text.splitlines()
        defs = [i for i, line in enumerate(lines) if _is_def(line)]
        chosen = rng.sample(defs, min(3, len(defs)))
        out += [prompt(lines, i) for i in chosen]
        rest += [(lines, i) for i in sorted(set(defs) - set(chosen))]
        if len(out) >= n:
            break
    if len(out) < n:
        out += [prompt(lines, i) for lines, i in rng.sample(rest, min(len(rest), n - len(out)))]
    return out[:n]


def stdlib_docstring_prompts(rng: random.Random, n: int) -> list[str]:
    """HumanEval-shaped prompts: a module's imports, then one function's ``def`` line and its
    whole docstring, ending where the body starts (the target writes the body, or restates the
    function, as it does on HumanEval)."""
    found = []
    for f in _stdlib_files(rng):
        if (text := _read(f)) is None:
            continue
        lines = text.splitlines()
        imports = [ln for ln in lines[:80] if ln.startswith(("import ", "from ")) and "(" not in ln][:4]
        for i, line in enumerate(lines[:-1]):
            if not _is_def(line):
                continue
            body = lines[i + 1].strip()
            if not body.startswith(('"""', "r\"\"\"")):
                continue
            end = next((j for j in range(i + 1, min(len(lines), i + 40))
                        if lines[j].rstrip().endswith('"""') and (j > i + 1 or body.count('"""') >= 2)), None)
            if end is None:
                continue
            indent = len(line) - len(line.lstrip())
            func = "\n".join(ln[indent:] for ln in lines[i: end + 1])
            found.append(("\n".join(imports) + "\n\n\n" if imports else "") + func + "\n")
    return rng.sample(found, min(n, len(found)))


_LITERALS = {
    "str": ["'abc'", "'hello world'", "''", "'a b c'", "'Hello'", "'12345'", "'xyz'", "'(()())'", "'aaa'", "'test.txt'"],
    "int": ["0", "1", "2", "3", "5", "10", "-1", "42", "100", "7"],
    "list": ["[]", "[1, 2, 3]", "[1.0, 2.0, 3.0]", "['a', 'b']", "[3, 1, 2]", "[1, 2, 2, 3, 4]", "[-1, 0, 1]", "[5]"],
    "other": ["True", "False", "None", "(1, 2)", "{'a': 1}", "2.5"],
}
_STR_NAMES = ("name", "text", "string", "str", "path", "prefix", "suffix", "msg", "line", "word", "char", "s", "key",
              "sep", "url", "file", "filename", "pattern", "source", "data", "fmt", "format", "value")
_INT_NAMES = ("n", "i", "j", "k", "count", "size", "num", "number", "index", "level", "width", "length", "depth",
              "start", "stop", "end", "pos", "offset", "x", "y", "base", "limit")


def _top_level_split(params: str) -> list[str]:
    """``params`` split at the commas outside brackets and quotes."""
    out, depth, cur, quote = [], 0, "", None
    for c in params:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += c
    return [p.strip() for p in [*out, cur] if p.strip()]


def _example_literal(param: str, rng: random.Random) -> str:
    """A plausible literal for a parameter, guessed from its name (it need not be right: only the
    prompt's shape matters)."""
    name = param.split(":")[0].split("=")[0].strip().lower()
    if name in _STR_NAMES or name.endswith(("name", "str", "text")):
        kind = "str"
    elif name in _INT_NAMES or name.startswith(("n_", "num")):
        kind = "int"
    elif name.endswith("s") or name in ("seq", "items", "iterable", "lst", "arr"):
        kind = "list"
    else:
        kind = rng.choice(sorted(_LITERALS))
    return rng.choice(_LITERALS[kind])


def with_doctest_examples(prompt: str, rng: random.Random) -> str | None:
    """A `stdlib_docstring_prompts` prompt made more HumanEval-shaped: a method's ``self`` dropped and
    1-3 made-up ``>>> f(args)`` / result lines closing its docstring (None if its ``def`` line does
    not parse). On HumanEval the target often answers such a prompt with a code fence and an
    explanation in English rather than a body; plain standard-library docstrings rarely show it that."""
    lines = prompt.rstrip("\n").split("\n")
    at = next((i for i, ln in enumerate(lines) if _is_def(ln) and not ln.startswith(" ")), None)
    if at is None or not lines[-1].rstrip().endswith('"""') or "(" not in lines[at]:
        return None
    head, _, rest = lines[at].partition("(")
    params_text, close, ret = rest.rpartition(")")
    if not close:
        return None
    params = _top_level_split(params_text)
    if params and params[0] in ("self", "cls"):
        params = params[1:]
    lines[at] = f"{head}({', '.join(params)}){ret}"
    name = head.removeprefix("def ").strip()
    positional = [p for p in params if "=" not in p and not p.startswith("*") and p != "/"]
    examples = []
    for _ in range(rng.randint(1, 3)):
        args = ", ".join(_example_literal(p, rng) for p in positional)
        examples += [f"    >>> {name}({args})", f"    {_example_literal('', rng)}"]
    last = lines[-1].rstrip()
    # Closing quotes alone end the docstring; otherwise they end its text (a one-liner included).
    lines = lines[:-1] if last.strip() == '"""' else [*lines[:-1], last[:-3].rstrip()]
    lines += [*examples, '    """']
    return "\n".join(lines) + "\n"


# How the target starts its answer to about half of the HumanEval prompts (a code fence and an
# explanation, or a test): prompts ending with one make it write the rest as it would there.
_HUMANEVAL_LEADS = ("```\n\n", "\n# Test the function\n", "\n# Example usage:\n")


def docstring_variants(prompt: str, rng: random.Random) -> list[str]:
    """``prompt`` and its HumanEval-shaped variants: with made-up examples (`with_doctest_examples`),
    and those followed by the fence lead or by one of the test leads (`_HUMANEVAL_LEADS`)."""
    if (shaped := with_doctest_examples(prompt, rng)) is None:
        return [prompt]
    return [prompt, shaped, shaped + _HUMANEVAL_LEADS[0], shaped + rng.choice(_HUMANEVAL_LEADS[1:])]


_CHAT_TEMPLATES = [
    "What is the Python module {m} used for? Here is its description: {d}",
    "Explain in simple terms: {d}",
    "Write a short Python example that uses the {m} module.",
    "Summarize this in one or two sentences: {d}",
    "I am learning Python. When should I use the {m} module, and what are its main functions?",
    "Write a function that uses the {m} module and explain how it works.",
    "Explain what this Python function does:\n{f}",
    "Write a docstring and two usage examples for this function:\n{f}",
    "Rewrite this function to be easier to read:\n{f}",
]


def stdlib_chat_prompts(rng: random.Random, n: int) -> list[str]:
    """Questions about standard-library modules and functions, from their docstrings and code
    (one a file; more passes over the files, with other functions and templates, until ``n``)."""
    out = []
    files = _stdlib_files(rng)
    for f in (f for _ in range(max(1, math.ceil(n / max(1, len(files))) + 1)) for f in files):
        if (text := _read(f)) is None:
            continue
        s = text.lstrip()
        doc = ""
        for q in ('"""', "'''"):
            if s.startswith(q) and (end := s.find(q, 3)) > 3:
                doc = s[3:end].strip().split("\n\n")[0].replace("\n", " ")
        lines = text.splitlines()
        defs = [i for i, line in enumerate(lines) if line.startswith("def ") and line.rstrip().endswith(":")]
        func = ""
        if defs:
            i = rng.choice(defs)
            body = [lines[i]] + [ln for ln in lines[i + 1: i + 16] if ln.startswith((" ", "\t")) or not ln.strip()]
            func = "\n".join(body).rstrip()
        choices = [t for t in _CHAT_TEMPLATES if ("{d}" not in t or 20 < len(doc) < 400) and ("{f}" not in t or func)]
        if choices:
            out.append(rng.choice(choices).format(m=f.stem, d=doc, f=func))
        if len(out) >= n:
            break
    return out[:n]


_PROSE_TEMPLATES = [
    "Summarize this paragraph in two sentences:\n{p}",
    "Explain this to a beginner:\n{p}",
    "Rewrite this paragraph in plain English:\n{p}",
    "Translate to French: {s}",
    "What are the key points of this text?\n{p}",
    "Write a short paragraph about {t} in Python.",
    "Give three tips about {t}.",
]


def stdlib_prose_prompts(rng: random.Random, n: int) -> list[str]:
    """Chat prompts over English prose: paragraphs of the Python reference shipped with the
    standard library (`pydoc_data.topics`), so the drafter also sees the target writing prose."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = " ".join(para.split())
            if 120 < len(para) < 700 and not para.startswith(("*", "|", ">>>")):
                paragraphs.append((name, para))
    rng.shuffle(paragraphs)
    out = []
    for name, para in paragraphs[:n]:
        sentence = para.split(". ")[0].rstrip(".") + "."
        out.append(rng.choice(_PROSE_TEMPLATES).format(p=para, s=sentence, t=name.replace("-", " ")))
    return out


# Everyday chat (issues 30/31: the shipped drafter was trained on code and standard-library questions only,
# and chat requests accepted ~1.5 tokens a step): templates over topic lists written here, so the target
# shows the drafter how it answers questions, advice and small writing tasks, about animals, places, food,
# jobs and pastimes as well. The lists are raw material:
# `general_chat_prompts` drops whatever comes near a shipped request (small coding tasks all did, against
# HumanEval, so there are none).
_SCIENCE = ("gravity", "evolution", "the immune system", "black holes", "climate change", "plate tectonics", "DNA",
            "electricity", "magnetism", "the greenhouse effect", "vaccines", "the seasons", "tides", "rainbows",
            "volcanoes", "earthquakes", "the moon's phases", "nuclear fusion", "antibiotics", "the human heart",
            "cell division", "sound waves", "light", "friction", "erosion", "the carbon cycle", "clouds",
            "metabolism", "photosynthesis in algae", "ocean currents", "the speed of light", "atoms", "coral reefs",
            "hurricanes", "glaciers", "bird migration", "the Northern Lights", "fermentation", "comets", "fossils",
            "lightning", "magnets in motors", "bacteria in soil", "the ozone layer", "jellyfish", "honeybees",
            "desert plants", "frogs", "deep sea creatures", "the solar wind", "crystals", "dinosaurs")
_TECH = ("a database index", "a REST API", "cloud computing", "encryption", "a compiler", "an operating system",
         "a linked list", "a binary search tree", "caching", "DNS", "TCP and UDP", "a virtual machine", "Docker",
         "unit testing", "version control", "a load balancer", "public-key cryptography", "a neural network",
         "garbage collection", "multithreading", "a queue", "HTTPS", "regular expressions", "an interpreter",
         "JSON", "a hash function", "a CPU cache", "open-source software", "a web browser", "SQL joins", "Wi-Fi",
         "Bluetooth", "a firewall", "phishing", "spam filters", "GPS", "touchscreens", "QR codes", "barcodes",
         "e-ink displays", "blockchain", "two-factor authentication", "a modem", "fiber optics", "3D printing")
_SOCIETY = ("inflation", "interest rates", "supply and demand", "democracy", "the stock market", "taxes",
            "unemployment", "globalization", "the Industrial Revolution", "the Roman Empire", "the Renaissance",
            "the printing press", "the French Revolution", "the Cold War", "the Silk Road", "recycling",
            "urbanization", "renewable energy", "a budget deficit", "compound interest", "minimum wage", "the Vikings",
            "ancient Egypt", "the Olympic Games", "the Magna Carta", "feudalism", "the Aztecs", "the Great Wall",
            "the Ottoman Empire", "the moon landing", "insurance", "mortgages", "trade unions", "tourism")
_ADVICE = ("saving money on groceries", "learning a new language", "running a first marathon",
           "preparing for a job interview", "keeping a houseplant alive", "sleeping better", "reducing stress",
           "staying motivated to exercise", "studying for exams", "starting a vegetable garden",
           "making friends in a new city", "writing a resume", "public speaking", "cooking on a budget",
           "training a puppy", "organizing a small closet", "learning to play the guitar", "eating more vegetables",
           "managing time at work", "traveling with kids", "buying a laptop", "negotiating a salary",
           "reading more books", "keeping a journal", "planning a birthday party", "moving to a new apartment",
           "knitting", "beekeeping", "birdwatching", "composting kitchen scraps", "woodworking", "origami",
           "sailing", "baking sourdough", "rock climbing", "camping in winter", "painting with watercolors",
           "choosing hiking boots", "caring for a cat", "brewing tea", "fixing a flat bicycle tyre", "chess")
_WRITING = ("a postcard from a seaside holiday", "a toast for my sister's graduation", "a eulogy for a beloved dog",
            "an advert for a bakery", "an obituary for a famous violinist", "a welcome speech for a chess club",
            "a recipe card for pancakes", "a motivational quote for gardeners")
_POEMS = ("the ocean", "autumn leaves", "a city at night", "a cup of coffee", "an old dog", "the first day of spring",
          "a long train journey", "the stars", "a rainy afternoon", "friendship", "a lighthouse", "the desert",
          "an owl", "the harbour", "fog", "a garden in June", "mountains", "a violin")
_ANIMALS = ("elephants", "octopuses", "penguins", "wolves", "dolphins", "owls", "ants", "bats", "camels", "koalas",
            "sharks", "parrots", "beavers", "tortoises", "squirrels", "whales", "hedgehogs", "flamingos", "salmon",
            "spiders", "horses", "cheetahs", "gorillas", "snails")
_PLACES = ("Iceland", "Japan", "Peru", "Morocco", "Norway", "Kenya", "Portugal", "Vietnam", "Canada", "Mexico", "Egypt",
           "Scotland", "New Zealand", "Chile", "Greece", "Mongolia", "Venice", "Istanbul", "Kyoto", "Lisbon",
           "the Amazon rainforest", "the Sahara", "Antarctica", "the Alps")
_FOODS = ("risotto", "pancakes", "lentil soup", "dumplings", "guacamole", "paella", "omelettes", "hummus",
          "ratatouille", "curry", "granola", "pizza dough", "tacos", "miso soup", "couscous", "lasagna", "porridge",
          "stir-fried noodles")
_JOBS = ("a nurse", "an architect", "a pilot", "a librarian", "a firefighter", "a chef", "a carpenter", "a pharmacist",
         "a journalist", "a lawyer", "an electrician", "a veterinarian", "a dentist", "a plumber", "a baker",
         "a mechanic")
_SPORTS = ("cricket", "rugby", "tennis", "badminton", "volleyball", "golf", "ice hockey", "curling", "fencing",
           "rowing", "baseball", "archery", "handball", "snooker", "pottery", "calligraphy", "juggling",
           "embroidery", "stargazing", "kayaking")
_GENERAL_CHAT_TEMPLATES = [
    ("Explain {s} in simple terms.", _SCIENCE), ("How does {s} work?", _SCIENCE),
    ("Explain {s} to a ten-year-old.", _SCIENCE), ("What is {s}? Answer in a short paragraph.", _SCIENCE),
    ("What is {s}, and why does it matter?", _TECH), ("Explain {s} with an everyday analogy.", _TECH),
    ("What are the pros and cons of {s}?", _TECH), ("Explain {s} to a beginner programmer.", _TECH),
    ("What is {s}? Give a short explanation and an example.", _SOCIETY),
    ("What were the main effects of {s}?", _SOCIETY), ("Explain {s} in a few sentences.", _SOCIETY),
    ("Give me three tips for {s}.", _ADVICE), ("What is the best way to get started with {s}?", _ADVICE),
    ("List five common mistakes in {s} and how to avoid them.", _ADVICE),
    ("I need advice on {s}. Where should I begin?", _ADVICE),
    ("Write {s}.", _WRITING), ("Write {s}. Keep it short and friendly.", _WRITING),
    ("Write a short poem about {s}.", _POEMS), ("Write a haiku about {s}.", _POEMS),
    ("Tell me some interesting facts about {s}.", _ANIMALS), ("How do {s} survive in the wild?", _ANIMALS),
    ("What do {s} eat, and where do they live?", _ANIMALS),
    ("What is {s} known for?", _PLACES), ("I am planning a trip to {s}. What should I see?", _PLACES),
    ("Describe the climate and culture of {s}.", _PLACES),
    ("How do I make {s} at home?", _FOODS), ("What is the history of {s}?", _FOODS),
    ("Give me a simple recipe for {s}.", _FOODS),
    ("What does {s} do on a typical day?", _JOBS), ("How do I become {s}?", _JOBS),
    ("What skills does {s} need?", _JOBS),
    ("Explain the basics of {s}.", _SPORTS), ("How do I get better at {s}?", _SPORTS),
    ("What equipment do I need for {s}?", _SPORTS),
]


_LEADS = ("", "Quick question: ", "I'm a student. ", "Hi! ", "Please help. ")
_ASKS = ("", " Keep it brief.", " Use bullet points.", " Answer in two or three sentences.", " Be specific.",
         " Give an example.")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def _word_grams(text: str, n: int = 4) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i: i + n]) for i in range(len(w) - n + 1)}


_FUNCTION_WORDS = frozenset(
    "about above after again also among before below between both does down during each even ever every from have "
    "into just like many more most much must only other over same should some such than that their them then there "
    "these they this those through under until upon very well were what when where which while whom whose will "
    "with within without would your".split())


def _topic_stems(text: str) -> set[str]:
    """The first five letters of ``text``'s words of four letters or more that can name a subject (not
    `_FUNCTION_WORDS`), so that plurals and verb forms meet (duplicate/duplicates, vowel/vowels)."""
    return {w[:5] for w in _words(text) if len(w) >= 4 and w not in _FUNCTION_WORDS}


def general_chat_prompts(rng: random.Random, n: int, shipped: Sequence[str] = ()) -> list[str]:
    """Up to ``n`` distinct everyday chat prompts (explanations, advice, short writing):
    `_GENERAL_CHAT_TEMPLATES` over the topic lists above, each with a lead and a closing ask, sampled
    (seeded).

    Decontaminated against ``shipped`` (every request text a deployment can be measured on, either split):
    a prompt is dropped when it shares a run of four words with one of them (a template's phrasing), or
    when its topic shares a word stem with one of them (the same subject asked another way: its answer
    would be nearly the request's, and a drafter that saw it would be measured on what it memorised).
    The shipped requests' most common stems (in a quarter of them, and two at least: "that", "function",
    "list") name no subject and do not count."""
    texts = [(lead + t.format(s=s) + ask, s) for t, pool in _GENERAL_CHAT_TEMPLATES for s in pool
             for lead in _LEADS for ask in _ASKS]
    if shipped:
        grams = set().union(*(_word_grams(x) for x in shipped))
        per_text = [_topic_stems(x) for x in shipped]
        common = {s for s, c in Counter(s for st in per_text for s in st).items() if c >= max(2, len(shipped) / 4)}
        stems = set().union(*per_text) - common
        texts = [(x, s) for x, s in texts if not (_word_grams(x) & grams) and not ((_topic_stems(s) - common) & stems)]
    return rng.sample([x for x, _ in texts], min(n, len(texts)))


def collect_prompts(dep, tokenizer, rng: random.Random, max_tokens: int, n_each: int,
                    skip_dev: int = 0, include_dev: bool = True, prose: bool = False,
                    docstrings: int = 0, variants: bool = False, general_chat: int = 0) -> list[list[int]]:
    """Training prompts. The first ``skip_dev`` dev requests are left out: tau is measured on them.
    With ``include_dev`` False no request of the deployment is used at all (standard library only);
    ``prose`` adds `stdlib_prose_prompts`, ``docstrings`` that many `stdlib_docstring_prompts` (each
    with its `docstring_variants` when ``variants``), ``general_chat`` up to that many `general_chat_prompts`
    (none near any shipped request, of either split)."""
    from specpilot.harness.requests import REQUEST_SETS, encode_requests, load_requests

    prompts = []
    if include_dev:
        dev = load_requests(dep, "dev")[skip_dev:]  # never the sealed split: it is the final, unseen evaluation
        prompts = encode_requests(dev, tokenizer)
    prompts += [tokenizer.encode(t) for t in stdlib_code_prompts(rng, n_each)]
    prompts += [tokenizer.encode(tokenizer.chat_prompt(t)) for t in stdlib_chat_prompts(rng, n_each)]
    if docstrings:
        texts = stdlib_docstring_prompts(rng, docstrings)
        if variants:
            texts = [v for t in texts for v in docstring_variants(t, rng)]
        prompts += [tokenizer.encode(t) for t in texts]
    if prose:
        prompts += [tokenizer.encode(tokenizer.chat_prompt(t)) for t in stdlib_prose_prompts(rng, n_each)]
    if general_chat:
        shipped = [r.text for load in REQUEST_SETS.values() for r in load()]  # every shipped request, either split
        prompts += [tokenizer.encode(tokenizer.chat_prompt(t)) for t in general_chat_prompts(rng, general_chat, shipped)]
    prompts = [p[-max_tokens:] for p in prompts if p]
    rng.shuffle(prompts)
    return prompts


# ---------------------------------------------------------------------------------------------
# 2. Self-distillation data


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], new_tokens: int, stop_ids, keep_prompt: bool = False) -> dict:
    """Greedy continuations of left-padded prompts in lockstep, with the hidden state behind each token.

    Returns tokens [B, G], hidden [B, G, d] (hidden[:, g] chose tokens[:, g]), alive [B, G] (False
    after a stop token), the prompts and their last 8 tokens for context. With ``keep_prompt`` also the
    prefill's view of the prompts: prompt_tokens [B, P] (left-padded), prompt_keys [B, P] (False on
    padding), prompt_hidden [B, P, d] and prompt_argmax [B, P] (the target's greedy next token
    after each prompt position).
    """
    B, P, G = len(prompts), max(map(len, prompts)), new_tokens
    dev = model.device
    toks = torch.zeros(B, P, dtype=torch.long, device=dev)
    keys = torch.zeros(B, P + G, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        toks[i, P - len(p):] = torch.tensor(p)
        keys[i, P - len(p): P] = True
    pos = (keys[:, :P].cumsum(1) - 1).clamp(min=0)
    cache = model.new_cache(P + G, batch=B)
    # Padding queries attend to themselves only, so they stay finite (NaNs would leak through 0-weights).
    mask = torch.ones(P, P, dtype=torch.bool, device=dev).tril()[None, None] & keys[:, None, None, :P]
    mask |= torch.eye(P, dtype=torch.bool, device=dev)[None, None]
    logits, hidden = model(toks, pos, cache, 0, mask, last_only=True)
    nxt, h = logits[:, -1].argmax(-1), hidden[:, -1]
    prompt_view = {}
    if keep_prompt:  # one row at a time: B x P x vocab logits would not fit in memory
        prompt_view = {"prompt_tokens": toks.cpu(), "prompt_keys": keys[:, :P].cpu(), "prompt_hidden": hidden.float().cpu(),
                       "prompt_argmax": torch.stack([model.lm_head(row).argmax(-1) for row in hidden]).cpu()}
    cur = pos[:, -1:] + 1
    stops = torch.tensor(list(stop_ids) or [-1], device=dev)
    out_t, out_h, alive = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for g in range(G):
        out_t.append(nxt)
        out_h.append(h.float())
        alive.append(~done)
        done = done | torch.isin(nxt, stops)
        if g == G - 1:
            break
        keys[:, P + g] = True
        logits, hidden = model(nxt[:, None], cur, cache, P + g, keys[:, None, None, : P + g + 1])
        nxt, h = logits[:, 0].argmax(-1), hidden[:, 0]
        cur = cur + 1
    return {"tokens": torch.stack(out_t, 1).cpu(), "hidden": torch.stack(out_h, 1).cpu(),
            "alive": torch.stack(alive, 1).cpu(), "prompt_tail": [p[-8:] for p in prompts],
            "prompts": [list(p) for p in prompts], **prompt_view}


def lookup_features(prompt: list[int], tokens: list[int], k: int, index: SuffixIndex) -> tuple[list, list]:
    """(look [G][k], match [G]) at every generated root: what the parallel drafter's copy path is
    given there (`SuffixIndex.lookup` of prompt + tokens[:g+1], `padded_lookup`), computed by the
    same class and padding the drafter uses when it runs."""
    index.reset()
    index.extend(prompt)
    look, match = [], []
    for token in tokens:  # lookup(prompt + tokens[:g+1]) without re-checking the prefix each time
        index.extend((token,))
        found, m = index.query(k)
        look.append(padded_lookup(found, k))
        match.append(m)
    return look, match


def make_examples(batches: list[dict], n_context: int, k: int, index: SuffixIndex | None = None) -> dict:
    """Flatten generated batches into (hidden, context tokens, next-K targets) examples.

    Position g of a row: hidden[g] chose the root tokens[g]; the context is the n_context tokens
    ending at the root; the targets are tokens[g+1 .. g+k] (-1 past the generation or a stop).
    With ``index`` also the copy path's features: look [N, k] and match [N] (`lookup_features`).
    """
    H, C, T, LK, MT = [], [], [], [], []
    for b in batches:
        toks, hid, alive = b["tokens"], b["hidden"], b["alive"]
        B, G = toks.shape
        tails = torch.tensor([([t[0]] * n_context + t)[-(n_context - 1):] if n_context > 1 else [] for t in b["prompt_tail"]],
                             dtype=torch.long).view(B, n_context - 1)
        seq = torch.cat([tails, toks], dim=1)  # [B, n_context - 1 + G]
        ctx = seq.unfold(1, n_context, 1)  # [B, G, n_context]: window g ends at tokens[g]
        padded = torch.cat([toks.masked_fill(~alive, -1), torch.full((B, k), -1, dtype=torch.long)], dim=1)
        tgt = padded.unfold(1, k, 1)[:, 1: G + 1]  # [B, G, k]: tokens[g+1 .. g+k]
        H.append(hid[alive])
        C.append(ctx[alive])
        T.append(tgt[alive])
        if index is not None:  # alive is a prefix of each row, so row i's examples are its first n
            for i, n in enumerate(alive.sum(1).tolist()):
                look, match = lookup_features(b["prompts"][i], toks[i, :n].tolist(), k, index)
                LK.append(torch.tensor(look, dtype=torch.long).view(n, k))
                MT.append(torch.tensor(match, dtype=torch.long))
    out = {"hidden": torch.cat(H), "ctx": torch.cat(C), "targets": torch.cat(T)}
    if index is not None:
        out["look"], out["match"] = torch.cat(LK), torch.cat(MT)
    return out


# ---------------------------------------------------------------------------------------------
# 3-4. Vocabulary and training


def draft_vocabulary(targets: torch.Tensor, ctx: torch.Tensor, size: int) -> torch.Tensor:
    counts = Counter(targets[targets >= 0].tolist())
    counts.update(ctx[:, -1].tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


def fill_vocabulary(vocab_ids: torch.Tensor, size: int) -> torch.Tensor:
    """``vocab_ids`` topped up to ``size`` with the lowest token ids not in it (BPE ids grow with merge
    order, so low ids are common tokens): requests use tokens the training data never showed."""
    have = set(vocab_ids.tolist())
    extra = [t for t in range(size + len(have)) if t not in have][: max(0, size - len(have))]
    return torch.tensor(sorted(have | set(extra)))


def to_draft_ids(targets: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target token ids -> draft-vocabulary indices; unknown or missing -> -100 (ignored)."""
    lookup = torch.full((vocab_size,), -100, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    out = torch.full_like(targets, -100)
    ok = targets >= 0
    out[ok] = lookup[targets[ok]]
    return out


def _net_inputs(data: dict, idx) -> tuple:
    """The net's inputs for examples ``idx`` (a slice or an index tensor) of `make_examples` data
    (hidden states may be kept in half precision: they are cast back here)."""
    hidden = data["hidden"][idx].float()
    if "look" in data:
        return hidden, data["ctx"][idx], data["look"][idx], data["match"][idx]
    return hidden, data["ctx"][idx]


def evaluate(net, data: dict, batch: int = 1024) -> dict:
    """Held-out top-1 accuracy per position and the chain tau it implies (accepted prefix + 1)."""
    net.eval()
    correct, accepted, n = None, 0.0, 0
    with torch.no_grad():
        for s in range(0, len(data["hidden"]), batch):
            inputs = _net_inputs(data, slice(s, s + batch))
            logp, ids = net.candidates(net(*inputs), inputs[2] if len(inputs) > 2 else None)
            guess = ids.gather(-1, logp.argmax(-1, keepdim=True))[..., 0]
            if len(inputs) > 2:  # what the drafter proposes: long matches' spans whole
                guess = copy_span(guess, inputs[2], inputs[3], net.cfg.copy_min_match)
            targets = data["targets"][s: s + batch]
            hit = (guess == targets) & (targets >= 0)
            correct = hit.sum(0) if correct is None else correct + hit.sum(0)
            accepted += hit.int().cumprod(1).sum().item()
            n += len(hit)
    net.train()
    return {"acc_per_pos": [round(c / n, 4) for c in correct.tolist()], "tau_chain_est": round(1 + accepted / n, 3)}


def train(net, data: dict, val: dict, seconds: float, lr: float, batch: int, seed: int, weight_decay: float) -> dict:
    """Train the parallel drafter on `make_examples` data (with draft ids ``y``) until ``seconds``."""
    device = data["hidden"].device
    weights = torch.tensor([0.8**j for j in range(net.cfg.k)], device=device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        idx = idx.to(device)
        inputs = _net_inputs(data, idx)
        logits, y = net(*inputs), data["y"][idx]
        if not net.cfg.lookup:
            return sum(weights[j] * F.cross_entropy(logits[:, j], y[:, j], ignore_index=-100)
                       for j in range(net.cfg.k)) / weights.sum()
        # Copy path: the target token is right through its vocabulary entry or through the copy
        # column (when the lookup proposed it): the loss is -log of their summed probability.
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = data["targets"][idx]
        via_vocab = logp.gather(-1, y.clamp(min=0)[..., None])[..., 0].masked_fill(y < 0, -math.inf)
        via_copy = logp[..., -1].masked_fill((inputs[2] != targets) | (targets < 0), -math.inf)
        nll = -torch.logaddexp(via_vocab, via_copy)
        counted = torch.isfinite(nll)
        per_pos = nll.masked_fill(~counted, 0).sum(0) / counted.sum(0).clamp(min=1)
        return (weights * per_pos).sum() / weights.sum()

    # Large evaluation batches: with millions of examples the periodic held-out score would
    # otherwise take as long as the training between two scores.
    return fit(net, len(data["hidden"]), batch_loss, lambda: evaluate(net, val, batch=8192), seconds, lr, batch, seed,
               weight_decay)


def fit(net, n_examples: int, batch_loss, score, seconds: float, lr: float, batch: int, seed: int,
        weight_decay: float) -> dict:
    """AdamW with warm-up and cosine decay until ``seconds``; ends with the best held-out state.

    ``batch_loss(indices)`` is the loss of a batch of example indices; ``score()`` evaluates on
    held-out data and returns a dict with ``tau_chain_est`` (higher is better).
    """
    g = torch.Generator().manual_seed(seed)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    best = (-1.0, None, 0)  # (held-out tau estimate, state, step)
    t0, step, losses = time.perf_counter(), 0, []
    # Estimate steps from the first ones so the cosine schedule ends with the budget.
    total = None
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed > seconds:
            break
        if step == 20:
            total = max(40, int(seconds / (elapsed / 20)))
        frac = step / total if total else 0.0
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        loss = batch_loss(torch.randint(0, n_examples, (batch,), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 200 == 0:
            ev = score()
            if ev["tau_chain_est"] > best[0]:
                best = (ev["tau_chain_est"], {k: v.detach().clone() for k, v in net.state_dict().items()}, step)
            _log(f"step {step} loss {statistics_mean(losses[-200:]):.3f} {ev}")
    if best[1] is not None and score()["tau_chain_est"] < best[0]:
        net.load_state_dict(best[1])  # training ran past its best held-out point: keep the best
    return {"steps": step, "best_step": best[2], "final_loss": round(statistics_mean(losses[-100:]), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------
# 3-4 (eagle). Sequences, unrolled training


def eagle_streams(batches: list[dict], k: int, use_prompt: bool) -> dict:
    """Generated rows (and, with ``use_prompt``, the prompts before them) as flat sequences.

    Position i of a row holds a token ``s_i``, the target's hidden state ``H_i`` computed at the
    token before it, the target's greedy choice ``a_i = argmax(H_i)`` and ``ok_i`` (H_i is real:
    not padding, not past a stop). Generated tokens are greedy by construction (a_i == s_i); in a
    prompt, s_i is the text and may differ. ``greedy_i = ok_i and a_i == s_i``. Every row ends with
    k padding positions, so an unroll from any position stays inside the flat arrays.
    """
    S, H, A, OK = [], [], [], []
    for b in batches:
        parts = [(b["tokens"], b["hidden"], b["tokens"], b["alive"])]
        if use_prompt and "prompt_tokens" in b:
            # Prompt position p's hidden state predicts prompt token p+1 (the last one predicts tokens[:, 0]).
            parts.insert(0, (b["prompt_tokens"][:, 1:], b["prompt_hidden"][:, :-1], b["prompt_argmax"][:, :-1],
                             b["prompt_keys"][:, :-1]))
        B, d = b["tokens"].shape[0], b["hidden"].shape[-1]
        parts.append((torch.zeros(B, k, dtype=torch.long), torch.zeros(B, k, d), torch.zeros(B, k, dtype=torch.long),
                      torch.zeros(B, k, dtype=torch.bool)))
        for out, i in ((S, 0), (H, 1), (A, 2), (OK, 3)):
            out.append(torch.cat([part[i] for part in parts], dim=1).flatten(0, 1))
    s, a, ok = torch.cat(S), torch.cat(A), torch.cat(OK)
    greedy = ok & (a == s)
    return {"tokens": s, "hidden": torch.cat(H), "greedy_next": a, "ok": ok, "greedy": greedy,
            # Roots: the engine's root is always the target's greedy token.
            "roots": greedy.nonzero().squeeze(1)}


def eagle_batch(streams: dict, roots: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(hidden [B, d], input tokens [B, k], draft-id targets [B, k] (-100: ignored), target hidden [B, k, d]).

    Step j (1-based) is fed s_{i+j-1} and must predict a_{i+j}; it counts only where s_{i+1..i+j-1}
    were the target's greedy tokens (otherwise the chain never gets there) and H_{i+j} is real.
    """
    pos = roots[:, None] + torch.arange(k + 1)  # [B, k+1]: root .. root + k
    reachable = streams["greedy"][pos[:, 1:]].int().cumprod(1)  # reachable[:, j-1]: s_{i+1..i+j} greedy
    counts = torch.cat([torch.ones_like(reachable[:, :1]), reachable[:, :-1]], dim=1).bool() & streams["ok"][pos[:, 1:]]
    y = streams["y"][pos[:, 1:]].masked_fill(~counts, -100)
    return streams["hidden"][roots], streams["tokens"][pos[:, :-1]], y, streams["hidden"][pos[:, 1:]]


def evaluate_eagle(net, streams: dict, batch: int = 1024) -> dict:
    """Held-out top-1 accuracy per unrolled step (given a greedy prefix) and the implied chain tau."""
    net.eval()
    k, hits, counted, accepted = net.cfg.k, torch.zeros(net.cfg.k), torch.zeros(net.cfg.k), 0.0
    roots = streams["roots"]
    with torch.no_grad():
        for s in range(0, len(roots), batch):
            hidden, tokens, y, _ = eagle_batch(streams, roots[s: s + batch], k)
            _, logits = net.unroll(hidden, tokens)
            hit = (logits.argmax(-1) == y) & (y >= 0)
            hits += hit.sum(0).float()
            counted += (y >= 0).sum(0).float()
            accepted += hit.int().cumprod(1).sum().item()
    net.train()
    return {"acc_per_pos": [round(h / max(1.0, c), 4) for h, c in zip(hits.tolist(), counted.tolist(), strict=True)],
            "tau_chain_est": round(1 + accepted / max(1, len(roots)), 3)}


def train_eagle(net, data: dict, val: dict, seconds: float, lr: float, batch: int, seed: int, weight_decay: float,
                reg_weight: float) -> dict:
    """Unroll the recurrent step k times from the target's hidden state, fed the target's greedy tokens."""
    k = net.cfg.k
    weights = torch.tensor([0.8**j for j in range(k)])

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        hidden, tokens, y, target_hidden = eagle_batch(data, data["roots"][idx], k)
        states, logits = net.unroll(hidden, tokens)
        ce = torch.stack([F.cross_entropy(logits[:, j], y[:, j], ignore_index=-100) if (y[:, j] >= 0).any()
                          else logits.sum() * 0 for j in range(k)])
        counts = (y >= 0).float()
        reg = (F.smooth_l1_loss(states, target_hidden, reduction="none").mean(-1) * counts).sum(0) / counts.sum(0).clamp(min=1)
        return (weights * (ce + reg_weight * reg)).sum() / weights.sum()

    return fit(net, len(data["roots"]), batch_loss, lambda: evaluate_eagle(net, val), seconds, lr, batch, seed,
               weight_decay)


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


# ---------------------------------------------------------------------------------------------
# 5. Measured tau with the engine


def measured_tau(model, tokenizer, dep, weights: Path, n_requests: int, max_new: int = 64, kind: str = "parallel") -> dict:
    from specpilot.harness.requests import encode_requests, fit_context, load_requests
    from specpilot_engine.api import Engine
    from specpilot_engine.options import EngineOptions

    prompts = fit_context(encode_requests(load_requests(dep, "dev")[:n_requests], tokenizer), model.cfg.max_seq_len,
                          max_new)
    out = {}
    for name, opts in ((f"{kind}_chain4", EngineOptions(drafter=kind, drafter_weights=str(weights))),
                       ("ngram_chain4", EngineOptions(drafter="ngram"))):
        engine = Engine(model, tokenizer, opts.resolved(dtype="fp32"))
        committed = [c for p in prompts for c in engine.generate(p, max_new).accepted_per_step]
        out[name] = round(sum(committed) / max(1, len(committed)), 3)
    out["requests"], out["max_new_tokens"] = len(prompts), max_new
    return out


def save_shard(path: Path, batch: dict) -> None:
    """One generated batch as a `--data` file (hidden states in half precision), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: v.half() if k.endswith("hidden") else v for k, v in batch.items()}, tmp)
    tmp.replace(path)


def load_shard(path: Path, prompts: list[list[int]], new_tokens: int, half: bool) -> dict:
    """A `save_shard` file, checked to hold ``prompts`` continued by ``new_tokens`` tokens."""
    try:
        batch = torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"{path} is not a generated batch ({e}); delete it or use another --data directory") from e
    if batch.get("prompts") != prompts or batch["tokens"].shape[1] != new_tokens:
        raise UserError(f"{path} was generated from other prompts or lengths (another --seed, prompt flag, "
                         f"--batch or --new-tokens): use another --data directory")
    return batch if half else {k: v.float() if k.endswith("hidden") else v for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------


def _train_parallel(model, batches: list[dict], val_batches: list[dict], args, k: int, deadline: float):
    """(net, fit figures, data figures) of the parallel drafter trained until ``deadline`` (perf_counter)."""
    cfg, device = model.cfg, model.device
    index = SuffixIndex(periodic=args.lookup_periodic) if args.lookup else None
    t0 = time.perf_counter()
    train_data = make_examples(batches, args.n_context, k, index)
    val_data = make_examples(val_batches, args.n_context, k, index)
    _log(f"examples built in {time.perf_counter() - t0:.1f} s")
    vocab_ids = draft_vocabulary(train_data["targets"], train_data["ctx"], args.draft_vocab)
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["targets"], vocab_ids, cfg.vocab_size)
    coverage = (train_data["y"] >= 0).sum().item() / max(1, (train_data["targets"] >= 0).sum().item())
    for d in (train_data, val_data):
        for key in ("hidden", "ctx", "y", "targets", "look", "match"):
            if key in d:
                d[key] = d[key].to(device)
    _log(f"{len(train_data['hidden'])} train / {len(val_data['hidden'])} held-out examples; "
         f"draft vocab {len(vocab_ids)} covers {100 * coverage:.1f}% of targets")
    pcfg = ParallelConfig(target=cfg.name, dim=cfg.dim, width=args.width or cfg.dim, k=k,
                          n_context=args.n_context, draft_vocab=len(vocab_ids), lookup=args.lookup,
                          lookup_periodic=args.lookup_periodic,
                          copy_min_match=args.copy_min_match if args.lookup else 0)
    if index is not None:
        copyable = ((train_data["look"] == train_data["targets"]) & (train_data["targets"] >= 0)).float().mean(0)
        _log(f"the lookup proposes the target token at {[round(x, 3) for x in copyable.tolist()]} of positions")
    net = ParallelDrafterNet(pcfg, vocab_ids.to(device), model.embed.weight.detach()).to(device)
    # Building the examples came out of the same budget.
    fit_figs = train(net, train_data, val_data, max(10.0, deadline - time.perf_counter()), args.lr, args.train_batch, args.seed,
                     args.weight_decay)
    held_out = evaluate(net, val_data)
    _log(f"trained: {fit_figs}; held-out {held_out}")
    return net, {**fit_figs, "heldout": held_out}, {
        "train_examples": len(train_data["hidden"]), "heldout_examples": len(val_data["hidden"]),
        "draft_vocab_coverage": round(coverage, 4)}


def _train_eagle(model, batches: list[dict], val_batches: list[dict], args, k: int, deadline: float):
    """(net, fit figures, data figures) of the eagle drafter trained until ``deadline`` (on the CPU)."""
    cfg = model.cfg
    train_data = eagle_streams(batches, k, use_prompt=True)
    val_data = eagle_streams(val_batches, k, use_prompt=False)  # judged on generated text, like the engine
    targets = train_data["greedy_next"][train_data["ok"]]
    vocab_ids = draft_vocabulary(targets, torch.empty(0, 1, dtype=torch.long), args.draft_vocab)
    # Tokens the data never showed still get a fair guess: the state is regressed onto the target's
    # hidden states and scored against the target's own head rows.
    vocab_ids = fill_vocabulary(vocab_ids, min(args.draft_vocab, cfg.vocab_size))
    for d in (train_data, val_data):
        d["y"] = to_draft_ids(d["greedy_next"].masked_fill(~d["ok"], -1), vocab_ids, cfg.vocab_size)
    coverage = (train_data["y"] >= 0).sum().item() / max(1, len(targets))
    from_prompts = len(train_data["roots"]) - int(sum(b["alive"].sum() for b in batches))
    _log(f"{len(train_data['roots'])} train roots ({from_prompts} in prompts) / {len(val_data['roots'])} held-out; "
         f"draft vocab {len(vocab_ids)} covers {100 * coverage:.1f}% of targets")
    ecfg = eagle.EagleConfig(target=cfg.name, dim=cfg.dim, width=args.width or cfg.dim, blocks=args.blocks, k=k,
                             draft_vocab=len(vocab_ids))
    # The streams live on the CPU, so the (small) net trains there whatever device generated the data.
    net = eagle.build_net(model, ecfg, vocab_ids.to(model.device)).float().cpu()
    fit_figs = train_eagle(net, train_data, val_data, max(10.0, deadline - time.perf_counter()), args.lr, args.train_batch, args.seed,
                           args.weight_decay, args.reg_weight)
    held_out = evaluate_eagle(net, val_data)
    _log(f"trained: {fit_figs}; held-out {held_out}")
    return net, {**fit_figs, "heldout": held_out}, {
        "train_examples": len(train_data["roots"]), "train_examples_from_prompts": from_prompts,
        "heldout_examples": len(val_data["roots"]), "draft_vocab_coverage": round(coverage, 4)}


def run(args: argparse.Namespace) -> int:
    from specpilot.harness.deployment import load_deployment
    from specpilot_engine.checkpoint import drafter_file
    from specpilot_engine.weights import load_model

    t_start = time.perf_counter()
    budget = 60.0 * args.minutes
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dep = load_deployment(args.deployment)
    # --out, else the deployment's drafter file (when it is this kind's), else the shipped file (SmolLM2)
    # or the one beside a checkpoint: where the engine looks for it
    own = dep.extra_options.get("drafter_weights") if dep.drafter == args.kind else None
    out_path = args.out or own or KINDS[args.kind].get(dep.target) or drafter_file(dep.target, args.kind)
    out_path = Path(out_path) if out_path else None
    is_eagle = args.kind == "eagle"
    k = args.k or (6 if is_eagle else 4)
    if out_path is None and not args.generate_only:
        raise UserError(f"no default weights path for target {dep.target!r}: pass --out")
    if out_path is not None and not args.generate_only:  # before any work: a budget spent for nothing otherwise
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot write the drafter to {out_path} ({exc.strerror}): pass --out FILE and set "
                            "[options] drafter_weights = FILE in the deployment") from None
        if not os.access(out_path.parent, os.W_OK):
            raise UserError(f"cannot write the drafter to {out_path.parent} (not writable): pass --out FILE and set "
                            "[options] drafter_weights = FILE in the deployment")
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
    _log(f"{len(prompts)} prompts; generating for up to {args.gen_share * budget:.0f} s")
    batches, used = [], []
    gen_deadline = t_start + args.gen_share * budget
    # Similar lengths per batch waste less padding; batch order stays seeded-random.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [order[i: i + args.batch] for i in range(0, len(order), args.batch)]
    rng.shuffle(groups)
    t_gen, generated = time.perf_counter(), 0
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32 and device.type == "cuda"
    for gi, grp in enumerate(groups):
        ps = [prompts[i] for i in grp]
        shard = args.data / f"batch-{gi:05d}.pt" if args.data else None
        if shard is not None and shard.is_file():
            batches.append(load_shard(shard, ps, args.new_tokens, half=not is_eagle))
        elif time.perf_counter() > gen_deadline and len(batches) >= 2:  # one to hold out, one to train on
            break
        else:
            b = generate_batch(model, ps, args.new_tokens, cfg.stop_ids, keep_prompt=is_eagle)
            if not is_eagle:  # the parallel drafter's examples keep hidden states in half precision
                b["hidden"] = b["hidden"].half()
            if shard is not None:
                save_shard(shard, b)
            batches.append(b)
            generated += int(b["alive"].sum())
        used += ps
        n_tok = sum(int(b["alive"].sum()) for b in batches)
        _log(f"{len(used)} prompts, {n_tok} tokens ({generated / (time.perf_counter() - t_gen):.0f} tok/s generated "
             f"here, {len(batches)} batches)")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    gen_seconds = time.perf_counter() - t_gen
    if args.generate_only:
        _log(f"generated {generated} tokens in {gen_seconds:.0f} s; {len(batches)} batches in {args.data}")
        print(json.dumps({"data": str(args.data), "batches": len(batches), "prompts": len(used),
                          "tokens": sum(int(b["alive"].sum()) for b in batches), "generated_tokens": generated,
                          "generation_seconds": round(gen_seconds, 1)}, separators=(",", ":")))
        return 0
    data_hash = hashlib.sha256(json.dumps({"prompts": used, "outputs": [b["tokens"].tolist() for b in batches]},
                                          separators=(",", ":")).encode()).hexdigest()

    # Hold out whole batches (sequences), so held-out examples share no sequence with training ones.
    n_val = max(1, len(batches) // 20)
    eval_reserve = 60.0 if args.eval_requests else 5.0
    trainer = _train_eagle if is_eagle else _train_parallel
    net, fit_figs, data_figs = trainer(model, batches[n_val:], batches[:n_val], args, k, t_start + budget - eval_reserve)

    meta = {
        "training_data_sha256": data_hash,
        "command": " ".join(sys.argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "trained_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "figures": {
            "prompts": len(used), "generated_tokens": sum(int(b["alive"].sum()) for b in batches),
            "generation_seconds": round(gen_seconds, 1), **data_figs, **fit_figs,
        },
    }
    save_drafter(out_path, net, meta)
    if args.eval_requests:
        meta["figures"]["measured_tau"] = measured_tau(model, tok, dep, out_path, args.eval_requests, kind=args.kind)
        save_drafter(out_path, net, meta)
    meta["figures"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    save_drafter(out_path, net, meta)
    _log(f"wrote {out_path} ({out_path.stat().st_size / 1e6:.1f} MB)")
    print(json.dumps({"drafter": str(out_path), "target": cfg.name, **meta["figures"],
                      "training_data_sha256": data_hash}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
