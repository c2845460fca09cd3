"""``epdserve plan``: the E:P:D ratio for a workload and SLO, a simulated search over instance
counts, and the colocated-versus-split verdict for one instance budget.

1. Formula (the seeds' rule): each role's instance-seconds per request,

       prefill: mean input tokens x (1 - prefix hit rate) / Thr_P
       decode:  mean output tokens / Thr_D
       encode:  images per request / Thr_E

   where each Thr is ONE instance's throughput at the SLO under the workload's lengths:
   Thr_P from simulating one prefill instance at rising rates (highest rate meeting the TTFT
   SLO x mean prompt tokens), Thr_D from the largest decode batch whose step time is within
   the TPOT SLO and whose KV fits at the mean context, Thr_E from the largest image batch
   within the TTFT SLO. n_E : n_P : n_D is proportional to those instance-seconds.
2. Search (DistServe's method): every colocated=n and prefill=p,decode=d within the budget
   (and per-role max_num_seqs choices), each at its highest rate meeting the SLO
   (``planner.capacity``); objective: goodput per instance.
3. Verdict: best colocated against best split for the same budget, and the highest
   admissible rate of the winner (what to configure admission with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.sim.cost_model import EncodeCost, StepCost

ROLE_ORDER = ("encode", "prefill", "decode")


@dataclass(frozen=True)
class DecodeCapacity:
    batch: int  # sequences per step
    step_s: float
    tokens_per_s: float
    is_within_slo: bool  # False: even one sequence per step exceeds the TPOT SLO


def decode_throughput_at_slo(step: StepCost, tpot_slo_s: float, mean_context: float, max_num_seqs: int,
                             num_kv_blocks: int, block_size: int) -> DecodeCapacity:
    """Output tokens/s of one decode instance: the largest batch whose step time is within the
    TPOT SLO and whose KV (mean context per sequence) fits in the instance's blocks."""
    blocks_per_seq = max(1, math.ceil(mean_context / block_size))
    max_batch = max(1, min(max_num_seqs, (num_kv_blocks - 1) // blocks_per_seq))

    def step_s(batch: int) -> float:
        return step.time_s(StepShape(0, 0, batch, round(batch * mean_context)))

    if step_s(1) > tpot_slo_s:
        return DecodeCapacity(1, step_s(1), 1 / step_s(1), False)
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid) <= tpot_slo_s:
            lo = mid
        else:
            hi = mid - 1
    return DecodeCapacity(lo, step_s(lo), lo / step_s(lo), True)


def encode_throughput_at_slo(encode: EncodeCost, tiles_per_image: int, ttft_slo_s: float,
                             max_batch_images: int) -> float:
    """Images/s of one encoder at the largest batch whose time is within the TTFT SLO."""
    batch = max_batch_images
    while batch > 1 and encode.time_s(batch * tiles_per_image) > ttft_slo_s:
        batch -= 1
    return batch / encode.time_s(batch * tiles_per_image)


def role_work(mean_input: float, mean_output: float, thr_prefill: float, thr_decode: float,
              prefix_hit_rate: float = 0.0, images_per_request: float = 0.0,
              thr_encode: float | None = None) -> dict[str, float]:
    """Instance-seconds each role spends per request (the load of one request per second)."""
    if not 0.0 <= prefix_hit_rate < 1.0:
        raise ConfigError(f"prefix hit rate must be in [0, 1), got {prefix_hit_rate}")
    if thr_prefill <= 0 or thr_decode <= 0:
        raise ConfigError("throughputs must be > 0")
    work = {"prefill": mean_input * (1 - prefix_hit_rate) / thr_prefill, "decode": mean_output / thr_decode}
    if images_per_request:
        if not thr_encode or thr_encode <= 0:
            raise ConfigError("images need an encoder throughput > 0")
        work["encode"] = images_per_request / thr_encode
    return {role: work[role] for role in ROLE_ORDER if role in work}


def normalize_ratio(work: dict[str, float]) -> dict[str, float]:
    """Scale so the smallest nonzero entry is 1."""
    smallest = min(v for v in work.values() if v > 0)
    return {role: v / smallest for role, v in work.items()}


def counts_for_budget(work: dict[str, float], num_instances: int) -> dict[str, int]:
    """Split ``num_instances`` in proportion to ``work`` by largest remainder; a role left
    with none takes one from the role holding the most."""
    roles = [r for r in work if work[r] > 0]
    if num_instances < len(roles):
        raise ConfigError(f"{num_instances} instances cannot hold one of each of {', '.join(roles)}")
    total = sum(work[r] for r in roles)
    exact = {r: num_instances * work[r] / total for r in roles}
    counts = {r: math.floor(exact[r]) for r in roles}
    left = num_instances - sum(counts.values())
    for r in sorted(roles, key=lambda r: exact[r] - counts[r], reverse=True)[:left]:
        counts[r] += 1
    for r in roles:
        if counts[r] == 0:
            donor = max(roles, key=lambda d: counts[d])
            counts[donor] -= 1
            counts[r] = 1
    return counts


def counts_for_rate(work: dict[str, float], rate: float) -> dict[str, int]:
    """Instances each role needs to carry ``rate`` requests/s: ceil(load / Thr), at least 1."""
    return {role: max(1, math.ceil(rate * w - 1e-9)) for role, w in work.items() if w > 0}


def estimate_prefix_hit_rate(hash_ids: tuple[tuple[int, ...], ...] | None, input_lens, block_tokens: int) -> float:
    """Fraction of prompt tokens in leading trace blocks that an earlier request already had
    (an unbounded prefix cache: an upper estimate)."""
    if not hash_ids:
        return 0.0
    seen: set = set()
    num_hit = num_total = 0
    for ids, n in zip(hash_ids, input_lens):
        n = int(n)
        num_total += n
        chain = ()
        prefix = 0
        is_leading = True
        for h in ids:
            chain = chain + (h,)
            if is_leading and chain in seen:
                prefix += block_tokens
            else:
                is_leading = False
                seen.add(chain)
        num_hit += min(prefix, max(0, n - 1))
    return num_hit / num_total if num_total else 0.0


def format_plan(plan: dict) -> str:
    """The table ``epdserve plan`` prints."""
    width = 78
    lines = ["=" * width, f"{' Plan ':=^{width}}", (f"SLO {plan['slo']} at >= {plan['attainment']:.0%} attainment; "
             f"budget {plan['instances']} instances; workload {plan['workload']}")]
    f = plan["formula_ratio"]
    if f.get("ratio"):
        ratio = " : ".join(f"{r} {v:.2f}" for r, v in f["ratio"].items())
        lines.append(f"formula  {ratio}   (Thr: " + ", ".join(f"{r} {v:.4g}" for r, v in f["throughputs"].items())
                     + f"; prefix hit {f['prefix_hit_rate']:.2f})")
        if f.get("counts_for_budget"):
            lines.append("         for the budget: " + ",".join(f"{r}={n}" for r, n in f["counts_for_budget"].items()))
        if f.get("counts_for_rate"):
            lines.append(f"         for {f['rate']:g} req/s: " + ",".join(f"{r}={n}" for r, n in f["counts_for_rate"].items()))
    else:
        lines.append(f"formula  not available: {f.get('reason', '')}")
    lines.append("-" * width)
    lines.append(f"{'configuration':<44}{'max rate':>10}{'goodput':>10}{'per inst':>10}")
    for key in ("best_colocated", "best_split"):
        c = plan.get(key)
        if c:
            label = c["topology"] + (f" seqs {c['max_num_seqs']}" if c["max_num_seqs"] else "")
            lines.append(f"{label[:44]:<44}{c['max_rate']:>10.3f}{c['goodput']:>10.3f}{c['goodput_per_instance']:>10.3f}")
    lines.append("-" * width)
    v = plan["verdict"]
    lines.append(f"verdict: {v['choice']} ({v['reason']})")
    val = plan.get("validation")
    if val:
        lines.append(f"max rate {plan['max_rate']:.3f} req/s (search {val['search_max_rate']:.3f}; validated with "
                     f"{val['runs'][-1]['num_requests']} requests): configure admission with it")
    s = plan["search"]
    lines.append(f"search: {s['num_candidates']} candidates, {s['num_simulated']} simulated, {s['num_pruned']} pruned, "
                 f"{s['num_dominated']} dominated, {s['num_skipped']} left; {s['num_sims']} simulations in "
                 f"{s['search_s']:.1f} s on {s['num_workers']} processes")
    lines.append("=" * width)
    return "\n".join(lines)
