"""The work behind ``epdserve plan``: throughputs at the SLO, the formula, the search, the
verdict and a longer validation run of the chosen configuration (see ``planner.plan``)."""

from __future__ import annotations

import argparse

import numpy as np

from epdserve.errors import ConfigError
from epdserve.planner.capacity import (
    Candidate,
    Capacity,
    ProbeSpec,
    max_rate,
    normalized,
    saturation_rate,
    simulate_at,
)
from epdserve.planner.plan import (
    counts_for_budget,
    counts_for_rate,
    decode_throughput_at_slo,
    encode_throughput_at_slo,
    estimate_prefix_hit_rate,
    normalize_ratio,
    role_work,
)
from epdserve.planner.search import enumerate_candidates, search
from epdserve.planner.slo import SLO, parse_slo, tpot_slo_ms, ttft_slo_ms
from epdserve.sim.cli import sim_config_kwargs
from epdserve.sim.cost_model import CostModel
from epdserve.sim.topology import Topology
from epdserve.sim.workload import SimWorkload, poisson_arrivals, random_workload, trace_workload

DEFAULT_INSTANCES = 8
DEFAULT_SEQS_CHOICES = (0, 64)  # 0: the profile's max_num_seqs
HORIZON_FACTOR = 2  # probe runs span this many request lifetimes (TTFT + output x TPOT SLOs)
VALIDATION_FACTOR = 5  # the validation run is this many times longer than a probe
VALIDATION_STEP = 0.95  # a failed validation retries at this fraction of the rate
MAX_VALIDATION_RUNS = 6


def _workload(ns: argparse.Namespace, num_requests: int) -> SimWorkload:
    kind = ns.workload[0]
    tiles = ns.image_tiles if ns.images_per_request else 0
    if kind == "random" and len(ns.workload) == 1:
        return random_workload(num_requests, 1.0, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                               ns.burstiness, ns.seed, ns.images_per_request, tiles)
    if kind == "trace" and len(ns.workload) == 2:
        return trace_workload(ns.workload[1], ns.time_scale, ns.length_scale, None, None, None, False,
                              ns.images_per_request, tiles)
    raise ConfigError("--workload must be 'random' or 'trace FILE'")


def auto_slo_ms(cost: CostModel, workload: SimWorkload, metric: str, percentile: float) -> float:
    """An ``auto`` threshold of ``--slo``, sized to this profile's host for the workload's
    ``percentile``-th prompt (image tokens and encode included): TTFT ``slo.ttft_slo_ms`` on the
    colocated role's cost (else the prefill role's); TPOT ``slo.tpot_slo_ms`` at that prompt plus
    half the mean output, on the colocated role's cost (else the decode role's)."""
    if not len(workload):
        raise ConfigError("an 'auto' SLO needs a workload with requests")
    tiles = workload.num_images * workload.tiles_per_image
    prompt = int(np.percentile(workload.input_lens, percentile)) + (cost.encoder().tokens_per_tile * tiles if tiles else 0)
    fallback = "prefill" if metric == "ttft" else "decode"
    role = "colocated" if "colocated" in cost.roles else fallback
    if role not in cost.roles:
        raise ConfigError(f"an 'auto' {metric} SLO needs the profile's colocated or {fallback} role")
    step = cost.role(role).step
    if metric == "ttft":
        encode_s = workload.num_images * cost.encoder().time_s(workload.tiles_per_image) if tiles else 0.0
        return ttft_slo_ms(step, prompt, encode_s)
    return tpot_slo_ms(step, prompt + int(workload.mean_output_len // 2))


def _seqs_choices(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_SEQS_CHOICES
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--seqs-choices takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ConfigError("--seqs-choices values must be >= 1 (0: the profile's)")
    return values


def _formula(cost: CostModel, slo: SLO, attainment: float, base: SimWorkload, spec: ProbeSpec,
             num_image_tokens: int, mean_prompt: float, mean_output: float, hit_rate: float, config: dict,
             num_instances: int, rate: float | None) -> tuple[dict, int]:
    """The formula's ratio and counts, and the simulations it ran."""
    if "prefill" not in cost.roles or "decode" not in cost.roles:
        return {"ratio": None, "reason": "the profile has no prefill and decode roles"}, 0
    images = base.num_images
    # Thr_P: one prefill instance, prompts only (one output token: decode does no work),
    # image tokens as text, no shared prefixes (the hit rate discounts the work instead) and
    # Poisson arrivals (a trace's bursts are the search's business: a pool absorbs them).
    prompts = SimWorkload("prefill-only", poisson_arrivals(len(base), 1.0, 1.0, 0), base.input_lens + num_image_tokens,
                          np.ones(len(base), dtype=np.int64))
    one = Candidate(Topology(num_prefill=1, num_decode=1), (("decode", 1 << 20),))
    hint = saturation_rate(cost, one, float(prompts.mean_input_len), 1.0, 0.0, 0, 0, 1)
    cap = max_rate(cost, one, prompts, slo, attainment, hint, config, spec)
    if cap.max_rate <= 0:
        lowest = min(rate for rate, _ in cap.probes)
        return {"ratio": None, "reason": f"one prefill instance misses the TTFT SLO even at {lowest:.3g} req/s"}, \
            cap.num_sims
    thr_p = cap.max_rate * float(prompts.mean_input_len)
    d = cost.role("decode")
    dec = decode_throughput_at_slo(d.step, slo.threshold_s("tpot"), mean_prompt + mean_output / 2, d.max_num_seqs,
                                   d.num_kv_blocks, cost.block_size)
    thr_e = None
    if images:
        thr_e = encode_throughput_at_slo(cost.encoder(), base.tiles_per_image, slo.threshold_s("ttft"),
                                         config["encode_max_batch_images"])
    work = role_work(mean_prompt, mean_output, thr_p, dec.tokens_per_s, hit_rate, images, thr_e)
    formula = {
        "ratio": normalize_ratio(work),
        "work_s_per_request": work,
        "throughputs": {"prefill_tokens_per_s": thr_p, "decode_tokens_per_s": dec.tokens_per_s,
                        **({"encode_images_per_s": thr_e} if thr_e else {})},
        "decode_batch_at_slo": dec.batch,
        "decode_step_s_at_slo": dec.step_s,
        "is_decode_within_slo": dec.is_within_slo,
        "prefill_max_rate": cap.max_rate,
        "prefix_hit_rate": hit_rate,
        "counts_for_budget": counts_for_budget(work, num_instances) if num_instances >= len(work) else None,
    }
    if rate is not None:
        formula.update(rate=rate, counts_for_rate=counts_for_rate(work, rate))
    return formula, cap.num_sims


def _best(results: list[Capacity], split: bool) -> Capacity | None:
    pool = [c for c in results if c.candidate.topology.is_split == split and c.max_rate > 0]
    return max(pool, key=lambda c: (c.goodput_per_instance, c.max_rate), default=None)


def make_plan(ns: argparse.Namespace) -> dict:
    cost = CostModel.load(ns.profile)
    if not 0 < ns.attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {ns.attainment}")
    num_instances = ns.instances if ns.instances is not None else DEFAULT_INSTANCES
    if num_instances < 1:
        raise ConfigError(f"--instances must be >= 1, got {num_instances}")
    if ns.search_requests < 10 or ns.search_max_requests < ns.search_requests:
        raise ConfigError("--search-requests must be >= 10 and <= --search-max-requests")
    if ns.rate is not None and not ns.rate > 0:
        raise ConfigError(f"--rate must be > 0, got {ns.rate}")
    workload = _workload(ns, ns.search_max_requests * VALIDATION_FACTOR)
    slo = parse_slo(ns.slo, auto=lambda metric, percentile: auto_slo_ms(cost, workload, metric, percentile))
    mean_output = workload.mean_output_len
    slo_lifetime_s = slo.threshold_s("ttft") + mean_output * slo.threshold_s("tpot")
    spec = ProbeSpec(ns.search_requests, HORIZON_FACTOR * slo_lifetime_s, min(len(workload), ns.search_max_requests))
    base = normalized(workload.head(spec.max_requests))
    num_image_tokens = workload.num_images * workload.tiles_per_image * (cost.encoder().tokens_per_tile if workload.num_images else 0)
    mean_prompt = workload.mean_input_len + num_image_tokens
    hit_rate = ns.prefix_hit_rate
    if hit_rate is None:
        hit_rate = estimate_prefix_hit_rate(workload.hash_ids, workload.input_lens, workload.block_tokens)
    elif not 0 <= hit_rate < 1:
        raise ConfigError(f"--prefix-hit-rate must be in [0, 1), got {hit_rate}")
    # Inter-token gaps are kept only when the SLO names ITL (they cost memory and time).
    config = {**sim_config_kwargs(ns), "max_detail_requests": len(workload) if slo.target("itl") else 0}
    formula, num_formula_sims = _formula(cost, slo, ns.attainment, base, spec, num_image_tokens, mean_prompt,
                                         mean_output, hit_rate, config, num_instances, ns.rate)

    candidates = enumerate_candidates(num_instances, _seqs_choices(ns.seqs_choices), bool(workload.num_images))
    candidates = [c for c in candidates if all(r in cost.roles for r in c.topology.roles if r != "encode")]
    if not candidates:
        raise ConfigError("no configuration fits the budget with the profile's roles")

    def estimate(c: Candidate) -> float:
        """Requests/s the candidate should carry: for a split one the formula's per-role rates
        at the SLO, capped by saturation; for a colocated one its saturation rate."""
        saturation = saturation_rate(cost, c, workload.mean_input_len, mean_output, hit_rate, workload.num_images,
                                     workload.tiles_per_image, config["encode_max_batch_images"])
        if not c.topology.is_split or not formula.get("ratio"):
            return saturation
        d = cost.role("decode")
        seqs = dict(c.max_num_seqs).get("decode", d.max_num_seqs)
        dec = decode_throughput_at_slo(d.step, slo.threshold_s("tpot"), mean_prompt + mean_output / 2, seqs,
                                       d.num_kv_blocks, cost.block_size)
        prefill_rate = formula["prefill_max_rate"] / (1 - hit_rate)
        return min(saturation, c.topology.num_prefill * prefill_rate,
                   c.topology.num_decode * dec.tokens_per_s / mean_output)

    found = search(cost, candidates, estimate, base, slo, ns.attainment, config, spec, ns.workers,
                   ns.time_budget_s or None)
    best_split, best_colocated = _best(found.results, True), _best(found.results, False)
    verdict, chosen = _verdict(best_split, best_colocated)
    validation = _validate(cost, chosen, workload, spec, slo, ns.attainment, config) if chosen else None
    ranked = sorted(found.results, key=lambda c: -c.goodput_per_instance)
    return {
        "slo": slo.spec,
        "slo_thresholds_ms": {t.key: t.threshold_ms for t in slo.targets},
        "attainment": ns.attainment,
        "instances": num_instances,
        "workload": workload.name,
        "mean_prompt_len": mean_prompt,
        "mean_output_len": mean_output,
        "formula_ratio": formula,
        "best_split": best_split.to_dict() if best_split else None,
        "best_colocated": best_colocated.to_dict() if best_colocated else None,
        "verdict": verdict,
        "max_rate": validation["max_rate"] if validation else 0.0,
        "validation": validation,
        "search": {
            "num_candidates": found.num_candidates,
            "num_simulated": len(found.results),
            "num_pruned": found.num_pruned,
            "num_dominated": found.num_dominated,
            "num_skipped": found.num_skipped,
            "num_sims": sum(c.num_sims for c in found.results) + num_formula_sims,
            "min_requests_per_sim": spec.min_requests,
            "max_requests_per_sim": spec.max_requests,
            "horizon_s": spec.horizon_s,
            "search_s": found.search_s,
            "num_workers": found.num_workers,
        },
        "candidates": [{**c.to_dict(), "estimate_rate": found.estimates[c.candidate]} for c in ranked],
    }


def _validate(cost: CostModel, chosen: Capacity, workload: SimWorkload, spec: ProbeSpec, slo: SLO,
              attainment: float, config: dict) -> dict:
    """Rerun the chosen configuration ``VALIDATION_FACTOR`` times longer than a probe, from the
    search's rate down in ``VALIDATION_STEP`` steps until the SLO holds: short runs are
    optimistic near saturation (a queue that grows slowly has not grown yet)."""
    rate = chosen.max_rate
    runs = []
    for _ in range(MAX_VALIDATION_RUNS):
        num = min(len(workload), VALIDATION_FACTOR * spec.num_requests(rate))
        point = simulate_at(cost, chosen.candidate, normalized(workload.head(num)), rate, slo, attainment, config)
        runs.append({"rate": rate, "num_requests": num, "attainment": point.attainment, "is_met": point.is_met,
                     "is_aborted": point.is_aborted, "percentiles_ms": point.percentiles_ms})
        if point.is_met:
            return {"max_rate": rate, "search_max_rate": chosen.max_rate, "runs": runs}
        rate *= VALIDATION_STEP
    return {"max_rate": 0.0, "search_max_rate": chosen.max_rate, "runs": runs}


def _verdict(split: Capacity | None, colocated: Capacity | None) -> tuple[dict, Capacity | None]:
    if split is None and colocated is None:
        return {"choice": "none", "reason": "no configuration meets the SLO at any simulated rate"}, None
    if split is None or colocated is None:
        only = split or colocated
        kind = "split" if split else "colocated"
        return {"choice": kind, "reason": f"only {kind} configurations meet the SLO",
                "configuration": only.candidate.to_dict()}, only
    a, b = split.goodput_per_instance, colocated.goodput_per_instance
    chosen, kind = (split, "split") if a > b else (colocated, "colocated")
    ratio = max(a, b) / min(a, b) if min(a, b) > 0 else float("inf")
    return {
        "choice": kind,
        "reason": f"goodput per instance: split {a:.3f} vs colocated {b:.3f} req/s ({ratio:.2f}x)",
        "split_goodput_per_instance": a,
        "colocated_goodput_per_instance": b,
        "configuration": chosen.candidate.to_dict(),
    }, chosen
