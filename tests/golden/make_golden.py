"""Append encoded events of any type not yet in events.jsonl. Never rewrite existing lines:
they are the proof that old events keep decoding. Run: python -m tests.golden.make_golden"""

import json
from pathlib import Path

from specpilot import schema
from tests.backbone.samples import one_of_each

GOLDEN = Path(__file__).with_name("events.jsonl")

if __name__ == "__main__":
    have = {json.loads(line)["type"] for line in GOLDEN.read_text().splitlines()} if GOLDEN.exists() else set()
    with GOLDEN.open("a") as f:
        for e in one_of_each():
            if e.tag not in have:
                f.write(schema.encode(e).decode() + "\n")
