"""What benchmarks/sim_fidelity.py sends and replays per topology: the E/P/D topology's images
workload on both sides, the image tokens taken off the replayed prompts, the SLO per workload,
topology selection and the warm-up's KV-pool cycling."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

from sim_profiles import profile_dict

from epdserve.cli import build_parser
from epdserve.sim.cli import build_workload

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_fidelity.py"
_spec = importlib.util.spec_from_file_location("sim_fidelity", _PATH)
sim_fidelity = importlib.util.module_from_spec(_spec)
sys.modules["sim_fidelity"] = sim_fidelity  # its dataclasses look their module up
_spec.loader.exec_module(sim_fidelity)

EPD = "encode=1,prefill=1,decode=1"
SCALE = sim_fidelity.FULL


def parse(args: list[str]):
    return build_parser().parse_args(args)


def test_each_topology_gets_its_workloads():
    names = {t: [w.name for w in sim_fidelity.workloads(SCALE, t, True)] for t in sim_fidelity.TOPOLOGIES}
    assert names == {"colocated=2": ["random", "azure"], "prefill=1,decode=1": ["random", "azure"], EPD: ["images"]}
    assert [w.name for w in sim_fidelity.workloads(SCALE, "prefill=1,decode=1", False)] == ["random"]
    assert sim_fidelity.workloads(SCALE, EPD, True)[0].levels == SCALE.load_levels
    assert sim_fidelity.warmup_workload(sim_fidelity.workloads(SCALE, EPD, True)).name == "images"
    assert sim_fidelity.warmup_workload(sim_fidelity.workloads(SCALE, "colocated=2", True)).name == "random"


def test_epd_serves_three_workers_with_the_vision_tower():
    ns = parse(["serve", *sim_fidelity.TOPOLOGIES[EPD], *sim_fidelity.ENGINE_FLAGS])
    assert (ns.encode_workers, ns.prefill_workers, ns.decode_workers, ns.cores_per_worker) == (1, 1, 1, 1)
    assert ns.vision == "default"


def test_images_workload_sends_one_one_tile_image_per_request():
    images = sim_fidelity.workloads(SCALE, EPD, True)[0]
    ns = parse(["bench", "serve", "--base-url", "http://x", *images.bench_args(SCALE, 2.0, 7)])
    assert (ns.dataset, ns.endpoint, ns.random_mm_base_items_per_request) == ("random-mm", "/v1/chat/completions", 1)
    assert ns.random_mm_num_mm_items_range_ratio == 0.0 and ns.ignore_eos
    assert ns.random_mm_resolutions == sim_fidelity.IMAGE_RESOLUTION
    width, height = (int(x) for x in ns.random_mm_resolutions.split("x"))
    assert max(width, height) <= 512  # one tile of the default tower
    # the text part is the random workload's
    random = sim_fidelity.workloads(SCALE, "colocated=2", False)[0]
    text = parse(["bench", "serve", "--base-url", "http://x", *random.bench_args(SCALE, 2.0, 7)])
    for key in ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio", "request_rate", "seed"):
        assert getattr(ns, key) == getattr(text, key)
    assert text.dataset == "random" and text.endpoint == "/v1/completions"


def test_images_workload_simulates_one_tile_per_request():
    images = sim_fidelity.workloads(SCALE, EPD, True)[0]
    ns = parse(["simulate", "--profile", "p.json", "--topology", EPD, *images.sim_args(SCALE, 2.0)])
    w = build_workload(ns)
    assert (w.num_images, w.tiles_per_image, len(w)) == (1, 1, SCALE.num_prompts)
    random = sim_fidelity.workloads(SCALE, "colocated=2", False)[0]
    assert random.sim_image_args() == []
    assert "--images-per-request" not in random.sim_args(SCALE, 2.0)


def test_write_trace_takes_the_image_tokens_off_what_the_server_counted(tmp_path: Path):
    # server counts: template + text + 256 image tokens; the failed request's count is the dataset's
    result = {"start_times": [0.0, 0.5, 1.25], "input_lens": [300, 280, 250], "output_lens": [96, 90, 0],
              "errors": ["", "", "server error: boom"]}
    path = tmp_path / "trace.jsonl"
    sim_fidelity.write_trace(result, path, num_image_tokens=256)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["input_length"] for r in records] == [44, 24, 250]
    assert [r["output_length"] for r in records] == [96, 90, 0]
    assert [r["timestamp"] for r in records] == [0.0, 500.0, 1250.0]
    # the replay adds them back: the simulated prompts are the server's
    images = sim_fidelity.workloads(SCALE, EPD, True)[0]
    ns = parse(["simulate", "--profile", "p.json", "--topology", EPD, "--workload", "trace", str(path),
                *images.sim_image_args()])
    w = build_workload(ns)
    assert w.input_lens.tolist() == [44, 24, 250] and w.num_images == 1
    sim_fidelity.write_trace(result, path)  # text workloads: as counted
    assert [json.loads(line)["input_length"] for line in path.read_text().splitlines()] == [300, 280, 250]


def test_topology_selection_and_profile_roles():
    assert sim_fidelity.selected_topologies(None) == list(sim_fidelity.TOPOLOGIES)
    assert sim_fidelity.selected_topologies([EPD, "colocated=2", EPD]) == ["colocated=2", EPD]
    assert sim_fidelity.profile_roles(["colocated=2", "prefill=1,decode=1"]) == "colocated,prefill,decode"
    assert sim_fidelity.profile_roles([EPD]) == "colocated,prefill,decode,encode"
    assert sim_fidelity.has_encode(EPD) and not sim_fidelity.has_encode("prefill=1,decode=1")


def test_pool_cycling_skips_roles_without_a_kv_pool(tmp_path: Path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"block_size": 16, "roles": {
        "prefill": {"num_kv_blocks": 1000}, "decode": {"num_kv_blocks": 2000},
        "encode": {"num_threads": 1, "tokens_per_tile": 256}}}))
    scale = replace(SCALE, input_len=256, output_len=96)
    # prefill: 16 blocks a request; decode: 22 (256 + 96 tokens)
    assert sim_fidelity.pool_cycling_prompts(profile, "prefill=1,decode=1", scale) == max(-(-1000 // 16), -(-2000 // 22))
    # with 256 image tokens: prefill 32 blocks, decode 38
    assert sim_fidelity.pool_cycling_prompts(profile, EPD, scale, 256) == max(-(-1000 // 32), -(-2000 // 38))


def test_slo_from_profile_counts_the_image_per_workload(tmp_path: Path):
    # synthetic profile: step 10 ms + 1 ms a prompt token + 2 ms a decode sequence; a tile is
    # 16 tokens, encoded in 2 + 50 ms
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    scale = replace(SCALE, input_len=100, output_len=20)
    random, images = (sim_fidelity.workloads(scale, t, False)[0] for t in ("colocated=2", EPD))
    assert images.num_image_tokens(profile) == 16 and random.num_image_tokens(profile) == 0
    assert sim_fidelity.slo_from_profile(profile, scale, random) == (4 * 110.0, 5 * 12.0)
    assert sim_fidelity.slo_from_profile(profile, scale, images) == (round(4 * (10 + 116 + 52), -1), 5 * 12.0)
    given = sim_fidelity.with_slo(images, profile, scale, 500.0, None)
    assert given.slo == (500.0, 60.0) and given.levels == images.levels


def test_report_takes_every_topology_and_workload_alike():
    real = [{m: 100.0 for m in sim_fidelity.METRICS}, {m: 110.0 for m in sim_fidelity.METRICS}]
    cells = [{"topology": t, "workload": w, "load": 1.0, "rate": 0.5, "sim": sim_fidelity.summarize_cell(real, real),
              "step_ratios": {}}
             for t, w in (("colocated=2", "random"), ("prefill=1,decode=1", "random"), (EPD, "images"))]
    results = {"host_drift": [None], "capacities": {c["topology"]: {c["workload"]: 0.5} for c in cells},
               "workloads": {c["topology"]: [c["workload"]] for c in cells},
               "slos": {"random": {"ttft_ms": 500.0, "tpot_ms": 60.0}, "images": {"ttft_ms": 900.0, "tpot_ms": 60.0}},
               "busy_at_start": 0.0, "profile": "profile.json", "commands": []}
    judgements = {"sim": sim_fidelity.judge(cells, "sim")}
    report = sim_fidelity.build_report(cells, judgements, SCALE, results)
    assert "| 1E1P1D images 1x |" in report and "| encode=1,prefill=1,decode=1 | images | 1x |" in report
    assert "Images workload: the random workload's requests, each with 1 image of 256x256 pixels" in report
    assert "(on co×2, 1P1D)" in report and "(on 1E1P1D)" in report
    assert "SLO: random: TTFT ≤ 500 ms and TPOT ≤ 60 ms; images: TTFT ≤ 900 ms and TPOT ≤ 60 ms" in report
    assert "15 of 15 cell-metrics" in report
