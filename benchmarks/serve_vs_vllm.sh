#!/usr/bin/env bash
# vLLM's own load client against three servers on the same two cores, one after another:
# epdserve colocated (one worker, 2 cores), epdserve 1P1D (1 + 1 cores) and vLLM-CPU.
#
#   benchmarks/serve_vs_vllm.sh [NUM_PROMPTS] [CONCURRENCY]
#
# Workload: random 256 in / 128 out (EOS ignored), temperature 0. Results (vLLM's JSON per
# server and a summary table) go to $OUT (default out/serve_vs_vllm).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEER=${PEER:-$ROOT/../shared/peers/vllm-cpu.sh}
OUT=${OUT:-$ROOT/out/serve_vs_vllm}
NUM_PROMPTS=${1:-64}
CONCURRENCY=${2:-16}
EPDSERVE=${EPDSERVE:-$ROOT/.venv/bin/epdserve}
mkdir -p "$OUT"
TOKENIZER=$("$PEER" model-dir)

run_client() {  # NAME URL
  "$PEER" bench serve --backend openai --base-url "$2" --model smollm2 --tokenizer "$TOKENIZER" \
    --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos \
    --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" --seed 0 --temperature 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1.json" >"$OUT/$1.log" 2>&1
}

run_epdserve() {  # NAME ARGS...
  local name=$1; shift
  local log=$OUT/$name.server.log
  local start; start=$(date +%s.%N)
  "$EPDSERVE" serve --port 0 --served-model-name smollm2 "$@" >"$log" 2>&1 &
  local pid=$!
  local url=""
  for _ in $(seq 1 600); do
    url=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 || true)
    [[ -n $url ]] && break
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
    sleep 0.2
  done
  echo "$name ready after $(echo "$(date +%s.%N) - $start" | bc) s" | tee "$OUT/$name.startup"
  run_client "$name" "$url"
  kill -INT "$pid"; wait "$pid" || true
}

run_epdserve epdserve_colocated --colocated-workers 1 --cores-per-worker 2
run_epdserve epdserve_1p1d --prefill-workers 1 --decode-workers 1 --cores-per-worker 1

# The peer's own serve command, plus --gpu-memory-utilization: on the CPU backend vLLM reserves
# that share of the NUMA node's free memory and refuses to start when the page cache holds some.
PEER_DIR=${PEER_DIR:-$HOME/.cache/epdserve-peers}
start=$(date +%s.%N)
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$PEER_DIR/vllm-venv/bin/vllm" serve "$TOKENIZER" \
  --served-model-name smollm2 --host 127.0.0.1 --port 8100 --max-model-len 4096 --dtype bfloat16 \
  --gpu-memory-utilization 0.5 >"$OUT/vllm.server.log" 2>&1 &
vllm_pid=$!
until curl -sf http://127.0.0.1:8100/health >/dev/null; do
  kill -0 "$vllm_pid" 2>/dev/null || { tail -20 "$OUT/vllm.server.log" >&2; exit 1; }
  sleep 1
done
echo "vllm ready after $(echo "$(date +%s.%N) - $start" | bc) s" | tee "$OUT/vllm.startup"
run_client vllm http://127.0.0.1:8100
kill "$vllm_pid"; wait "$vllm_pid" 2>/dev/null || true

"$ROOT/.venv/bin/python" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [(n, json.loads((out / f"{n}.json").read_text())) for n in ("epdserve_colocated", "epdserve_1p1d", "vllm")]
keys = ["completed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms"]
print(f"{'server':20s}" + "".join(f"{k:>20s}" for k in keys))
for name, r in rows:
    print(f"{name:20s}" + "".join(f"{r.get(k, float('nan')):>20.1f}" for k in keys))
vllm = rows[2][1]
for name, r in rows[:2]:
    print(f"{name} / vllm output throughput: {r['output_throughput'] / vllm['output_throughput']:.2f}x")
EOF
