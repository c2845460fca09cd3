"""Simulator fidelity: real epdserve, run several times, against ``epdserve simulate`` on the same arrivals.

    python benchmarks/sim_fidelity.py [--profile P] [--out out/sim_fidelity] [--quick] [--rounds N]
        [--num-prompts N] [--topology T ...] [--no-calibrate] [--no-azure]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS]
    python benchmarks/sim_fidelity.py --rejudge DIR [--recalibrate [--first-windows I,J]]

Topologies (``--topology``, repeatable; default all three), every worker on this machine with
one core of its own where there is one: colocated x2 (two colocated workers), 1P1D (one prefill
and one decode worker) and 1E1P1D (``encode=1,prefill=1,decode=1``: one encode, one prefill and
one decode worker; on a two-core host serve wraps the cores, so the encoder and the decode
worker share core 0).

1. Profile this machine (``epdserve profile``, colocated workers at 1 thread: in every
   topology each worker has one core; the encode role too where 1E1P1D runs), unless
   ``--profile`` is given.
2. The SLO is the flags' or, without them, scaled to this machine from the profile, per
   workload (``slo_from_profile``: with images, their encode and image tokens count too).
   Workloads: on colocated x2 and 1P1D, random (256 in / 96 out tokens, +-25 %, Poisson) at
   0.5 / 1 / 1.5 x capacity, and the Azure LLM-inference conversation trace (its first requests
   in its own arrival order, lengths scaled, time compressed) at 0.5 / 1 x capacity
   (``--no-azure``: none); on 1E1P1D, images: the random workload's requests through the chat
   endpoint with one 256 x 256 image each (one tile of the default vision tower; ``simulate
   --images-per-request 1 --image-tiles 1``) at 0.5 / 1 / 1.5 x capacity. Capacity is the
   highest rate whose simulated SLO attainment is >= 90 % on that workload.
3. Rounds (``--rounds``, default 3). In each round every topology gets a fresh ``epdserve
   serve`` with step tracing (prefill, decode and colocated workers their steps, an encoder its
   batches and the tiles each computed): an unscored warm-up, unscored calibration runs (three
   in the first round, at 0.4 x, 0.75 x and 1.25 x the offline capacity estimate, then one a
   round, in turn), then every (workload, level) once with the same arrivals and prompts in
   every round (a fresh server: no run finds another's prompts in its prefix cache). Warm-up and
   calibration runs send random requests, on 1E1P1D with an image each: the encoder's first-use
   costs are paid before the levels, and the calibration runs trace prefill steps with image
   tokens and decode steps next to an encoder at work, as the levels have them. Cells of one
   topology run one after another; the topologies alternate within a round and the rounds
   repeat, so each cell's runs are spread over the whole stretch. Between rounds (and before the
   first) the host-drift probe (benchmarks/host_drift.py) times one fixed decode step for
   ``drift_s`` with no server running.
4. After the first round's calibration runs, ``epdserve calibrate --window`` fits the profile to
   the steps the workers traced in them (never a level's), the encoder's cost to its batches:
   the profile a user would have before the judged runs; the capacities (and so every round's
   rates) come from it. After the last round, a second calibration on every calibration run of
   the stretch (the host's speed over the same minutes); and the tracked profiles: per later
   round, the first-round profile refreshed (``epdserve calibrate --refresh``: one factor per
   role and one for the encoder, the fitted terms kept) on that round's own calibration run.
   Each real run's requests are written as a Mooncake trace (arrival at the server, from its
   own stamps on the client's clock; prompt tokens as the server counted them less the image
   tokens the simulator adds itself; output tokens) and replayed by ``epdserve simulate``
   (with the workload's images) on the first-round profile, on its round's tracked profile, on
   the stretch profile and on the offline profile; every worker of a topology shares one
   simulated host (``--instances-per-host``). A diagnostic beside them: each
   run replayed on the first-round profile refreshed on that run's own traced steps (the host's
   speed during the run, measured on the run): what it still misses is the simulator's
   scheduling and queueing, what it gains over the others is the host's change of speed.
5. Per cell (topology, workload, level) and metric (TTFT P50/P99, TPOT P50/P99, goodput): the
   real runs' mean, lowest and highest; the simulated value (mean over the runs' replays); whether
   it lies inside the real band [lowest, highest] widened by 5 % of the real mean on each side;
   and its error against the real mean. Goal: >= 90 % of the cell-metrics inside, and the mean
   absolute error over the cells <= 10 % for TTFT P50, TPOT P50 and goodput. Beside it, SLO
   attainment (the share of requests meeting the SLO) simulated against the real mean, in points,
   as DistServe judges its simulator: goodput's relative error grows without bound where the
   real goodput nears zero, attainment's difference in points does not. For every cell
   that misses, the step traces of its runs say which term of the cost model is off: per role,
   the served / predicted time of steps that prefill and of decode-only steps. Per cell too: the
   TTFT by part (queue, encode, prefill, first token; the server's meanings), real against
   simulated, which says where in the request's path the time goes missing; and each server
   process's CPU over the judged runs (router, each worker, the bench client; with the time its
   threads waited for a core), which shows what the simulator does not model (the router and
   the client) and how the workers on one core shared it.

Both sides are scored by the same function from per-request records: TTFT, TPOT =
(E2E - TTFT)/(output - 1), goodput = requests meeting every SLO / (last finish - first send).
Writes ``results.json``, ``report.md`` and ``plots/<metric>.png`` into the output directory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from epdserve.bench.experiments.launch import list_workers, start_server, stop_server
from epdserve.cluster.local import available_cores
from epdserve.bench.experiments.report import (
    cpu_busy_share,
    machine_summary,
    machine_ticks,
    markdown_table,
    process_ticks,
    pyplot,
    save_figure,
)
from epdserve.bench.traces import read_any_trace
from epdserve.cluster.messages import Timing
from epdserve.envs import get_traces_dir
from epdserve.planner import slo as host_slo
from epdserve.planner.calibrate import neighbour_split, predict_steps, read_step_trace
from epdserve.router.timing import timing_json
from epdserve.sim.cost_model import CostModel
from epdserve.sim.topology import parse_topology

EPD = "encode=1,prefill=1,decode=1"
TOPOLOGIES = {  # simulator topology -> serve flags (every worker on one core, all on this machine)
    "colocated=2": ["--colocated-workers", "2", "--cores-per-worker", "1"],
    "prefill=1,decode=1": ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"],
    # Three workers on two cores: serve wraps the cores, encode on core 0, prefill on core 1,
    # decode on core 0 again (it shares its core with the encoder).
    EPD: ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1",
          "--vision", "default"],
}
SHORT_NAMES = {"colocated=2": "co×2", "prefill=1,decode=1": "1P1D", EPD: "1E1P1D"}
MAX_MODEL_LEN = 1024
# The images workload: this many images per request, each of one fixed size that is one tile of
# the default vision tower (sides up to its 512-pixel tile), on top of the random text.
IMAGES_PER_REQUEST = 1
IMAGE_RESOLUTION = "256x256"
IMAGE_TILES = 1
ENGINE_FLAGS = ["--kv-cache-memory", "1", "--max-model-len", str(MAX_MODEL_LEN)]  # the profile records the same pool
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput")
BAND_WIDEN = 0.05  # the real band [lowest, highest] widened by this share of the real mean, each side
GOAL_INSIDE = 0.90  # share of cell-metrics whose simulated value lies inside the widened band
GOAL_MAE = 0.10  # mean |error against the real mean| over the cells, for MAE_METRICS
MAE_METRICS = ("ttft_p50_ms", "tpot_p50_ms", "goodput")
SIDE_METRICS = ("attainment",)  # summarized per cell and reported, not judged against the goal
TARGET_ATTAINMENT = 0.9
WARMUP_SEED = 1000
LEVEL_SEED = 1  # a level's seed: LEVEL_SEED + its index among all (workload, level) cells, the same every round
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SHARE = 0.05  # other work below this share of the CPUs counts as idle
IDLE_WINDOW_S = 3.0
# The calibration runs: rates as multiples of the offline capacity estimate (a light, a middle
# and a heavy load, so that steps with the other worker idle and busy are both traced, and small
# batches as well as large: served steps are slower than the offline profile's, so the judged
# 0.5x level sits near 0.4x the offline estimate), each with its seed.
CALIBRATION_LOADS = (0.4, 0.75, 1.25)
CALIBRATION_SEED = 500
# A step kind with fewer traced steps in a cell names its miss only if every kind has fewer.
ATTRIBUTION_MIN_STEPS = 30
CAPACITY_RATES = tuple(round(0.25 * 1.25**k, 3) for k in range(20))  # 0.25 .. ~17 requests/s
AZURE_TRACE = "azure_conv.csv"
HOST_DRIFT = Path(__file__).with_name("host_drift.py")


@dataclass(frozen=True)
class Scale:
    num_prompts: int  # per run of a random-workload level
    num_warmup_prompts: int  # sent before the first level, not scored
    num_calibration_prompts: int  # the calibration run (not scored)
    input_len: int
    output_len: int
    range_ratio: float
    load_levels: tuple[float, ...]  # random workload: multiples of the estimated capacity
    azure_levels: tuple[float, ...]  # the Azure trace: multiples of its estimated capacity
    azure_num_prompts: int  # its first requests
    azure_length_scale: float  # its prompt and output lengths x this
    profile_quick: bool
    cycle_kv_pool: bool  # warm up until every worker's KV pool has been allocated once
    rounds: int  # real runs per cell, each on a fresh server
    drift_s: float  # the host-drift probe's length before the first round and after each (0: none)


FULL = Scale(160, 16, 150, 256, 96, 0.25, (0.5, 1.0, 1.5), (0.5, 1.0), 160, 0.2, False, True, 3, 20.0)
QUICK = Scale(10, 4, 24, 64, 8, 0.25, (0.5, 1.0), (1.0,), 10, 0.05, True, False, 2, 0.0)
# SLO from the profile (no --slo-ttft-ms / --slo-tpot-ms), per workload, by the rules of
# epdserve.planner.slo (`epdserve plan --slo ttft_pP:auto`): TTFT within TTFT_PREFILLS times one request's prefill alone (with
# images: its images' encode plus the prefill of its text and image tokens), TPOT within
# TPOT_STEPS times a decode step of one sequence, on the colocated role's cost. Runs 1-11
# (docs/benchmarks.md) used a fixed 1000 / 80 ms (--slo-ttft-ms 1000 --slo-tpot-ms 80), set
# for their AVX-512 host; on a slower host a decode step of one sequence alone can take longer
# than 80 ms, and no rate would meet that SLO. One SLO for text and image requests alike would
# not do either: one image's encode can take about as long as the text prompt's prefill and its
# tokens double the prompt, so that a request with an image, alone, can miss a text prompt's
# TTFT SLO.


class Slo(NamedTuple):
    ttft_ms: float
    tpot_ms: float

    def goodput_args(self) -> list[str]:
        """``--goodput`` of ``bench serve`` and ``simulate``."""
        return ["--goodput", f"ttft:{self.ttft_ms:g}", f"tpot:{self.tpot_ms:g}"]


@dataclass(frozen=True)
class Workload:
    """What one cell sends: ``bench_args`` for ``bench serve`` and ``sim_args`` for
    ``simulate`` (capacity estimates), both at ``rate`` requests/s."""

    name: str  # "random" | "azure" | "images"
    levels: tuple[float, ...]
    trace: Path | None = None
    num_images: int = 0  # per request, IMAGE_TILES tiles each, on top of the random text (no trace)
    slo: Slo | None = None  # what its requests are scored against (main sets it: with_slo)

    def _trace_scale(self, scale: Scale, rate: float) -> float:
        """The Azure trace's time scale that sends its first requests at ``rate`` on average."""
        num, span = trace_head(str(self.trace), scale.azure_num_prompts)
        return (num - 1) / (span * rate) if span > 0 else 1.0

    def bench_args(self, scale: Scale, rate: float, seed: int) -> list[str]:
        if self.trace is not None:
            return ["--dataset", "trace", "--dataset-path", str(self.trace), "--num-prompts",
                    str(scale.azure_num_prompts), "--trace-time-scale", f"{self._trace_scale(scale, rate):.6g}",
                    "--trace-length-scale", f"{scale.azure_length_scale:g}", "--seed", str(seed)]
        text = ["--num-prompts", str(scale.num_prompts), "--random-input-len", str(scale.input_len),
                "--random-output-len", str(scale.output_len), "--random-range-ratio", f"{scale.range_ratio:g}",
                "--request-rate", f"{rate:.4g}", "--seed", str(seed)]
        if not self.num_images:
            return ["--dataset", "random", *text]
        # Images go through the chat endpoint; ignore_eos as random's default, so that every
        # request generates its output length, as the simulator's do.
        return ["--dataset", "random-mm", "--endpoint", "/v1/chat/completions", *text,
                "--random-mm-base-items-per-request", str(self.num_images),
                "--random-mm-resolutions", IMAGE_RESOLUTION, "--ignore-eos"]

    def sim_args(self, scale: Scale, rate: float) -> list[str]:
        if self.trace is not None:
            return ["--workload", "trace", str(self.trace), "--time-scale", f"{self._trace_scale(scale, rate):.6g}",
                    "--length-scale", f"{scale.azure_length_scale:g}", "--num-requests", str(scale.azure_num_prompts)]
        return ["--workload", "random", "--rate", f"{rate:g}", "--num-requests", str(scale.num_prompts),
                "--random-input-len", str(scale.input_len), "--random-output-len", str(scale.output_len),
                "--random-range-ratio", f"{scale.range_ratio:g}", "--seed", "0", *self.sim_image_args()]

    def sim_image_args(self) -> list[str]:
        """The simulator's images per request and tiles per image (capacity estimates and replays)."""
        if not self.num_images:
            return []
        return ["--images-per-request", str(self.num_images), "--image-tiles", str(IMAGE_TILES)]

    def num_image_tokens(self, profile: Path) -> int:
        """Image tokens per request: what the simulator adds on top of a request's text tokens."""
        if not self.num_images:
            return 0
        return self.num_images * IMAGE_TILES * CostModel.load(profile).encoder().tokens_per_tile


@functools.lru_cache(maxsize=None)
def trace_head(path: str, num: int) -> tuple[int, float]:
    """The number of a trace's first ``num`` requests and their arrival span in seconds (read
    once: every capacity estimate and run asks)."""
    records = read_any_trace(path)[:num]
    return len(records), records[-1].arrival_s - records[0].arrival_s


def has_encode(topology: str) -> bool:
    return parse_topology(topology).num_encode > 0


def workloads(scale: Scale, topology: str, with_azure: bool) -> list[Workload]:
    """A topology's workloads: with an encode worker the images workload (the random one with
    images), else the random workload and (``with_azure``) the Azure trace."""
    if has_encode(topology):
        return [Workload("images", scale.load_levels, num_images=IMAGES_PER_REQUEST)]
    out = [Workload("random", scale.load_levels)]
    if with_azure:
        out.append(Workload("azure", scale.azure_levels, get_traces_dir() / AZURE_TRACE))
    return out


def warmup_workload(loads: list[Workload]) -> Workload:
    """What a topology's warm-up and calibration runs send: its random workload, with images
    where it has them (the encoder's first-use costs are warmed too, and the calibration runs
    trace steps that prefill image tokens, next to an encoder at work, as the levels' do)."""
    return next(w for w in loads if w.trace is None)


def selected_topologies(names: list[str] | None) -> list[str]:
    """The topologies ``--topology`` named (each once, in TOPOLOGIES order); all without it."""
    if not names:
        return list(TOPOLOGIES)
    return [t for t in TOPOLOGIES if t in names]


def profile_roles(topologies: list[str]) -> str:
    """``epdserve profile --roles``: the step roles (the SLO reads the colocated one) and encode
    where a topology has an encode worker."""
    roles = ["colocated", "prefill", "decode"]
    return ",".join(roles + (["encode"] if any(has_encode(t) for t in topologies) else []))


def slo_from_profile(profile: Path, scale: Scale, workload: Workload) -> Slo:
    """The SLO in ms (``epdserve.planner.slo``'s rules) from the profile's colocated step cost
    (and encoder cost for a workload with images) on a request of the random workload's mean length."""
    cost = CostModel.load(profile)
    step = cost.role("colocated").step
    n = scale.input_len + workload.num_image_tokens(profile)
    encode_s = workload.num_images * cost.encoder().time_s(IMAGE_TILES) if workload.num_images else 0.0
    return Slo(host_slo.ttft_slo_ms(step, n, encode_s), host_slo.tpot_slo_ms(step, n + scale.output_len // 2))


def with_slo(workload: Workload, profile: Path, scale: Scale, ttft_ms: float | None,
             tpot_ms: float | None) -> Workload:
    """``workload`` with its SLO: the flags', each part from the profile where its flag is not given."""
    auto = slo_from_profile(profile, scale, workload)
    return replace(workload, slo=Slo(ttft_ms or auto.ttft_ms, tpot_ms or auto.tpot_ms))


def epdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "epdserve.cli", *args]


def run_logged(cmd: list[str], log: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (its output captured), note it in ``log``; exit on failure if ``check``."""
    shown = "epdserve " + shlex.join(cmd[3:]) if cmd[:3] == epdserve() else shlex.join(cmd)
    log.append(shown)
    print(f"$ {shown}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {shown}\n{proc.stderr.strip()[-2000:]}")
    return proc


def score(result: dict | list[dict], slo: Slo) -> dict:
    """The compared metrics from bench-shaped results' per-request lists. Several results (runs
    of one level) are pooled: percentiles over all their requests, goodput = all requests meeting
    the SLO / the runs' summed spans (each from its first send to its last finish)."""
    results = result if isinstance(result, list) else [result]
    ttft_arrays, tpot_parts, has_tpot_parts = [], [], []
    parts = [ttft_parts(r) for r in results]
    num_requests = num_ok = num_good = 0
    span_s = 0.0
    for r in results:
        ok = [i for i, err in enumerate(r["errors"]) if not err]
        ttft = np.array([r["ttfts"][i] for i in ok]) * 1e3
        e2e = np.array([r["latencies"][i] for i in ok]) * 1e3
        out = np.array([r["output_lens"][i] for i in ok])
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
        starts = np.array(r["start_times"])
        if len(starts):
            ends = np.array([r["start_times"][i] + r["latencies"][i] for i in range(len(starts))])
            span_s += float(ends.max() - starts.min())
        num_requests += len(starts)
        num_ok += len(ok)
        num_good += int(np.sum((ttft <= slo.ttft_ms) & (tpot <= slo.tpot_ms)))
        ttft_arrays.append(ttft)
        tpot_parts.append(tpot)
        has_tpot_parts.append(out > 1)
    ttft, tpot = np.concatenate(ttft_arrays), np.concatenate(tpot_parts)
    has_tpot = np.concatenate(has_tpot_parts)
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if num_ok else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if num_ok else None,
        "tpot_p50_ms": float(np.percentile(tpot[has_tpot], 50)) if has_tpot.any() else None,
        "tpot_p99_ms": float(np.percentile(tpot[has_tpot], 99)) if has_tpot.any() else None,
        "goodput": num_good / span_s if span_s > 0 else 0.0,
        "attainment": num_good / num_requests if num_requests else 0.0,
        "num_failed": num_requests - num_ok,
        "span_s": span_s,
        "ttft_parts": {k: statistics.fmean(p[k] for p in parts) for k in TTFT_PARTS
                       if all(k in p for p in parts)},
    }


TTFT_PARTS = ("queue_ms", "encode_ms", "prefill_ms", "first_token_ms")  # they add up to the TTFT


def ttft_parts(result: dict) -> dict[str, float]:
    """Mean of each TTFT part (ms) over a run's requests, with the server's meanings
    (``router/timing.py``). A served run's are computed again from its requests' stamps
    (``--return-timing``), so runs stored before a change of those meanings read the same; a
    simulated run's come from its ``ttft_breakdown_ms``, which the simulator writes with them."""
    if "simulator" in result:
        breakdown = result.get("ttft_breakdown_ms") or {}
        return {k: float(breakdown[k]["mean"]) for k in TTFT_PARTS if k in breakdown}
    fields = set(Timing.__struct_fields__)
    stamps = [t for t, err in zip(result.get("timings") or [], result["errors"])
              if isinstance(t, dict) and not err]
    rows = [timing_json(Timing(**{k: v for k, v in t.items() if k in fields and isinstance(v, int | float)}))
            for t in stamps]
    return {k: statistics.fmean(r[k] for r in rows) for k in TTFT_PARTS} if rows else {}


def relative_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else float("inf")
    return (sim - real) / real


def arrival_times_s(result: dict) -> list[float]:
    """Each request's arrival at the server, on the bench client's clock: the server's own
    ``arrived`` stamps (``--return-timing``) less their median offset from the send times. The
    server is what the simulator models, so it replays the arrivals the server saw: the client's
    own dispatch jitter on a busy host (up to ~15 ms here) can put two requests sent close
    together on either side of a step boundary. A request the server never stamped (it failed
    first) keeps its send time."""
    sends = result["start_times"]
    stamps = [t.get("arrived") if isinstance(t, dict) else None
              for t in result.get("timings") or [None] * len(sends)]
    offsets = [a - s for s, a in zip(sends, stamps) if a]
    if not offsets:
        return list(sends)
    offset = statistics.median(offsets)
    return [max(0.0, a - offset) if a else s for s, a in zip(sends, stamps)]


def write_trace(result: dict, path: Path, num_image_tokens: int = 0) -> None:
    """The real run's requests as a Mooncake trace: arrival time at the server (ms,
    ``arrival_times_s``), text prompt and output tokens.

    ``simulate`` adds ``num_image_tokens`` (per request) on top of a record's input length. The
    bench result's ``input_lens`` of a request that succeeded is the server's
    ``usage.prompt_tokens``: every token of the rendered prompt, the chat template's and each
    image's placeholder tokens (tiles x tokens per tile) included, so the image tokens are taken
    off here, else the replay would count them twice. A failed request's length is the dataset's
    (text only: no template, no image) and is kept."""
    lines = []
    for t, n_in, n_out, error in zip(arrival_times_s(result), result["input_lens"], result["output_lens"],
                                     result["errors"]):
        num_text = n_in if error else max(1, n_in - num_image_tokens)
        lines.append(json.dumps({"timestamp": t * 1e3, "input_length": num_text, "output_length": n_out}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def simulate(profile: Path, topology: str, workload: list[str], slo: Slo, out: Path, log: list[str],
             num_cores: int | None = None) -> dict:
    """``workload``: the simulate flags of the requests; every worker of ``topology`` shares
    this one host of ``num_cores`` cores (default: the cores this process may use)."""
    num_workers = parse_topology(topology).num_instances
    num_cores = num_cores or len(available_cores())
    run_logged(epdserve("simulate", "--profile", str(profile), "--topology", topology, *workload,
                        *slo.goodput_args(), "--max-model-len", str(MAX_MODEL_LEN),
                        "--instances-per-host", str(num_workers), "--cores-per-host", str(num_cores),
                        "--out", str(out), "--quiet"), log)
    return json.loads(out.read_text())


def own_ticks(pids: list[int]) -> int:
    """CPU ticks used by ``pids`` (the server and its workers) and by this script's waited-for
    children (the bench client)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return process_ticks(pids) + round((children.ru_utime + children.ru_stime) * CLOCK_TICKS)


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """Per live thread of ``pid``: (CPU seconds, seconds spent runnable but waiting for a core),
    from /proc; the main thread as "main", the others by their name (Python's threads all have
    the process's, zmq's its own), those of one name summed. A process that has exited gives {}."""
    times: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as f:
                head, _, rest = f.read().rpartition(")")
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="utf-8") as f:
                wait_ns = int(f.read().split()[1])
            stat = rest.split()
            cpu = (int(stat[11]) + int(stat[12])) / CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            continue
        name = "main" if tid == str(pid) else head.partition("(")[2]
        cpu0, wait0 = times.get(name, (0.0, 0.0))
        times[name] = (cpu0 + cpu, wait0 + wait_ns / 1e9)
    return times


@contextlib.contextmanager
def cpu_use(pids: dict[str, int]) -> Iterator[dict]:
    """What each server process (name -> pid: the router, each worker by role) and this script's
    waited-for children (the bench client) used of the CPUs while the body ran: per process its
    CPU seconds and the seconds its threads waited for a core, and per thread name its CPU
    seconds where that is at least 1 % of the span. Neither the router's nor the client's work
    is in the simulator's model, and a worker's threads besides its steps are not either."""
    use: dict = {}
    before = {name: thread_times(pid) for name, pid in pids.items()}
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    yield use
    span = max(time.monotonic() - start, 1e-9)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    for name, pid in pids.items():
        threads = {}
        for thread, (cpu, wait) in thread_times(pid).items():
            cpu0, wait0 = before[name].get(thread, (0.0, 0.0))
            threads[thread] = (cpu - cpu0, wait - wait0)
        busiest = sorted(threads.items(), key=lambda kv: -kv[1][0])
        use[name] = {"cpu_s": sum(c for c, _ in threads.values()),
                     "wait_s": sum(w for _, w in threads.values()),
                     "threads": {t: round(c, 3) for t, (c, _) in busiest if c >= 0.01 * span}}
    client_s = (children.ru_utime + children.ru_stime) - (children0.ru_utime + children0.ru_stime)
    use["client"] = {"cpu_s": client_s}
    use["span_s"] = span


@dataclass
class Share:
    value: float = 0.0  # fraction of all CPU time


@contextlib.contextmanager
def other_work(pids: list[int]) -> Iterator[Share]:
    """Share of all CPU time that processes other than the server, its workers and the bench
    client used while the body ran: other work on the machine skews every real timing."""
    share = Share()
    total0, busy0 = machine_ticks()
    own0 = own_ticks(pids)
    yield share
    total, busy = machine_ticks()
    other = (busy - busy0) - (own_ticks(pids) - own0)
    share.value = max(0.0, other / (total - total0)) if total > total0 else 0.0


def wait_for_idle(pids: list[int], max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until other work uses under IDLE_SHARE of the CPUs over a
    short window; returns the last window's share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with other_work(pids) as other:
            time.sleep(IDLE_WINDOW_S)
        if other.value < IDLE_SHARE or time.monotonic() >= deadline:
            return other.value
        print(f"other work uses {100 * other.value:.0f} % of the CPUs; waiting", flush=True)


def pool_cycling_prompts(profile: Path, topology: str, scale: Scale, num_image_tokens: int = 0) -> int:
    """Requests that allocate every block of every worker's KV pool at least once (requests
    spread evenly over the workers; each takes its prompt's, image tokens included, and
    output's blocks). Roles without a KV pool (encode) need none."""
    data = json.loads(profile.read_text())
    block_size = data["block_size"]
    num_prompt = scale.input_len + num_image_tokens
    blocks_per_request = -(-(num_prompt + scale.output_len) // block_size)
    prefill_blocks = -(-num_prompt // block_size)
    need = 0
    layout = parse_topology(topology)
    for role in layout.roles:
        count = layout.count(role)
        num_kv_blocks = data["roles"][role].get("num_kv_blocks")
        if num_kv_blocks is None:
            continue
        per_request = prefill_blocks if role == "prefill" else blocks_per_request
        need = max(need, count * -(-num_kv_blocks // per_request))
    return need


def estimate_capacity(profile: Path, topology: str, workload: Workload, scale: Scale, out_dir: Path,
                      log: list[str]) -> float:
    """Highest ladder rate whose simulated SLO attainment on ``workload`` is >= TARGET_ATTAINMENT."""
    best = CAPACITY_RATES[0]
    for rate in CAPACITY_RATES:
        name = topology.replace("=", "").replace(",", "_")
        result = simulate(profile, topology, workload.sim_args(scale, rate), workload.slo,
                          out_dir / f"capacity_{name}_{workload.name}_{rate:g}.json", log)
        if score(result, workload.slo)["attainment"] < TARGET_ATTAINMENT:
            break
        best = rate
    return best


def bench_serve(url: str, args: list[str], slo: Slo, out: Path, log: list[str]) -> dict:
    run_logged(epdserve("bench", "serve", "--base-url", url, *args, "--return-timing", *slo.goodput_args(),
                        "--result-json", str(out), "--disable-tqdm"), log)
    return json.loads(out.read_text())


def warmup_args(warmup: Workload, scale: Scale, rate: float, num_prompts: int, seed: int) -> list[str]:
    """The ``bench serve`` flags of a warm-up or calibration run (``warmup_workload``)."""
    return warmup.bench_args(replace(scale, num_prompts=num_prompts), rate, seed)


def probe_drift(scale: Scale, out: Path, log: list[str]) -> dict | None:
    """The host-drift probe (one fixed decode step on core 1, no server running): its windows'
    median step times."""
    if scale.drift_s <= 0:
        return None
    run_logged([sys.executable, str(HOST_DRIFT), "--minutes", f"{scale.drift_s / 60:.4g}",
                "--window-s", f"{max(1.0, scale.drift_s / 4):g}", "--json", str(out)], log)
    return json.loads(out.read_text())


@dataclass
class RealRun:
    topology: str
    workload: str
    level: float
    rate: float
    round_index: int
    tag: str
    window: tuple[float, float]  # the run's span on the step traces' clock (time.monotonic)
    other_work_share: float
    result_path: str
    cpu: dict = field(default_factory=dict)  # ``cpu_use``: each server process's CPU over the run


@dataclass
class TopologyState:
    """What the rounds of one topology have collected."""

    capacities: dict[str, float] = field(default_factory=dict)  # workload -> req/s the levels multiply
    offline_capacities: dict[str, float] = field(default_factory=dict)  # the same on the offline profile
    calibration_windows: list[tuple[int, float, float]] = field(default_factory=list)  # (round, start, end)
    trace_dirs: list[Path] = field(default_factory=list)  # one per round
    first_profile: Path | None = None  # calibrated on the first round's calibration runs
    runs: list[RealRun] = field(default_factory=list)


def run_round(topology: str, round_index: int, profile: Path, state: TopologyState, loads: list[Workload],
              scale: Scale, out_dir: Path, log: list[str], max_wait_idle_s: float, calibrate: bool) -> None:
    """One fresh server of ``topology``: warm-up, calibration run(s), then every (workload,
    level) of its ``loads`` once with the arrivals every round shares."""
    name = topology.replace("=", "").replace(",", "_")
    trace_dir = out_dir / f"steps_{name}_r{round_index + 1}"
    if trace_dir.exists():
        for old in trace_dir.glob("*.jsonl"):
            old.unlink()
    state.trace_dirs.append(trace_dir)
    server = start_server([*TOPOLOGIES[topology], *ENGINE_FLAGS, "--step-trace-dir", str(trace_dir)],
                          out_dir / "logs" / f"{name}_r{round_index + 1}")
    log.append(server.command)
    workers = list_workers(server)
    pids = [server.process.pid, *(w["pid"] for w in workers)]
    named_pids = {"router": server.process.pid, **{f"{w['role']} {w['id']}": w["pid"] for w in workers}}
    warmup = warmup_workload(loads)
    offline_capacity = state.offline_capacities[warmup.name]  # warm-up and calibration rates
    try:
        # Warm-up (not scored): first-use costs (kernels, page faults on the KV pool) are not
        # in the profile, and a fresh pool hands out each request's pages in one contiguous
        # run, on which decode steps run faster than over the scattered pages of a pool whose
        # free list requests have churned (benchmarks/scattered_pages.py). The warm-up cycles
        # every worker's pool once, so calibration and levels all see a churned pool.
        num_warmup = scale.num_warmup_prompts
        if scale.cycle_kv_pool:
            num_warmup = max(num_warmup, pool_cycling_prompts(profile, topology, scale,
                                                              warmup.num_image_tokens(profile)))
        bench_serve(server.url, warmup_args(warmup, scale, offline_capacity, num_warmup, WARMUP_SEED), warmup.slo,
                    out_dir / f"warmup_{name}_r{round_index + 1}.json", log)
        if calibrate:
            loads_x = CALIBRATION_LOADS if round_index == 0 else (
                CALIBRATION_LOADS[(round_index + 1) % len(CALIBRATION_LOADS)],)
            for load in loads_x:
                k = len(state.calibration_windows)
                wait_for_idle(pids, max_wait_idle_s)
                start = time.monotonic()
                bench_serve(server.url, warmup_args(warmup, scale, load * offline_capacity,
                                                    scale.num_calibration_prompts, CALIBRATION_SEED + k),
                            warmup.slo, out_dir / f"calibration_{name}_r{round_index + 1}_x{load:g}.json", log)
                state.calibration_windows.append((round_index, start, time.monotonic()))
            if round_index == 0:
                # The profile a user has before the judged runs; the levels are multiples of
                # what the simulator says this deployment holds on it.
                state.first_profile = out_dir / f"profile_calibrated_{name}.json"
                run_calibrate(profile, trace_dir, [(a, b) for _, a, b in state.calibration_windows],
                              state.first_profile, log)
                for workload in loads:
                    state.capacities[workload.name] = estimate_capacity(
                        state.first_profile, topology, workload, scale, out_dir / "capacity_calibrated", log)
        cell_index = 0
        for workload in loads:
            for level in workload.levels:
                cell_index += 1
                rate = level * state.capacities[workload.name]
                tag = f"{name}_{workload.name}_x{level:g}_r{round_index + 1}"
                wait_for_idle(pids, max_wait_idle_s)
                start = time.monotonic()
                with other_work(pids) as other, cpu_use(named_pids) as cpu:
                    bench_serve(server.url, workload.bench_args(scale, rate, LEVEL_SEED + cell_index), workload.slo,
                                out_dir / f"real_{tag}.json", log)
                state.runs.append(RealRun(topology, workload.name, level, rate, round_index, tag,
                                          (start, time.monotonic()), other.value,
                                          str(out_dir / f"real_{tag}.json"), cpu))
    finally:
        stop_server(server)


def run_calibrate(profile: Path, trace_dir: Path, windows: list[tuple[float, float]], out: Path,
                  log: list[str], refresh: bool = False, may_fail: bool = False) -> bool:
    """``epdserve calibrate`` on the steps traced in ``windows``; a failure exits, unless
    ``may_fail`` (then it is printed and False returned)."""
    spans = [f"--window={a:.6f}:{b:.6f}" for a, b in windows]
    cmd = epdserve("calibrate", *(["--refresh"] if refresh else []), "--profile", str(profile),
                   "--step-trace-dir", str(trace_dir), *spans, "--out", str(out))
    proc = run_logged(cmd, log, check=not may_fail)
    if proc.returncode != 0:
        print(f"no profile {out.name}: {proc.stderr.strip()[-300:]}", flush=True)
    return proc.returncode == 0


def tracked_profiles(first: Path, trace_dirs: list[Path], windows: list[tuple[int, float, float]], stem: str,
                     out_dir: Path, log: list[str]) -> list[Path]:
    """Per round, the profile its judged runs are replayed on for ``sim_tracked``: the first
    round's calibrated profile, and in each later round that profile refreshed (``epdserve
    calibrate --refresh``: one factor per role, one for the encoder) on the round's own
    calibration run, which ran on the same server just before the round's levels."""
    paths = []
    for k, trace_dir in enumerate(trace_dirs):
        mine = [(a, b) for r, a, b in windows if r == k]
        if k == 0 or not mine:
            paths.append(first)
            continue
        paths.append(out_dir / f"{stem}_r{k + 1}.json")
        run_calibrate(first, trace_dir, mine, paths[-1], log, refresh=True)
    return paths


def own_speed_profiles(first: Path, trace_dirs: list[Path],
                       runs: list[tuple[str, int, tuple[float, float]]], fallback: dict[str, Path], stem: str,
                       out_dir: Path, log: list[str]) -> dict[str, Path]:
    """Per judged run (tag, round, window), for ``sim_own``: the first round's calibrated profile
    refreshed on that run's own traced steps (``epdserve calibrate --refresh``): the host's speed
    during the run, measured on the run itself. A diagnostic, not a prediction: what the replay
    then misses is the simulator's scheduling and queueing, not a change of the host's speed. A
    run whose steps cannot be refreshed on (too few of a role's) keeps ``fallback[tag]``."""
    paths = {}
    for tag, k, window in runs:
        out = out_dir / f"{stem}_own_{tag}.json"
        is_made = run_calibrate(first, trace_dirs[k], [window], out, log, refresh=True, may_fail=True)
        paths[tag] = out if is_made else fallback[tag]
    return paths


def merged_trace_dir(state: TopologyState, out: Path) -> Path:
    """Every round's step traces in one directory (links named by round): rounds never overlap
    in time, so each step's busy neighbours are still its own server's."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    for k, trace_dir in enumerate(state.trace_dirs):
        for path in sorted(trace_dir.glob("*.jsonl")):
            (out / f"r{k + 1}_{path.name}").symlink_to(path.resolve())
    return out


# ---------------------------------------------------------------- judging


def summarize_cell(real_runs: list[dict], sim_runs: list[dict]) -> dict[str, dict | None]:
    """Per metric: the real runs' mean, lowest and highest, the simulated value (the mean of
    the runs' replays), the real band widened by BAND_WIDEN of the real mean on each side,
    whether the simulated value lies inside it, and its error against the real mean."""
    out: dict[str, dict | None] = {}
    for m in (*METRICS, *SIDE_METRICS):
        real = [r[m] for r in real_runs if r.get(m) is not None]
        sim = [s[m] for s in sim_runs if s.get(m) is not None]
        if not real or not sim:
            out[m] = None
            continue
        mean, low, high = statistics.fmean(real), min(real), max(real)
        value = statistics.fmean(sim)
        widen = BAND_WIDEN * abs(mean)
        band = (low - widen, high + widen)
        out[m] = {"real_mean": mean, "real_min": low, "real_max": high, "sim": value, "band": band,
                  "is_inside": band[0] <= value <= band[1], "error": relative_error(value, mean)}
    return out


def judge(cells: list[dict], key: str) -> dict:
    """Over all cells, for the simulation ``key``: cell-metrics inside their band, and the mean
    absolute error per metric; the goal met or not. Beside it, SLO attainment: the mean and the
    largest absolute difference between simulated and real mean, in points (cells that have it)."""
    inside = total = 0
    errors: dict[str, list[float]] = {m: [] for m in METRICS}
    points: list[float] = []
    for c in cells:
        attainment = c[key].get("attainment")
        if attainment is not None:
            points.append(100 * abs(attainment["sim"] - attainment["real_mean"]))
        for m in METRICS:
            v = c[key].get(m)
            if v is None:
                continue
            total += 1
            inside += v["is_inside"]
            if v["error"] is not None and np.isfinite(v["error"]):
                errors[m].append(abs(v["error"]))
    mae = {m: statistics.fmean(e) if e else None for m, e in errors.items()}
    share = inside / total if total else 0.0
    is_met = share >= GOAL_INSIDE and all(mae[m] is not None and mae[m] <= GOAL_MAE for m in MAE_METRICS)
    attainment_points = ({"mean": statistics.fmean(points), "max": max(points), "num_cells": len(points)}
                         if points else None)
    return {"num_inside": inside, "num_cell_metrics": total, "inside_share": share, "mae": mae, "is_met": is_met,
            "attainment_points": attainment_points}


def step_ratios(trace_dir: Path, windows: list[tuple[float, float]], cost: CostModel) -> dict[str, dict]:
    """Per role, over the steps that began in ``windows``: time in service / the profile's
    prediction (with its neighbour term by the share of the host's other workers mid-step, as
    the simulator adds it), for steps that computed prompt tokens and for decode-only steps."""
    traces = [read_step_trace(p) for p in sorted(trace_dir.glob("*.jsonl"))]
    sums: dict[str, dict[str, list[float]]] = {}
    for trace in traces:
        if trace.role == "encode" or not len(trace.walls):  # an encoder's batches: only its neighbours' busy time
            continue
        keep = np.any([(trace.starts >= a) & (trace.starts < b) for a, b in windows], axis=0)
        if not keep.any():
            continue
        role = cost.role(trace.role)
        sharing, overlap = neighbour_split(trace, traces)
        # its core time-shared with the workers mid-step on it
        predicted = predict_steps(role, trace.shapes, overlap) * sharing
        prefills = np.array([s.num_prefill_tokens > 0 for s in trace.shapes])
        role_sums = sums.setdefault(trace.role, {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]})
        for kind, mask in (("prefill", prefills & keep), ("decode", ~prefills & keep)):
            role_sums[kind][0] += float(trace.walls[mask].sum())
            role_sums[kind][1] += float(predicted[mask].sum())
            role_sums[kind][2] += int(mask.sum())
    return {role: {kind: {"served_over_predicted": (s / p if p > 0 else None), "num_steps": n}
                   for kind, (s, p, n) in kinds.items() if n}
            for role, kinds in sums.items()}


def farthest_term(ratios: dict[str, dict]) -> str:
    """The role and step kind whose served / predicted time is farthest from 1, among those
    with at least ATTRIBUTION_MIN_STEPS steps where any has that many (a handful of odd steps,
    such as a decode worker's recomputes after a preemption, does not name a cell's miss)."""
    terms = [(role, kind, r["served_over_predicted"], r["num_steps"]) for role, kinds in ratios.items()
             for kind, r in kinds.items() if r["served_over_predicted"] is not None]
    if any(n >= ATTRIBUTION_MIN_STEPS for *_, n in terms):
        terms = [t for t in terms if t[3] >= ATTRIBUTION_MIN_STEPS]
    if not terms:
        return "no traced steps"
    role, kind, x, _ = max(terms, key=lambda t: abs(np.log(t[2])))
    return f"{role} {'prefill' if kind == 'prefill' else 'decode-only'} steps × {x:.3f}"


PROFILE_KEYS = {
    "sim": "the profile calibrated before the judged runs",
    "sim_tracked": ("the profile calibrated before the judged runs, refreshed in each later round on that "
                    "round's calibration run (epdserve calibrate --refresh)"),
    "sim_own": ("each judged run's own step speed: the profile calibrated before the judged runs, "
                "refreshed on the judged run's own traced steps (a diagnostic, not a prediction, and not "
                "judged against the goal: what it misses is the simulator's scheduling and queueing, not "
                "the host's speed)"),
    "sim_stretch": "the profile calibrated over the stretch",
    "sim_offline": "the offline profile",
}


def cell_label(c: dict) -> str:
    short = SHORT_NAMES.get(c["topology"], c["topology"])
    return f"{short} {c['workload']} {c['load']:g}x"


def format_cells(cells: list[dict], key: str) -> str:
    headers = ["topology", "workload", "load", "req/s", *(f"{m}: real mean [min–max] / sim (err)" for m in METRICS)]
    rows = []
    for c in cells:
        row = [c["topology"], c["workload"], f"{c['load']:g}x", f"{c['rate']:.2f}"]
        for m in METRICS:
            v = c[key].get(m)
            if v is None:
                row.append("—")
                continue
            digits = 2 if m == "goodput" else 0
            err = f"{100 * v['error']:+.1f} %" if v["error"] is not None and np.isfinite(v["error"]) else "—"
            row.append(f"{v['real_mean']:.{digits}f} [{v['real_min']:.{digits}f}–{v['real_max']:.{digits}f}] / "
                       f"{v['sim']:.{digits}f} ({err}){'' if v['is_inside'] else ' **out**'}")
        rows.append(row)
    return markdown_table(headers, rows)


def format_judgement(j: dict, is_diagnostic: bool = False) -> str:
    mae = ", ".join(f"{m} {100 * j['mae'][m]:.1f} %" if j["mae"][m] is not None else f"{m} —" for m in METRICS)
    return (f"Inside the widened band: {j['num_inside']} of {j['num_cell_metrics']} cell-metrics "
            f"({100 * j['inside_share']:.0f} %; goal ≥ {100 * GOAL_INSIDE:.0f} %). Mean absolute error against the "
            f"real mean: {mae} (goal ≤ {100 * GOAL_MAE:.0f} % for {', '.join(MAE_METRICS)}). "
            + ("(A diagnostic: not judged against the goal.)" if is_diagnostic
               else f"**Goal {'met' if j['is_met'] else 'not met'}.**")
            + format_attainment(j.get("attainment_points")))


def format_attainment(points: dict | None) -> str:
    if points is None:
        return ""
    return (f" SLO attainment, simulated against the real mean (not part of the goal): "
            f"{points['mean']:.1f} points apart on average, {points['max']:.1f} at most, "
            f"over {points['num_cells']} cells.")


def format_attribution(cells: list[dict]) -> str:
    rows = []
    for c in cells:
        missed = [m for m in METRICS if c["sim"].get(m) is not None and not c["sim"][m]["is_inside"]]
        ratios = c.get("step_ratios") or {}
        parts = [f"{role}: " + ", ".join(f"{'prefill' if k == 'prefill' else 'decode-only'} "
                                        f"×{r['served_over_predicted']:.3f} ({r['num_steps']})"
                                        for k, r in kinds.items() if r["served_over_predicted"] is not None)
                 for role, kinds in ratios.items()]
        rows.append([cell_label(c), ", ".join(missed) or "—", "; ".join(parts) or "—",
                     farthest_term(ratios) if missed else ""])
    return markdown_table(["cell", "metrics outside the band", "served / predicted step time by role and step kind "
                           "(steps)", "farthest term (cells that miss)"], rows)


def write_plots(cells: list[dict], out_dir: Path) -> list[Path]:
    """One plot per metric: each cell's real band (lowest to highest run; the 5 % widening
    lighter), the real mean, and the simulated values."""
    plt = pyplot()
    paths = []
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    labels = [cell_label(c) for c in cells]
    x = np.arange(len(cells))
    for m in METRICS:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(cells)), 3.6))
        for i, c in enumerate(cells):
            v = c["sim"].get(m)
            if v is None:
                continue
            ax.vlines(i, *v["band"], color="0.8", linewidth=9, label="real band ±5 %" if i == 0 else None)
            ax.vlines(i, v["real_min"], v["real_max"], color="0.45", linewidth=9,
                      label="real runs: lowest–highest" if i == 0 else None)
            ax.plot(i, v["real_mean"], "k_", markersize=14, label="real mean" if i == 0 else None)
            ax.plot(i, v["sim"], "rx", markersize=8, label="simulated (calibrated before)" if i == 0 else None)
            tracked = c.get("sim_tracked", {}).get(m)
            if tracked is not None:
                ax.plot(i, tracked["sim"], "g.", markersize=8, label="simulated (refreshed each round)"
                        if i == 0 else None)
            own = c.get("sim_own", {}).get(m)
            if own is not None:
                ax.plot(i, own["sim"], "m^", markersize=5, label="simulated (each run's own step speed)"
                        if i == 0 else None)
            stretch = c.get("sim_stretch", {}).get(m)
            if stretch is not None:
                ax.plot(i, stretch["sim"], "b+", markersize=8, label="simulated (calibrated over the stretch)"
                        if i == 0 else None)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(m.replace("_", " "))
        ax.legend(fontsize=7, loc="best")
        ax.set_title(f"{m}: real runs against the simulator")
        paths.append(save_figure(fig, out_dir / "plots" / f"{m}.png"))
    return paths


def build_report(cells: list[dict], judgements: dict[str, dict], scale: Scale, results: dict) -> str:
    drift = [d for d in results["host_drift"] if d]
    medians = [d["median_ms"] for d in drift]
    lines = [
        "# sim_fidelity",
        "",
        (f"{scale.rounds} runs per cell, each on a fresh server with the same arrivals and prompts, in rounds (every "
         f"topology once a round, topologies alternating). "
         + describe_workloads(scale, results["workloads"])
         + ". " + describe_slos(results["slos"]) + ". Capacity: the highest rate "
         "with ≥ 90 % simulated SLO attainment on the profile calibrated in the first round: "
         + "; ".join(f"{t}: " + ", ".join(f"{w} {r:g} req/s" for w, r in caps.items())
                     for t, caps in results["capacities"].items()) + "."),
        "",
        f"Machine: {machine_summary(results['busy_at_start'])}  ",
        f"Offline profile: `{results['profile']}`",
        "",
    ]
    if medians:
        lines += [(f"Host drift (benchmarks/host_drift.py: one decode step of 8 sequences × 300 tokens on core 1, "
                   f"{scale.drift_s:g} s before the first round and after each, no server running): medians "
                   + ", ".join(f"{x:.1f}" for x in medians) + f" ms; highest / lowest {max(medians) / min(medians):.2f}."),
                  ""]
    for key, what in PROFILE_KEYS.items():
        if key not in judgements:
            continue
        lines += [f"## Simulated on {what}", ""]
        if key == "sim_tracked":
            lines += [*format_refreshes(cells), ""]
        elif key == "sim_own":
            lines += [format_own_speeds(cells), ""]
        elif key != "sim_offline":
            lines += [*format_factors(calibration_factors(cells, key)), ""]
        lines += [format_cells(cells, key), "", format_judgement(judgements[key], key in DIAGNOSTIC_KEYS), ""]
    parts_table, cpu_table = format_ttft_parts(cells), format_cpu(cells)
    lines += ["## Where the cells that miss are off", "",
              ("Per cell, the step traces of its real runs against the profile calibrated before them: each role's "
               "time in service over the profile's prediction (its neighbour term included), for steps that computed "
               "prompt tokens and for decode-only steps; the term farthest from 1 names the likely cause of a miss."),
              "", format_attribution(cells), "",
              *(["TTFT by part (mean over requests, then over a cell's runs; the server's meanings, "
                 "`router/timing.py`), real against the replays on the profile calibrated before the "
                 "judged runs:",
                 "", parts_table, ""] if parts_table else []),
              *(["## CPU of each process during the judged runs", "",
                 ("The router, the bench client and a worker's threads besides its steps are not in the "
                  "simulator's model; this is what they used, beside each worker's own (mean over a cell's "
                  "runs)."), "",
                 cpu_table, ""] if cpu_table else []),
              "Plots: " + ", ".join(f"`plots/{m}.png`" for m in METRICS), "",
              "Commands (every replay in `results.json`; one of them shown):", "",
              *[f"- `{c}`" for c in results["commands"] if " simulate " not in f" {c} "],
              *[f"- `{c}`" for c in results["commands"][:] if " simulate " in f" {c} " and "/trace_" in c][:1], ""]
    return "\n".join(lines)


def describe_workloads(scale: Scale, loads: dict[str, list[str]]) -> str:
    """One sentence per workload that ran, with the topologies it ran on (no final stop)."""
    on: dict[str, list[str]] = {}
    for topology, names in loads.items():
        for name in names:
            on.setdefault(name, []).append(SHORT_NAMES.get(topology, topology))
    levels = ", ".join(f"{x:g}x" for x in scale.load_levels)
    text = {
        "random": (f"Random workload: {scale.num_prompts} requests of {scale.input_len} prompt and {scale.output_len} "
                   f"output tokens (±{100 * scale.range_ratio:.0f} %), Poisson, at {levels} capacity"),
        "azure": (f"The Azure conversation trace: its first {scale.azure_num_prompts} requests, lengths × "
                  f"{scale.azure_length_scale:g}, time compressed to " + ", ".join(f"{x:g}x" for x in scale.azure_levels)
                  + " its capacity"),
        "images": (f"Images workload: the random workload's requests, each with {IMAGES_PER_REQUEST} image of "
                   f"{IMAGE_RESOLUTION} pixels ({IMAGE_TILES} tile) through the chat endpoint, at {levels} its capacity"),
    }
    return ". ".join(f"{text[name]} (on {', '.join(topologies)})" for name, topologies in on.items())


def describe_slos(slos: dict[str, dict]) -> str:
    """The SLO, once per set of workloads that share it."""
    names: dict[tuple[float, float], list[str]] = {}
    for name, slo in slos.items():
        names.setdefault((slo["ttft_ms"], slo["tpot_ms"]), []).append(name)
    if len(names) == 1:
        (ttft, tpot), = names
        return f"SLO: TTFT ≤ {ttft:g} ms and TPOT ≤ {tpot:g} ms"
    return "SLO: " + "; ".join(f"{', '.join(n)}: TTFT ≤ {ttft:g} ms and TPOT ≤ {tpot:g} ms"
                               for (ttft, tpot), n in names.items())


def format_factors(factors: dict[str, dict]) -> list[str]:
    """One bullet per topology: each role's calibrated factors (the encoder's one factor too)."""
    lines = []
    for topology, calibration in factors.items():
        parts = [f"{role}: " + ", ".join(f"{term} × {cal['alone'][term]:.3f} "
                                         f"(+{cal['busy'][term]:.3f} next to a busy worker)"
                                         for term in cal["alone"])
                 + f" ({cal['num_steps']} steps; served / predicted overall {cal['factor']:.3f})"
                 for role, cal in calibration.get("roles", {}).items()]
        enc = calibration.get("encode")
        if enc is not None:
            parts.append(f"encode: × {enc['factor']:.3f} ({enc['num_batches']} batches, their time alone)")
        lines.append(f"- {topology}: " + "; ".join(parts))
    return lines


def format_refreshes(cells: list[dict]) -> list[str]:
    """One bullet per topology: each later round's refresh factors (``tracked_profiles``)."""
    lines = []
    for topology in dict.fromkeys(c["topology"] for c in cells):
        paths = dict.fromkeys(p for c in cells if c["topology"] == topology
                              for p in c.get("profiles", {}).get("sim_tracked", []))
        rounds = []
        for path in paths:
            refresh = json.loads(Path(path).read_text()).get("calibration", {}).get("refresh")
            if refresh is not None:
                rounds.append(f"round {Path(path).stem.rsplit('_r', 1)[-1]}: " + ", ".join(
                    f"{role} × {f['factor']:.3f}" for role, f in refresh["factors"].items()))
        if rounds:
            lines.append(f"- {topology}: " + "; ".join(rounds))
    return lines


def format_own_speeds(cells: list[dict]) -> str:
    """The host's speed during each judged run: per cell and round, each role's served steps
    over the first round's profile (the factors of the run's ``sim_own`` refresh)."""
    rounds = max(c["num_runs"] for c in cells)
    rows = []
    for c in cells:
        row = [cell_label(c)]
        for path in c.get("profiles", {}).get("sim_own", []):
            refresh = json.loads(Path(path).read_text()).get("calibration", {}).get("refresh")
            if "_own_" not in Path(path).name or refresh is None:
                row.append("— (its round's profile)")
            else:
                row.append(", ".join(f"{role} × {f['factor']:.3f}"
                                     for role, f in refresh["factors"].items()))
        rows.append(row + [""] * (rounds + 1 - len(row)))
    return ("The host's speed in each judged run, from the run's own step traces: each role's steps "
            "(time alone on their cores) over the prediction of the profile calibrated before the judged "
            "runs.\n\n"
            + markdown_table(["cell", *(f"round {k + 1}" for k in range(rounds))], rows))


def format_ttft_parts(cells: list[dict], key: str = "sim") -> str:
    """Per cell, each TTFT part's mean (ms) over its real runs and over their replays on the
    ``key`` profile: which part of the TTFT a miss comes from (waiting, encoding, prefill)."""
    rows = []
    for c in cells:
        real = [r.get("ttft_parts") or {} for r in c.get("real_runs") or []]
        sim = [r.get("ttft_parts") or {} for r in c.get(f"{key}_runs") or []]
        cols = []
        for part in TTFT_PARTS:
            a, b = [x[part] for x in real if part in x], [x[part] for x in sim if part in x]
            cols.append(f"{statistics.fmean(a):,.0f} / {statistics.fmean(b):,.0f}" if a and b else "")
        if any(cols):
            rows.append([cell_label(c), *cols])
    return markdown_table(["cell", *(f"{p.removesuffix('_ms').replace('_', ' ')}, real / simulated ms"
                                     for p in TTFT_PARTS)], rows) if rows else ""


def format_cpu(cells: list[dict]) -> str:
    """Per cell, each server process's and the bench client's mean CPU use over its runs, in
    cores (CPU seconds over the run's span), and for each process the cores' worth of time its
    threads waited for a core; with the busiest thread names beside each process."""
    rows = ["| cell | process | CPU, cores | waiting for a core, cores | busiest threads (CPU s, first run) "
            "|", "|---|---|---|---|---|"]
    for c in cells:
        runs = [u for u in c.get("cpu") or [] if u.get("span_s")]
        if not runs:
            continue
        for name in [n for n in runs[0] if n != "span_s"]:
            cores = statistics.fmean(u[name]["cpu_s"] / u["span_s"] for u in runs if name in u)
            waits = [u[name]["wait_s"] / u["span_s"] for u in runs if "wait_s" in u.get(name, {})]
            threads = ", ".join(f"{t} {v:g}" for t, v in list(runs[0][name].get("threads", {}).items())[:4])
            rows.append(f"| {cell_label(c)} | {name} | {cores:.2f} | "
                        f"{statistics.fmean(waits):.2f} | {threads} |" if waits else
                        f"| {cell_label(c)} | {name} | {cores:.2f} | | {threads} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def calibration_factors(cells: list[dict], key: str) -> dict[str, dict]:
    """Per topology, the calibration record of the profile simulation ``key`` ran on."""
    out = {}
    for c in cells:
        path = c.get("profiles", {}).get(key)
        if c["topology"] not in out and path:
            out[c["topology"]] = json.loads(Path(path).read_text()).get("calibration", {})
    return {t: f for t, f in out.items() if f.get("roles")}


def judge_runs(states: dict[str, TopologyState], loads: dict[str, list[Workload]], profile: Path, scale: Scale,
               out_dir: Path, log: list[str], calibrate: bool) -> list[dict]:
    """Replay every real run in the simulator on each profile; one cell per (topology,
    workload, level) with its runs' summaries and the step-time attribution."""
    cells = []
    for topology, state in states.items():
        name = topology.replace("=", "").replace(",", "_")
        profiles = {"sim": profile}  # without calibration the offline profile is the one judged
        if calibrate and state.first_profile is not None:
            merged = merged_trace_dir(state, out_dir / f"steps_{name}_all")
            stretch = out_dir / f"profile_calibrated_{name}_stretch.json"
            run_calibrate(profile, merged, [(a, b) for _, a, b in state.calibration_windows], stretch, log)
            profiles = {"sim": state.first_profile, "sim_stretch": stretch, "sim_offline": profile}
            tracked = tracked_profiles(state.first_profile, state.trace_dirs, state.calibration_windows,
                                       f"profile_calibrated_{name}", out_dir, log)
            own = own_speed_profiles(state.first_profile, state.trace_dirs,
                                     [(r.tag, r.round_index, r.window) for r in state.runs],
                                     {r.tag: tracked[r.round_index] for r in state.runs},
                                     f"profile_calibrated_{name}", out_dir, log)
        attribution_cost = CostModel.load(profiles["sim"])
        groups: dict[tuple[str, float], list[RealRun]] = {}
        for run in state.runs:
            groups.setdefault((run.workload, run.level), []).append(run)
        by_name = {w.name: w for w in loads[topology]}
        for (workload, level), runs in groups.items():
            images = by_name[workload].sim_image_args()
            num_image_tokens = by_name[workload].num_image_tokens(profile)
            slo = by_name[workload].slo
            reals = [json.loads(Path(r.result_path).read_text()) for r in runs]
            real_runs = [score(r, slo) for r in reals]
            cell = {"topology": topology, "workload": workload, "load": level, "rate": runs[0].rate, "slo": slo,
                    "num_runs": len(runs), "real_runs": real_runs, "tags": [r.tag for r in runs],
                    "num_cores": len(available_cores()),  # the real servers' host, for every replay
                    "other_work_share": max(r.other_work_share for r in runs),
                    "cpu": [r.cpu for r in runs],
                    "profiles": {k: str(v) for k, v in profiles.items()}}
            if "sim_stretch" in profiles:  # calibrated: each run on its own round's refreshed profile too
                cell["profiles"]["sim_tracked"] = [str(tracked[r.round_index]) for r in runs]
                cell["profiles"]["sim_own"] = [str(own[r.tag]) for r in runs]
            for run, real in zip(runs, reals):
                write_trace(real, out_dir / f"trace_{run.tag}.jsonl", num_image_tokens)
            for key, path in cell["profiles"].items():
                replay_cell(cell, key, path, images, out_dir, "sim", log)
            ratios: dict[str, dict] = {}
            for k, trace_dir in enumerate(state.trace_dirs):
                windows = [r.window for r in runs if r.round_index == k]
                if windows:
                    for role, kinds in step_ratios(trace_dir, windows, attribution_cost).items():
                        for kind, r in kinds.items():
                            acc = ratios.setdefault(role, {}).setdefault(kind, [])
                            acc.append(r)
            cell["step_ratios"] = {role: {kind: _pool_ratios(rs) for kind, rs in kinds.items()}
                                   for role, kinds in ratios.items()}
            cells.append(cell)
    return cells


PROFILE_SUFFIXES = {"sim": "", "sim_tracked": "_tracked", "sim_own": "_own", "sim_stretch": "_stretch",
                    "sim_offline": "_offline"}  # in replay file names
DIAGNOSTIC_KEYS = ("sim_own",)  # reported, never said to meet the goal


def replay_cell(cell: dict, key: str, profile: str | Path | list, images: list[str], out_dir: Path,
                prefix: str, log: list[str], trace: str = "trace") -> None:
    """Each real run of ``cell`` (its replay trace, <trace>_<tag>.jsonl) simulated on ``profile``
    (a list: one profile per run, in the order of the cell's tags): the runs' scores in
    ``cell[key + "_runs"]`` and the judged summary in ``cell[key]``."""
    slo = Slo(*cell["slo"])
    paths = profile if isinstance(profile, list) else [profile] * len(cell["tags"])
    sims = [simulate(Path(path), cell["topology"],
                     ["--workload", "trace", str(out_dir / f"{trace}_{tag}.jsonl"), *images],
                     slo, out_dir / f"{prefix}{PROFILE_SUFFIXES[key]}_{tag}.json", log, cell["num_cores"])
            for tag, path in zip(cell["tags"], paths)]
    cell[f"{key}_runs"] = [score(sim, slo) for sim in sims]
    cell[key] = summarize_cell(cell["real_runs"], cell[f"{key}_runs"])


def _pool_ratios(parts: list[dict]) -> dict:
    """Ratios of several rounds pooled by their step counts (a weighted mean)."""
    valid = [p for p in parts if p["served_over_predicted"] is not None]
    n = sum(p["num_steps"] for p in valid)
    mean = sum(p["served_over_predicted"] * p["num_steps"] for p in valid) / n if n else None
    return {"served_over_predicted": mean, "num_steps": n}


def recalibrate(results: dict, out_dir: Path, log: list[str], first_windows: list[int] | None = None) -> None:
    """The run's calibrations redone by ``epdserve calibrate`` as it is now, on the same step
    traces and windows (the first round's, and the whole stretch's), into ``out_dir``; each
    cell's calibrated profiles are replaced by them. ``first_windows``: only these of the first
    round's calibration runs (0-based, in the order they ran) for the first profile."""
    profile = Path(results["profile"])
    for topology, state in results["states"].items():
        if state["first_profile"] is None:
            continue
        name = topology.replace("=", "").replace(",", "_")
        windows = [(float(a), float(b)) for _, a, b in state["calibration_windows"]]
        first_round = [(float(a), float(b)) for k, a, b in state["calibration_windows"] if k == 0]
        if first_windows is not None:
            if not all(0 <= i < len(first_round) for i in first_windows):
                sys.exit(f"--first-windows: the first round of {topology} has {len(first_round)} calibration runs")
            first_round = [first_round[i] for i in first_windows]
        first = out_dir / f"rejudged_profile_calibrated_{name}.json"
        run_calibrate(profile, Path(state["trace_dirs"][0]), first_round, first, log)
        merged = TopologyState(trace_dirs=[Path(d) for d in state["trace_dirs"]])
        stretch = out_dir / f"rejudged_profile_calibrated_{name}_stretch.json"
        run_calibrate(profile, merged_trace_dir(merged, out_dir / f"rejudged_steps_{name}_all"), windows, stretch, log)
        tracked = tracked_profiles(first, merged.trace_dirs, [(int(k), float(a), float(b))
                                                              for k, a, b in state["calibration_windows"]],
                                   f"rejudged_profile_calibrated_{name}", out_dir, log)
        round_of = {r["tag"]: int(r["round_index"]) for r in state["runs"]}
        runs = [(r["tag"], int(r["round_index"]), tuple(r["window"])) for r in state["runs"]]
        own = own_speed_profiles(first, merged.trace_dirs, runs,
                                 {tag: tracked[k] for tag, k in round_of.items()},
                                 f"rejudged_profile_calibrated_{name}", out_dir, log)
        for cell in results["cells"]:
            if cell["topology"] == topology:
                cell["profiles"].update(sim=str(first), sim_stretch=str(stretch),
                                        sim_tracked=[str(tracked[round_of[tag]]) for tag in cell["tags"]],
                                        sim_own=[str(own[tag]) for tag in cell["tags"]])


def recorded_cores(profile: Path) -> int:
    """The cores of the host a run's offline profile was measured on (a run that measured its
    own), else those this process may use."""
    host = json.loads(profile.read_text()).get("host", {})
    return int(host.get("num_cores") or len(available_cores()))


def rejudge(out_dir: Path, redo_calibration: bool = False, first_windows: list[int] | None = None) -> str:
    """The real runs stored in ``out_dir`` (a finished run's results.json, its bench results and
    replay traces) replayed again in the simulator as it is now, on the profiles that run judged
    on (``redo_calibration``: on calibrations redone as ``epdserve calibrate`` is now, from the
    same traces, ``first_windows`` as ``recalibrate`` takes them; the step-time attribution kept
    either way; the replay traces written again from the stored bench results where they are
    kept, as trace_rejudged_<tag>.jsonl beside the run's own, and those runs scored again as
    ``score`` scores now): a change to the simulator judged without new real runs. Writes
    results_rejudged.json and report_rejudged.md; returns the report."""
    results = json.loads((out_dir / "results.json").read_text(encoding="utf-8"))
    scale = Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in results["scale"].items()})
    log: list[str] = []
    if redo_calibration:
        recalibrate(results, out_dir, log, first_windows)
    cells = results["cells"]
    num_cores = recorded_cores(Path(results["profile"]))
    for cell in cells:  # replayed on the real run's cores, not on those of this process
        cell.setdefault("num_cores", num_cores)
    for cell in cells:
        topology = cell["topology"]
        workload = next(w for w in workloads(scale, topology, results["with_azure"]) if w.name == cell["workload"])
        trace = "trace"  # the run's own replay traces, or written again as judge_runs writes them now
        if all((out_dir / f"real_{tag}.json").exists() for tag in cell["tags"]):
            trace = "trace_rejudged"
            num_image_tokens = workload.num_image_tokens(Path(results["profile"]))
            reals = [json.loads((out_dir / f"real_{tag}.json").read_text()) for tag in cell["tags"]]
            for tag, real in zip(cell["tags"], reals):
                write_trace(real, out_dir / f"{trace}_{tag}.jsonl", num_image_tokens)
            cell["real_runs"] = [score(real, Slo(*cell["slo"])) for real in reals]  # scored as now
        for key, path in cell["profiles"].items():
            replay_cell(cell, key, path, workload.sim_image_args(), out_dir, "rejudged", log, trace)
    judgements = {key: judge(cells, key) for key in PROFILE_KEYS if all(key in c for c in cells)}
    results.update(cells=cells, judgements=judgements, rejudged_commands=log)
    (out_dir / "results_rejudged.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    report = build_report(cells, judgements, scale, results)
    report = report.replace("# sim_fidelity", "# sim_fidelity (stored real runs, replayed again: --rejudge)", 1)
    (out_dir / "report_rejudged.md").write_text(report, encoding="utf-8")
    return report


def choose_scale(quick: bool, rounds: int | None, num_prompts: int | None) -> Scale:
    """FULL or QUICK, with ``--rounds`` and ``--num-prompts`` (every judged and calibration run's
    requests, and the Azure trace's head) where given; ValueError names a bad one."""
    scale = QUICK if quick else FULL
    if rounds is not None:
        if rounds < 1:
            raise ValueError("--rounds must be at least 1")
        scale = replace(scale, rounds=rounds)
    if num_prompts is not None:
        if num_prompts < 2:
            raise ValueError("--num-prompts must be at least 2")
        scale = replace(scale, num_prompts=num_prompts, num_calibration_prompts=num_prompts,
                        azure_num_prompts=num_prompts)
    return scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rejudge", type=Path, default=None, metavar="DIR",
                        help="replay a finished run's stored real runs (DIR/results.json) in the simulator as it is "
                             "now, on the profiles it judged on; no server is started")
    parser.add_argument("--recalibrate", action="store_true",
                        help="with --rejudge: redo the run's calibrations from its step traces first")
    parser.add_argument("--first-windows", default=None, metavar="I,J,..",
                        help="with --recalibrate: calibrate the first profile on only these of the first round's "
                             "calibration runs (0-based, in the order they ran)")
    parser.add_argument("--profile", type=Path, default=None, help="profile.json (default: measure one first)")
    parser.add_argument("--out", type=Path, default=Path("out/sim_fidelity"))
    parser.add_argument("--topology", "--only", dest="topologies", action="append", choices=list(TOPOLOGIES),
                        default=None, help="run this topology (repeat for several; default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--rounds", type=int, default=None,
                        help="real runs per cell, each on a fresh server (default: 3; --quick: 2)")
    parser.add_argument("--num-prompts", type=int, default=None, metavar="N",
                        help="requests per judged run and per calibration run, and the Azure trace's first N "
                             f"(default: {FULL.num_prompts} per run, {FULL.num_calibration_prompts} per "
                             "calibration run; fewer for a host too slow to serve them in time: P99s rest on "
                             "fewer requests)")
    parser.add_argument("--no-azure", action="store_true", help="no Azure trace cells (random and images only)")
    parser.add_argument("--busy-neighbours", action="store_true",
                        help="profile each role next to a busy worker on the other core (epdserve profile flag)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="simulate on the offline profile only (no calibration run)")
    parser.add_argument("--max-wait-idle-s", type=float, default=600.0,
                        help="before each level, wait up to this long for other work to leave the CPUs")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help=f"TTFT SLO (default, per workload: {host_slo.TTFT_PREFILLS:g} x one request's prefill, "
                             "and encode with images, on the profile)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help=f"TPOT SLO (default: {host_slo.TPOT_STEPS:g} x a decode step of one sequence on the profile)")
    ns = parser.parse_args(argv)
    if ns.rejudge is not None:
        if not (ns.rejudge / "results.json").is_file():
            parser.error(f"--rejudge: no results.json in {ns.rejudge}")
        first_windows = None
        if ns.first_windows is not None:
            if not ns.recalibrate:
                parser.error("--first-windows goes with --recalibrate")
            try:
                first_windows = [int(i) for i in ns.first_windows.split(",")]
            except ValueError:
                parser.error(f"--first-windows: comma-separated run indices, got {ns.first_windows!r}")
        print(rejudge(ns.rejudge, ns.recalibrate, first_windows))
        return 0
    if ns.recalibrate or ns.first_windows is not None:
        parser.error("--recalibrate and --first-windows go with --rejudge")
    try:
        scale = choose_scale(ns.quick, ns.rounds, ns.num_prompts)
    except ValueError as e:
        parser.error(str(e))
    for flag, value in (("--slo-ttft-ms", ns.slo_ttft_ms), ("--slo-tpot-ms", ns.slo_tpot_ms)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be positive")
    out_dir: Path = ns.out
    out_dir.mkdir(parents=True, exist_ok=True)
    busy = cpu_busy_share()
    print(f"CPU busy with other work before the start: {100 * busy:.0f} %", flush=True)
    commands: list[str] = []
    topologies = selected_topologies(ns.topologies)
    profile = ns.profile
    if profile is None:
        wait_for_idle([], ns.max_wait_idle_s)
        profile = out_dir / "profile.json"
        run_logged(epdserve("profile", "--roles", profile_roles(topologies), "--threads", "colocated=1",
                            *ENGINE_FLAGS, "--out", str(profile), "--disable-tqdm",
                            *(["--busy-neighbours"] if ns.busy_neighbours else []),
                            *(["--quick"] if scale.profile_quick else [])), commands)
    loads = {t: [with_slo(w, profile, scale, ns.slo_ttft_ms, ns.slo_tpot_ms)
                 for w in workloads(scale, t, not ns.no_azure)] for t in topologies}
    slos = {w.name: w.slo for ws in loads.values() for w in ws}
    for name, slo in slos.items():
        print(f"SLO of {name}: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms", flush=True)
    started = time.time()
    states = {t: TopologyState() for t in topologies}
    for t in topologies:  # the offline estimate: the warm-up's and calibration runs' rates, and without calibration the levels'
        states[t].capacities = {w.name: estimate_capacity(profile, t, w, scale, out_dir / "capacity", commands)
                                for w in loads[t]}
    for s in states.values():
        s.offline_capacities = dict(s.capacities)
    offline_capacities = {t: dict(s.capacities) for t, s in states.items()}
    drift = [probe_drift(scale, out_dir / "drift_r0.json", commands)]
    for round_index in range(scale.rounds):
        for t in topologies:
            run_round(t, round_index, profile, states[t], loads[t], scale, out_dir, commands, ns.max_wait_idle_s,
                      not ns.no_calibrate)
        drift.append(probe_drift(scale, out_dir / f"drift_r{round_index + 1}.json", commands))
    cells = judge_runs(states, loads, profile, scale, out_dir, commands, not ns.no_calibrate)
    judgements = {key: judge(cells, key) for key in PROFILE_KEYS if all(key in c for c in cells)}
    results = {"scale": scale.__dict__, "capacities": {t: s.capacities for t, s in states.items()},
               "offline_capacities": offline_capacities, "with_azure": not ns.no_azure,
               "workloads": {t: [w.name for w in ws] for t, ws in loads.items()},
               "slos": {name: slo._asdict() for name, slo in slos.items()}, "cells": cells,
               "judgements": judgements, "host_drift": drift, "busy_at_start": busy, "profile": str(profile),
               "states": {t: {"trace_dirs": [str(d) for d in s.trace_dirs], "calibration_windows": s.calibration_windows,
                              "first_profile": None if s.first_profile is None else str(s.first_profile),
                              "runs": [r.__dict__ for r in s.runs]} for t, s in states.items()},
               "commands": commands, "wall_s": time.time() - started}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    write_plots(cells, out_dir)
    report = build_report(cells, judgements, scale, results)
    (out_dir / "report.md").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
