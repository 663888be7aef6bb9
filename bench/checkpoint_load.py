"""Loading SmolLM2 as a Hugging Face checkpoint against the GGUF path: wall time and peak memory.

Each load runs in a fresh Python process (``python -c``), which reports the seconds `weights.load_model`
took, its peak resident memory (``VmHWM``) before and after, and the resident memory once loaded;
then it runs one forward of 16 tokens (so memory-mapped pages are touched: a lazy load is not a free
one) and reports that too. Paths:

- ``gguf-cold``: the GGUF converted (dequantised) from scratch into an empty model cache;
- ``gguf-cached``: the converted cache, memory-mapped (what every later load does);
- ``checkpoint``: ``hf:<folder>`` written by ``weights.export_smollm2`` (fp32 safetensors, memory-mapped).

Prints a table, then one JSON line. Usage: ``python bench/checkpoint_load.py [--repeats 3] [--dtype fp32]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
import torch
torch.set_num_threads(1)
from specpilot.engine.weights import load_model
def hwm():  # VmHWM: this process's peak resident memory (ru_maxrss would keep the parent's across exec)
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))
base = hwm()
t0 = time.perf_counter()
from pathlib import Path
model, tok = load_model(sys.argv[1], dtype=sys.argv[2], data_dir=Path(sys.argv[3]))
load_s = time.perf_counter() - t0
peak_load = hwm()
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096
after_load = rss()
t0 = time.perf_counter()
with torch.no_grad():
    ids = torch.arange(100, 116)[None]
    logits, _ = model(ids, torch.arange(16), model.new_cache(16), 0)
first_s = time.perf_counter() - t0
print(json.dumps({"load_s": load_s, "first_forward_s": first_s, "import_peak_mib": base / 1024,
                  "load_peak_mib": peak_load / 1024, "rss_after_load_mib": after_load / 2**20,
                  "rss_after_forward_mib": rss() / 2**20,
                  "peak_after_forward_mib": hwm() / 1024,
                  "logits_sum": float(logits.double().sum())}))
"""


def child(target: str, dtype: str, data_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, target, dtype, str(data_dir)], capture_output=True, text=True,
                         check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="loads of each path (the median is reported)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from specpilot.engine.weights import export_smollm2

    console = Console(stderr=True, width=120)
    rows: dict[str, list[dict]] = {"gguf-cold": [], "gguf-cached": [], "checkpoint": []}
    with tempfile.TemporaryDirectory(prefix="sp-load-") as tmp:
        tmp = Path(tmp)
        for i in range(args.repeats):
            cold = tmp / f"cold-{i}"  # an empty model cache: the GGUF is converted in the child
            console.print(f"[{i + 1}/{args.repeats}] gguf-cold")
            rows["gguf-cold"].append(child("smollm2-135m", args.dtype, cold))
        warm = tmp / "cold-0"
        folder = export_smollm2(tmp / "smollm2-hf", data_dir=warm)
        size = sum(p.stat().st_size for p in folder.iterdir())
        for i in range(args.repeats):
            for name, target in (("gguf-cached", "smollm2-135m"), ("checkpoint", f"hf:{folder}")):
                console.print(f"[{i + 1}/{args.repeats}] {name}")
                rows[name].append(child(target, args.dtype, warm))
    keys = ("load_s", "first_forward_s", "load_peak_mib", "rss_after_load_mib", "peak_after_forward_mib",
            "import_peak_mib")
    summary = {name: {k: round(statistics.median(r[k] for r in runs), 3) for k in keys} for name, runs in rows.items()}
    sums = {name: {r["logits_sum"] for r in runs} for name, runs in rows.items()}
    same_logits = len(set().union(*sums.values())) == 1
    table = Table(title=f"SmolLM2-135M loads ({args.dtype}, median of {args.repeats}, fresh process each; MiB)")
    for col in ("path", "load s", "fwd s", "peak load", "RSS loaded", "peak fwd", "imports"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for name, s in summary.items():
        table.add_row(name, *(f"{s[k]:.2f}" if k.endswith("_s") else f"{s[k]:.0f}" for k in keys))
    console.print(table)
    console.print(f"checkpoint folder {size / 2**20:.0f} MiB; same logits on every path: {same_logits}")
    print(json.dumps({"bench": "checkpoint_load", "dtype": args.dtype, "repeats": args.repeats,
                      "checkpoint_mib": round(size / 2**20, 1), "same_logits": same_logits, **summary},
                     separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
