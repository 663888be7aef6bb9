"""The prompt corpus of `specpilot drafter train`: text on the machine, chosen by a seeded `random.Random`.

Each builder takes the caller's ``rng`` and a count and returns prompt texts (`str`); the docstring variants
take one prompt and the ``rng``. The builders are called in a fixed order on one shared generator, so one
seed gives the same prompts in the same order:

- `stdlib_code_prompts`: code from Python's standard library, the lines up to a ``def``;
- `stdlib_docstring_prompts`: HumanEval-shaped prompts (imports, a function's ``def`` line and its
  docstring), and `docstring_variants` / `with_doctest_examples` to make them more so;
- `stdlib_chat_prompts`: questions about standard-library modules and functions;
- `stdlib_prose_prompts`: chat over the prose of the Python reference (`pydoc_data.topics`);
- `general_chat_prompts`: everyday chat from templates over topic lists written here, decontaminated
  against the shipped requests (`_word_grams`, `_topic_stems`).

`collect_prompts(dep, tokenizer, rng, ...)` puts them together for a `Deployment` and returns token ids
(each prompt cut to its last ``max_tokens``), shuffled; with ``include_dev`` it adds the deployment's dev
requests (never the sealed ones). Pure Python: nothing here imports torch or writes a file.
"""

from __future__ import annotations

import math
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Sequence
from pathlib import Path


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
