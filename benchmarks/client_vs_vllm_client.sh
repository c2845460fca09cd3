#!/usr/bin/env bash
# The epdserve load client and vLLM's (`vllm bench serve`) against the same epdserve server
# and the same workload, one after the other, twice each (A B A B), to check that the two
# clients report the same numbers.
#
#   benchmarks/client_vs_vllm_client.sh [NUM_PROMPTS] [CONCURRENCY]
#
# Workload: random 256 in / 128 out, EOS ignored, temperature 0, seed 0. Results go to $OUT
# (default out/client_vs_vllm_client); the summary prints each metric's ratio.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEER=${PEER:-$ROOT/../shared/peers/vllm-cpu.sh}
OUT=${OUT:-$ROOT/out/client_vs_vllm_client}
NUM_PROMPTS=${1:-64}
CONCURRENCY=${2:-16}
VENV=${VENV:-$ROOT/.venv}
mkdir -p "$OUT"
TOKENIZER=$("$PEER" model-dir)

"$VENV/bin/epdserve" serve --port 0 --served-model-name smollm2 --colocated-workers 1 --cores-per-worker 2 \
  >"$OUT/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
url=""
for _ in $(seq 1 600); do
  url=$(grep -o 'http://127.0.0.1:[0-9]*' "$OUT/server.log" | head -1 || true)
  [[ -n $url ]] && break
  kill -0 "$server" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
  sleep 0.2
done

common=(--base-url "$url" --model smollm2 --tokenizer "$TOKENIZER" --random-input-len 256
        --random-output-len 128 --ignore-eos --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY"
        --seed 0 --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99)
for round in 1 2; do
  "$PEER" bench serve --backend openai --dataset-name random "${common[@]}" \
    --save-result --result-dir "$OUT" --result-filename "vllm_client_$round.json" >"$OUT/vllm_client_$round.log" 2>&1
  "$VENV/bin/epdserve" bench serve --dataset random "${common[@]}" --disable-tqdm \
    --result-json "$OUT/epdserve_client_$round.json" >"$OUT/epdserve_client_$round.log" 2>&1
done

"$VENV/bin/python" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda name: [json.loads((out / f"{name}_{r}.json").read_text()) for r in (1, 2)]
ours, theirs = load("epdserve_client"), load("vllm_client")
keys = ["completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "mean_e2el_ms"]
print(f"{'metric':22s}{'epdserve client':>18s}{'vllm client':>14s}{'ratio':>8s}")
for k in keys:
    a = sum(r[k] for r in ours) / 2
    b = sum(r[k] for r in theirs) / 2
    print(f"{k:22s}{a:18.1f}{b:14.1f}{a / b if b else float('nan'):8.3f}")
EOF
