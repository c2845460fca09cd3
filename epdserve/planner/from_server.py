"""``epdserve plan --from-server URL``: the ratio for what a live server is actually serving.

The server's recent arrival mix (``GET /v1/traffic``: arrival times, prompt and answer
lengths) becomes the plan's workload, replayed as it came; its workers (``GET /v1/workers``)
set the instance budget. After the plan, ``role_switches`` lists the moves that take the
server's prefill and decode workers to the best split the plan found for that many instances,
as the ``POST /v1/workers/{id}/role`` calls an operator (or ``--role-switching auto``) makes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from epdserve.errors import ConfigError
from epdserve.roles import Role

HTTP_TIMEOUT_S = 30.0
MIN_REQUESTS = 10  # a window with fewer says too little to plan from


@dataclass(frozen=True)
class ServerSnapshot:
    url: str
    traffic: dict  # GET /v1/traffic
    workers: list[dict]  # GET /v1/workers "data"

    def ready_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            if w["state"] == "ready":
                counts[w["role"]] = counts.get(w["role"], 0) + 1
        return counts

    @property
    def num_llm_workers(self) -> int:
        return sum(1 for w in self.workers if w["role"] != Role.ENCODE and w["state"] in ("ready", "draining",
                                                                                        "switching"))


def fetch(url: str, api_key: str | None, window_s: float) -> ServerSnapshot:
    """The server's traffic of the last ``window_s`` seconds and its workers."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=HTTP_TIMEOUT_S) as client:
            traffic = client.get("/v1/traffic", params={"window_s": window_s})
            workers = client.get("/v1/workers")
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {base}: {e}") from None
    for name, response in (("/v1/traffic", traffic), ("/v1/workers", workers)):
        if response.status_code != 200:
            raise ConfigError(f"{base}{name} answered {response.status_code}: {response.text[:200]}")
    snapshot = ServerSnapshot(base, traffic.json(), workers.json()["data"])
    if snapshot.traffic["num_requests"] < MIN_REQUESTS:
        raise ConfigError(f"{base} saw {snapshot.traffic['num_requests']} requests in the last {window_s:g} s; "
                          f"a plan needs at least {MIN_REQUESTS} (a longer --from-server-window?)")
    return snapshot


def write_trace(traffic: dict, path: Path) -> None:
    """The traffic as a trace file (Mooncake JSONL: milliseconds, lengths; no shared prefixes)."""
    columns = traffic["columns"]
    t, p, o = columns.index("arrived_s"), columns.index("prompt_tokens"), columns.index("output_tokens")
    with path.open("w", encoding="utf-8") as f:
        for row in traffic["requests"]:
            f.write(json.dumps({"timestamp": row[t] * 1e3, "input_length": max(1, int(row[p])),
                                "output_length": max(1, int(row[o]))}) + "\n")


def target_split(plan: dict, num_instances: int) -> tuple[int, int] | None:
    """(prefill, decode) for ``num_instances``: the simulated split of that size with the
    highest rate at the SLO, else the formula's counts for that budget; None without either."""
    sized = [c for c in plan.get("candidates", []) if c["max_rate"] > 0 and _split(c["topology"])
             and sum(_split(c["topology"])) == num_instances]
    if sized:
        return _split(max(sized, key=lambda c: c["max_rate"])["topology"])
    counts = (plan.get("formula_ratio") or {}).get("counts_for_budget")
    if counts and counts.get("prefill") and counts.get("decode"):
        return counts["prefill"], counts["decode"]
    return None


def _split(topology: str) -> tuple[int, int] | None:
    counts = dict(part.split("=") for part in topology.split(","))
    if set(counts) != {"prefill", "decode"}:
        return None
    return int(counts["prefill"]), int(counts["decode"])


def role_switches(workers: list[dict], prefill: int, decode: int) -> list[dict]:
    """The switches that take the ready prefill and decode workers to ``prefill`` : ``decode``
    (same total): the donors are those with the fewest requests in hand."""
    ready = {role: sorted((w for w in workers if w["role"] == role and w["state"] == "ready"),
                          key=lambda w: (w["load"]["num_requests"], w["id"]))
             for role in (Role.PREFILL, Role.DECODE)}
    more = prefill - len(ready[Role.PREFILL])
    if more > 0:
        donors, to_role = ready[Role.DECODE][:more], Role.PREFILL
    elif more < 0:
        donors, to_role = ready[Role.PREFILL][:-more], Role.DECODE
    else:
        return []
    return [{"worker": w["id"], "from_role": w["role"], "to_role": str(to_role)} for w in donors]


def format_switches(snapshot: ServerSnapshot, plan: dict, target: tuple[int, int] | None,
                    switches: list[dict]) -> str:
    counts = snapshot.ready_counts()
    now = ", ".join(f"{role}={n}" for role, n in sorted(counts.items()))
    traffic = snapshot.traffic
    lines = [f"server {snapshot.url}: {now}; {traffic['num_requests']} requests in the last "
             f"{traffic['window_s']:g} s ({traffic['rate']:.3g} req/s)"]
    if target is None:
        lines.append("no split of this size meets the SLO in the simulation: no switch to suggest")
    elif plan["verdict"]["choice"] == "colocated" and not counts.get(Role.COLOCATED):
        lines.append(f"the plan prefers colocated serving for this mix ({plan['verdict']['reason']}); the best "
                     f"split of {sum(target)} would be prefill={target[0]},decode={target[1]}")
    if target is not None and not switches:
        lines.append(f"the server already runs the best split of its size (prefill={target[0]},decode={target[1]})")
    for s in switches:
        lines.append(f"switch {s['worker']} {s['from_role']} -> {s['to_role']}:  curl -X POST "
                     f"{snapshot.url}/v1/workers/{s['worker']}/role -H 'Content-Type: application/json' "
                     f"-d '{{\"role\": \"{s['to_role']}\"}}'")
    return "\n".join(lines)
