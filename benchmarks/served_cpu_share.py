"""Who uses the cores while a server is under load: CPU time and preemptions per process.

    python benchmarks/served_cpu_share.py [--layout pd|colocated] [--rate 2.0] [--num-prompts 200]
        [--out out/served_cpu_share]

Starts ``epdserve serve`` with two workers on one core each (``pd``: one prefill and one decode
worker; ``colocated``: two colocated workers), step tracing on, and sends random requests (256
prompt / 96 output tokens, +-25 %, Poisson at ``--rate``) from ``epdserve bench serve`` in a
child process, after an unscored warm-up of 20 requests. For the scored run it reads, from
/proc before and after, each process's CPU time (user + system, all threads) and its context
switches (voluntary: it waited; involuntary: the kernel took its core away), and from the step
traces each worker's time in steps and its CPU time during them. Prints, per process: CPU
seconds, share of one core over the run, context switches per second; per worker: time in
steps, the CPU it had during them (below 100 % of the wall on one thread: its core was taken
during its steps), and its CPU time outside steps. The router and the load client are not pinned: what they use comes
out of the two cores the workers are pinned to.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from epdserve.bench.experiments.launch import list_workers, start_server, stop_server
from epdserve.bench.experiments.report import process_ticks
from epdserve.planner.calibrate import read_step_trace

LAYOUTS = {
    "pd": ["--prefill-workers", "1", "--decode-workers", "1"],
    "colocated": ["--colocated-workers", "2"],
}
TICKS = os.sysconf("SC_CLK_TCK")


def proc_times(pid: int) -> tuple[float, int, int]:
    """CPU seconds (user + system, every thread), voluntary and involuntary context switches."""
    cpu = process_ticks([pid]) / TICKS
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():  # the status file counts one thread only
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    return cpu, voluntary, involuntary


def bench_cmd(url: str, rate: float, num_prompts: int, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "epdserve.cli", "bench", "serve", "--base-url", url, "--dataset", "random",
            "--num-prompts", str(num_prompts), "--random-input-len", "256", "--random-output-len", "96",
            "--random-range-ratio", "0.25", "--request-rate", f"{rate:g}", "--seed", str(seed),
            "--result-json", str(out), "--disable-tqdm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), default="pd")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("out/served_cpu_share"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    steps_dir = ns.out / f"steps_{ns.layout}"
    server = start_server([*LAYOUTS[ns.layout], "--cores-per-worker", "1", "--max-model-len", "1024",
                           "--step-trace-dir", str(steps_dir)], ns.out / f"logs_{ns.layout}")
    try:
        subprocess.run(bench_cmd(server.url, ns.rate, 20, 1000, ns.out / "warmup.json"), check=True,
                       capture_output=True, text=True)
        workers = {w["id"]: w["pid"] for w in list_workers(server)}
        pids = {"router": server.process.pid, **workers}
        before = {name: proc_times(pid) for name, pid in pids.items()}
        start = time.monotonic()
        client = subprocess.Popen(bench_cmd(server.url, ns.rate, ns.num_prompts, 1, ns.out / "result.json"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(client.pid, 0)
        wall = time.monotonic() - start
        after = {name: proc_times(pid) for name, pid in pids.items()}
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"bench serve failed: {client.stderr.read()[-2000:]}")
    finally:
        stop_server(server)

    rows = {name: tuple(a - b for a, b in zip(after[name], before[name])) for name in pids}
    rows["load client"] = (usage.ru_utime + usage.ru_stime, usage.ru_nvcsw, usage.ru_nivcsw)
    result = json.loads((ns.out / "result.json").read_text())
    print(f"{ns.layout}, {ns.rate:g} req/s, {ns.num_prompts} requests, {wall:.1f} s; "
          f"output {result['output_throughput']:.1f} tok/s, TTFT P50 {result['p50_ttft_ms']:.0f} ms, "
          f"TPOT P50 {result['p50_tpot_ms']:.1f} ms")
    print(f"{'process':14}{'CPU s':>9}{'of a core':>11}{'invol./s':>10}{'vol./s':>9}")
    for name, (cpu, voluntary, involuntary) in rows.items():
        print(f"{name:14}{cpu:9.1f}{cpu / wall:10.0%}{involuntary / wall:10.1f}{voluntary / wall:9.1f}")
    outside = rows["router"][0] + rows["load client"][0]
    print(f"router + load client: {outside:.1f} CPU s, {outside / (2 * wall):.0%} of the two cores")
    summary = {"layout": ns.layout, "rate": ns.rate, "wall_s": wall, "processes": rows, "workers": {}}
    for worker_id in workers:
        path = next(steps_dir.glob(f"*{worker_id}*"), None)
        if path is None:
            continue
        trace = read_step_trace(path)
        scored = trace.starts >= start
        step_wall, cpu = float(trace.walls[scored].sum()), float(trace.cpus[scored].sum())
        total = rows[worker_id][0]
        summary["workers"][worker_id] = {"steps": int(scored.sum()), "step_wall_s": step_wall, "step_cpu_s": cpu,
                                         "cpu_s": total}
        print(f"{worker_id}: {int(scored.sum())} steps, {step_wall:.1f} s in steps, CPU in them {cpu:.1f} s "
              f"({cpu / max(step_wall, 1e-9):.0%} of their wall on {trace.num_threads} thread(s)); "
              f"CPU outside steps {total - cpu:.1f} s")
    (ns.out / f"summary_{ns.layout}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
