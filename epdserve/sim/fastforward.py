"""Fast-forward through decode-only stretches, with the same result as stepping.

When a colocated or decode instance has nothing waiting and every running request is
decoding, each of its next steps computes one token per request until the first of them
finishes. Those steps differ only in their context lengths (+1 token per request per step),
so their end times are known in advance:

    t_j = t_{j-1} + StepCost.time_s(StepShape(0, 0, D, C + (j-1) * D))      j = 1 .. K

computed with the same float operations as stepping. The stretch stops one step before the
first request's last token (that step runs normally, so finishing stays in the scheduler's
hands) and never needs more KV blocks than are free (so no preemption can happen in it).

The scheduler's state after k steps is then produced with the engine's own KV manager:
one ``allocate`` per request for its k tokens (the same block count stepping allocates, from
the same free queue; only which request holds which fresh block id differs, and fresh blocks
carry no content), ``num_computed_tokens += k``, k dummy tokens, and ``cache_computed_blocks``.
A request that joins the instance mid-stretch (an arrival, a KV hand-off) ends the stretch
with the step in flight (``truncate``): that step runs the batch it started with, and the
new request is scheduled from the next step on. A decode instance's reservation changes no
running sequence: it takes its blocks at once and leaves the stretch running while they fit
beside all of the stretch's blocks (``free_after``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate, repeat

from epdserve.cluster import messages as m
from epdserve.request import Request
from epdserve.sim.instance import StepInstance

MIN_STEPS = 3  # shorter stretches are stepped


class Stretch:
    __slots__ = ("ends", "free0", "requests", "step_s", "tables", "tokens")

    def __init__(self, ends: list[float], step_s: list[float], free0: int, requests: list[Request],
                 tokens: list[int], tables: list[int]) -> None:
        self.ends = ends  # end time of step j (0-based)
        self.step_s = step_s
        self.free0 = free0  # free blocks before the stretch, less reservations taken during it
        self.requests = requests  # the batch: the requests running at the start
        self.tokens = tokens  # per request: num_tokens at the start
        self.tables = tables  # per request: blocks held at the start

    @property
    def num_steps(self) -> int:
        return len(self.ends)


def _blocks_needed(tokens: list[int], tables: list[int], block_size: int, num_steps: int) -> int:
    """Blocks the running requests allocate in ``num_steps`` steps (step s computes position
    ``tokens - 2 + s`` of each, so it holds ``ceil((tokens - 1 + s) / block_size)`` blocks)."""
    need = 0
    for n, held in zip(tokens, tables):
        extra = -(-(n - 1 + num_steps) // block_size) - held
        if extra > 0:
            need += extra
    return need


def try_start(inst: StepInstance, now: float, max_model_len: int) -> Stretch | None:
    """A stretch of >= MIN_STEPS decode-only steps starting now, or None."""
    s = inst.scheduler
    running = s.running
    num_seqs = len(running)
    if s.waiting or not num_seqs or num_seqs > s.config.max_num_batched_tokens:
        return None
    kv = inst.kv_cache
    remaining = max_model_len
    context = 0
    tokens, tables = [], []
    for r in running:
        num_output = len(r.output_token_ids)
        n = len(r.prompt_token_ids) + num_output
        if r.num_computed_tokens != n - 1 or not num_output:  # one prompt token left is prefill
            return None
        left = min(r.sampling.max_tokens - num_output, max_model_len - n)
        if left <= MIN_STEPS:  # a stretch would be too short
            return None
        remaining = min(remaining, left)
        context += n
        tokens.append(n)
        tables.append(len(kv.block_tables(r.request_id)[0]))
    num_steps = remaining - 1  # the step that finishes a request is stepped
    if num_steps < MIN_STEPS:
        return None
    free = kv.num_free_blocks()
    bs = kv.block_size
    if _blocks_needed(tokens, tables, bs, num_steps) > free:
        lo, hi = 0, num_steps  # largest step count whose blocks fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _blocks_needed(tokens, tables, bs, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        num_steps = lo
        if num_steps < MIN_STEPS:
            return None
    steps = inst.step_cost.decode_times_s(num_seqs, context, num_steps)
    ends = list(accumulate(steps, initial=now))
    del ends[0]
    return Stretch(ends, steps, free, list(running), tokens, tables)


def free_after(inst: StepInstance, stretch: Stretch, num_free: int) -> int:
    """Blocks still free once every step of the stretch has allocated, of ``num_free`` free
    now (none of its steps applied yet)."""
    return num_free - _blocks_needed(stretch.tokens, stretch.tables, inst.kv_cache.block_size, stretch.num_steps)


def advance(inst: StepInstance, stretch: Stretch, num_steps: int, token_times: dict) -> None:
    """Apply the stretch's first ``num_steps`` steps to the scheduler, as stepping would.

    ``token_times``: request id -> list of token times, for requests that record their gaps.
    """
    if num_steps <= 0:
        return
    kv = inst.kv_cache
    for r in stretch.requests:
        rid = r.request_id
        if not kv.allocate(rid, r.num_computed_tokens, num_steps):
            raise AssertionError(f"fast-forward: no blocks for {rid} (the stretch was sized to fit)")
        r.num_computed_tokens += num_steps
        r.output_token_ids.extend(repeat(0, num_steps))
        if kv.has_uncached_full_blocks(rid, r.num_computed_tokens):
            kv.cache_computed_blocks(rid, r.hash_token_ids, r.num_computed_tokens)
        times = token_times.get(rid)
        if times is not None:
            times.extend(stretch.ends[:num_steps])
    inst.num_steps += num_steps
    for step_s in stretch.step_s[:num_steps]:
        inst.busy_s += step_s


def truncate(stretch: Stretch, num_steps: int) -> None:
    """Keep only the stretch's first ``num_steps`` steps (it now ends with the last of them)."""
    del stretch.ends[num_steps:]
    del stretch.step_s[num_steps:]


def steps_done_before(stretch: Stretch, now: float) -> int:
    """Steps that ended strictly before ``now`` (an event at a step's end instant comes first)."""
    return bisect_left(stretch.ends, now)


def load(inst: StepInstance, stretch: Stretch, now: float) -> m.Load:
    """What a load report at ``now`` says (after step ends at ``now``; the next step allocated)."""
    s = inst.scheduler
    num_started = min(bisect_right(stretch.ends, now) + 1, stretch.num_steps)
    free = stretch.free0 - _blocks_needed(stretch.tokens, stretch.tables, inst.kv_cache.block_size, num_started)
    used = inst.kv_cache.num_blocks - 1 - free
    return m.Load(len(s.running), len(s.waiting) + len(inst.reserve_queue), free, used, len(s.reserved),
                  len(s.transferring))
