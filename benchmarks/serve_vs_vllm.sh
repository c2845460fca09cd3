#!/usr/bin/env bash
# vLLM's own load client against three servers on the same two cores, one after another:
# epdserve colocated (one worker, 2 cores), epdserve 1P1D (1 + 1 cores) and vLLM-CPU, in
# $ROUNDS rounds (default 3) that alternate the three; the summary holds the medians and spread.
#
#   [ROUNDS=3] benchmarks/serve_vs_vllm.sh [NUM_PROMPTS] [CONCURRENCY]
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

# The peer's own serve command, plus --gpu-memory-utilization: on the CPU backend vLLM reserves
# that share of the NUMA node's free memory and refuses to start when the page cache holds some.
PEER_DIR=${PEER_DIR:-$HOME/.cache/epdserve-peers}
run_vllm() {  # NAME
  local start; start=$(date +%s.%N)
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$PEER_DIR/vllm-venv/bin/vllm" serve "$TOKENIZER" \
    --served-model-name smollm2 --host 127.0.0.1 --port 8100 --max-model-len 4096 --dtype bfloat16 \
    --gpu-memory-utilization 0.5 >"$OUT/$1.server.log" 2>&1 &
  local vllm_pid=$!
  until curl -sf http://127.0.0.1:8100/health >/dev/null; do
    kill -0 "$vllm_pid" 2>/dev/null || { tail -20 "$OUT/$1.server.log" >&2; exit 1; }
    sleep 1
  done
  echo "$1 ready after $(echo "$(date +%s.%N) - $start" | bc) s" | tee "$OUT/$1.startup"
  run_client "$1" http://127.0.0.1:8100
  kill "$vllm_pid"; wait "$vllm_pid" 2>/dev/null || true
}

# ROUNDS rounds, the servers alternating within each (the machine is shared and noisy).
ROUNDS=${ROUNDS:-3}
for r in $(seq 1 "$ROUNDS"); do
  run_epdserve "epdserve_colocated_r$r" --colocated-workers 1 --cores-per-worker 2
  run_epdserve "epdserve_1p1d_r$r" --prefill-workers 1 --decode-workers 1 --cores-per-worker 1
  run_vllm "vllm_r$r"
done

"$ROOT/.venv/bin/python" - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
names = ("epdserve_colocated", "epdserve_1p1d", "vllm")
runs = {n: [json.loads((out / f"{n}_r{r}.json").read_text()) for r in range(1, rounds + 1)] for n in names}
keys = ["completed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms"]
print(f"median of {rounds} rounds")
print(f"{'server':20s}" + "".join(f"{k:>20s}" for k in keys))
med = {n: {k: statistics.median(r.get(k, float("nan")) for r in runs[n]) for k in keys} for n in names}
for n in names:
    print(f"{n:20s}" + "".join(f"{med[n][k]:>20.1f}" for k in keys))
for n in names:
    tps = sorted(r["output_throughput"] for r in runs[n])
    print(f"{n}: output tok/s per round {', '.join(f'{t:.1f}' for t in tps)} (spread {tps[-1] - tps[0]:.1f})")
for n in names[:2]:
    ratio = med[n]["output_throughput"] / med["vllm"]["output_throughput"]
    print(f"{n} / vllm output throughput (medians): {ratio:.2f}x; "
          f"TPOT P99 {med[n]['p99_tpot_ms']:.1f} vs {med['vllm']['p99_tpot_ms']:.1f} ms")
EOF
