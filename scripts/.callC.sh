set -o pipefail
export PYTHONPATH=$PWD; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
bash scripts/h200.sh w12-smoke 2>&1 | tail -8 || { echo SMOKE FAILED; exit 1; }
date -u
timeout 60 python3 bench/w12_bench.py --sweep --kinds tma --tma-tiles 2x4x4,1x8x2 --sweep-m 1,16 --m 1,16 \
  --shapes 4096x4096,28672x4096 --out $OUT/w12.jsonl > $OUT/w12.txt 2>&1 || echo "w12_bench exited $?"
grep -v '^{' $OUT/w12.txt | tail -14; grep '"w12_summary"' $OUT/w12.txt | tail -1; date -u
