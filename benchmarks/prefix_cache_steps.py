"""Where a prefix-cache arm's time goes: chosen arms of ``epdserve bench experiment prefix-cache``
(its workload and SLO, on 1P1D or ``--topology``) run once each with step traces, then per run the client's goodput
and TTFT, the router's admission wait (the decode reservation) and the prefill queue, the
sequence-weighted decode step (what TPOT is under bursts), and per worker its steps, busy time,
free pool blocks and blocks pinned for write-down to the KV tiers.

    .venv/bin/python benchmarks/prefix_cache_steps.py --out out/pc-steps --rate 3.24 \\
        least-prefill:512 prefix-aware+tiers:512 least-prefill:2048 prefix-aware+tiers:2048

Each ARM:DECODE_BLOCKS runs on a fresh server (the experiment's flags, the decode worker's pool
set to DECODE_BLOCKS). Numbers come from one run each: near the knee the same configuration can
differ run to run by more than the arms do (docs/experiments.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from epdserve.bench.experiments import prefix_cache as pc
from epdserve.bench.experiments.launch import run_command, start_server, stop_server
from epdserve.envs import get_traces_dir


def worker_lines(steps_dir: Path) -> list[str]:
    lines = []
    for path in sorted(steps_dir.glob("*.jsonl")):
        raw = path.read_text().splitlines()
        head, recs = json.loads(raw[0]), [json.loads(x) for x in raw[1:]]
        if not recs or head["role"] == "encode":
            continue
        wall = np.array([r["wall_s"] for r in recs]) * 1e3
        seqs = np.array([r.get("num_decode_seqs", 0) for r in recs])
        free = np.array([r.get("free_blocks", -1) for r in recs])
        pinned = np.array([r.get("pinned_blocks", 0) for r in recs])
        weighted = (wall * seqs).sum() / seqs.sum() if seqs.sum() else float("nan")
        lines.append(f"  {head['role']}: {len(recs)} steps, busy {wall.sum() / 1e3:.1f} s, step P50 {np.median(wall):.1f} ms, "
                     f"sequence-weighted {weighted:.0f} ms, sequences P50 {np.median(seqs):.0f} max {seqs.max()}, "
                     f"prompt tokens computed {sum(r.get('num_prefill_tokens', 0) for r in recs)}, "
                     f"free blocks min {free.min()} P10 {np.percentile(free, 10):.0f}, pinned max {pinned.max()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=3.24, help="requests/s (the trace subset compressed to it)")
    parser.add_argument("--topology", default="prefill=1,decode=1", help="serve layout, e.g. colocated=2")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="default: the experiment's")
    parser.add_argument("arms", nargs="+", metavar="ARM:DECODE_BLOCKS", help=f"ARM one of {', '.join(pc.ARMS)}")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    records = pc.conversation_subset(get_traces_dir() / pc.TRACE_FILE, pc.FULL)
    subset = ns.out / "subset.jsonl"
    pc.write_subset(records, subset)
    span, duration = records[-1].arrival_s, len(records) / ns.rate
    for spec in ns.arms:
        arm, _, blocks = spec.partition(":")
        if arm not in pc.ARMS or not blocks.isdigit():
            parser.error(f"{spec}: want ARM:DECODE_BLOCKS with ARM one of {', '.join(pc.ARMS)}")
        scale = replace(pc.FULL, decode_num_kv_blocks=int(blocks),
                        slo_tpot_ms=ns.tpot_slo_ms or pc.FULL.slo_tpot_ms)
        tag = f"{arm}_{blocks}".replace("+", "_")
        disk, steps, result_path = Path(tempfile.mkdtemp(prefix="kv-disk-", dir=ns.out)), ns.out / f"steps_{tag}", ns.out / f"{tag}.json"
        server = start_server(pc.serve_flags(ns.topology, arm, scale, disk) + ["--step-trace-dir", str(steps)],
                              ns.out / "logs" / tag)
        try:
            run_command(pc.bench_cmd(server, subset, duration / span, scale, result_path), [])
        finally:
            stop_server(server)
            shutil.rmtree(disk, ignore_errors=True)
        result = json.loads(result_path.read_text())
        level = pc.summarize_level(result, duration)
        timings = [t for t in result["timings"] if t]
        admission = np.array([(t["admitted"] - t["arrived"]) * 1e3 for t in timings])
        queue = np.array([(t["prefill_start"] - t["admitted"]) * 1e3 for t in timings])
        print(f"{spec} at {level['request_rate']:.2f} req/s: goodput {level['request_goodput']:.2f} "
              f"({100 * level['goodput_share']:.0f} % within the SLO), TTFT P50 {level['ttft_p50_ms']:.0f} P99 "
              f"{level['ttft_p99_ms']:.0f} ms, admission wait P50 {np.median(admission):.0f} P90 "
              f"{np.percentile(admission, 90):.0f} ms, prefill queue P90 {np.percentile(queue, 90):.0f} ms, hits "
              + ", ".join(f"{k} {100 * v:.0f} %" for k, v in level["hit_share"].items()))
        print("\n".join(worker_lines(steps)), flush=True)


if __name__ == "__main__":
    main()
