"""Offline look at a W12 kernel configuration: compile it for sm_90 (no GPU needed) and count the SASS
instructions of its loops, per opcode, with the shared memory it asks for.

What it is for: the per-step cost of a configuration (instructions per weight, layout-conversion
barriers ``BAR``/``LDS``/``STS``, spills ``LDL``/``STL``) before spending device time on it. The
compile gets what a real launch specialises on (pointers and the Llama-shaped sizes divisible by
16), so its code is the code a launch runs. Counts are not times: wide dot tiles had a third fewer
instructions and ran slower (kernels/w12/README.md).

    python bench/w12_sass.py fma --bm 2 --bn 4 --bj 256 --warps 1
    python bench/w12_sass.py dot --bn 32 --bj 256 --stages 3 --sass /tmp/dot.sass

Prints one line per loop and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specpilot.kernels.w12 import kernel as w12  # noqa: E402

INTS = ("M", "N", "K", "KH", "cols_per_split", "stride_xm", "stride_ym")
DIVISIBLE = ("N", "K", "KH", "cols_per_split", "stride_xm", "stride_ym")  # by 16, for Llama shapes


def signature(kind: str, x: str) -> dict[str, str]:
    planes = "*i32" if kind == "fma" else "*u8"
    sig = {"X": f"*{x}"}
    if kind == "fma":
        sig["XQ"] = "*i64"
    sig |= {"LOW": planes, "NIB": planes, "E0": "*u8", "ESC_PTR": "*i32", "ESC_IDX": "*i32", "ESC_VAL": "*i16",
            "Y": f"*{x}"}
    return sig | dict.fromkeys(INTS, "i32")


def compile_sass(kind: str, constexprs: dict, warps: int, stages: int) -> tuple[str, int]:
    fn = w12._w12_fma_kernel if kind == "fma" else w12._w12_dot_kernel
    types = signature(kind, "fp16" if constexprs.get("FP16") else "bf16") | dict.fromkeys(constexprs, "constexpr")
    names = list(fn.arg_names)  # the kernel's own parameter order: constexprs are matched by position
    sig = {n: types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*") or n in DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})  # as w12_matmul
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return sass, compiled.metadata.shared


def loops(sass: str) -> list[dict]:
    """Every backward branch's body: its length and opcode counts."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+([^;]*);", sass)]
    out = []
    for addr, text in ins:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            ops = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0]
                                      for a, t in ins if lo <= a <= addr)
            out.append({"start": hex(lo), "instructions": sum(ops.values()), "ops": dict(ops.most_common())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("fma", "dot"))
    ap.add_argument("--bm", type=int, default=None, help="rows of x a program (default: 1 fma, 16 dot)")
    ap.add_argument("--bn", type=int, default=8)
    ap.add_argument("--bj", type=int, default=256, help="nib bytes a step (2*bj weights a row)")
    ap.add_argument("--warps", type=int, default=None, help="default: 1 fma, 4 dot")
    ap.add_argument("--stages", type=int, default=3, help="dot path's pipeline depth")
    ap.add_argument("--x-by-column", action="store_true", help="fma: x loaded by column (fp32 or odd K)")
    ap.add_argument("--sass", type=Path, default=None, help="also write the whole SASS here")
    a = ap.parse_args(argv)
    bm = a.bm or (1 if a.kind == "fma" else 16)
    warps = a.warps or (1 if a.kind == "fma" else 4)
    cx = {"BM": bm, "BN": a.bn, "BJ": a.bj, "ASM": True, "EVEN_K": True,
          "EC": max(1, min(16, 4096 // (bm * a.bn))), "GROUP": 16}
    if a.kind == "fma":
        cx |= {"XWORDS": not a.x_by_column, "FP16": False}
    else:
        cx |= {"DOT_BF16": True}
    sass, shared = compile_sass(a.kind, cx, warps, a.stages if a.kind == "dot" else 1)
    if a.sass:
        a.sass.write_text(sass)
    # weights a thread decodes in one step of the main loop: BN rows x 2*BJ weights over the threads
    per_thread = a.bn * 2 * a.bj // (32 * warps)
    found = loops(sass)
    for lp in found:
        print(f"loop at {lp['start']}: {lp['instructions']} instructions "
              f"({lp['instructions'] / per_thread:.2f} a weight, if it is the K loop) {lp['ops']}")
    main_loop = found[0] if found else None  # the K loop comes first; the escapes' loop is in the epilogue
    print(json.dumps({"bench": "w12_sass", "kind": a.kind, "bm": bm, "bn": a.bn, "bj": a.bj, "warps": warps,
                      "stages": a.stages, "shared_bytes": shared, "weights_per_thread": per_thread,
                      "main_loop": main_loop and main_loop["instructions"],
                      "per_weight": main_loop and round(main_loop["instructions"] / per_thread, 3),
                      "spills": len(re.findall(r"\b(?:LDL|STL)\b", sass))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
