"""Replace a running P/D server's workers with a prefill and a decode worker in two network
namespaces joined by a shaped veth link, so KV crosses a link of a known rate.

    1. ``epdserve serve`` starts as usual (router on loopback, prefill-0 and decode-0);
    2. prefill-0 and decode-0 are stopped, and the router marks them dead;
    3. a relay per namespace carries the control channel to the router;
    4. the decode worker starts in its namespace with its KV listener on the veth address,
       then the prefill worker in the other, pinned to the same cores as the originals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.bench.experiments.launch import (
    RunningServer,
    list_workers,
    stop_process,
    wait_for_exit,
    wait_for_line,
    wait_for_workers,
)
from epdserve.bench.experiments.netns import VethLink
from epdserve.cluster.local import assign_cores

RELAY_READY = re.compile(r"relay listening on 127\.0\.0\.1:(\d+)")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


@dataclass
class NamespacedWorkers:
    relays: list[subprocess.Popen] = field(default_factory=list)
    workers: list[subprocess.Popen] = field(default_factory=list)


def _engine_args(serve_args: list[str]) -> list[str]:
    """The engine flags ``serve`` would pass its own workers, for the same serve flags."""
    from epdserve.cli_args import engine_argv_of

    return engine_argv_of(serve_args)


def _start_relay(link_ns: str, router_address: str, started: NamespacedWorkers) -> str:
    target = router_address.removeprefix("tcp://")
    cmd = [sys.executable, "-m", "epdserve.bench.experiments.relay", "--netns", link_ns, "--target", target]
    relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             stdin=subprocess.DEVNULL)
    started.relays.append(relay)
    match = wait_for_line(relay, RELAY_READY, READY_TIMEOUT_S, f"relay into {link_ns}")
    return f"tcp://127.0.0.1:{match.group(1)}"


def _start_worker(cmd: list[str], log_path: Path, started: NamespacedWorkers) -> None:
    with open(log_path, "ab") as log:
        started.workers.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        )


def _is_ready(worker_id: str) -> Callable[[list[dict]], bool]:
    return lambda workers: any(w["id"] == worker_id and w["state"] == "ready" for w in workers)


def move_pd_workers(
    server: RunningServer, link: VethLink, serve_args: list[str], layerwise: bool
) -> NamespacedWorkers:
    """Swap the server's own P/D workers for namespaced ones (same cores: prefill on the first,
    decode on the second); returns what to stop later."""
    originals = [w for w in list_workers(server) if w["state"] == "ready"]
    for worker in originals:
        signal_pid(worker["pid"], signal.SIGTERM)
    for worker in originals:
        wait_for_exit(worker["pid"], STOP_TIMEOUT_S)
    ids = {w["id"] for w in originals}
    wait_for_workers(server, lambda ws: all(w["state"] == "dead" for w in ws if w["id"] in ids),
                     READY_TIMEOUT_S, "the router to drop the original workers")
    prefill_cores, decode_cores = assign_cores(2, 1)
    engine = _engine_args(serve_args)
    started = NamespacedWorkers()
    try:
        for role, ns, cores, extra in (
            ("decode", link.decode_ns, decode_cores, ["--kv-transport", "tcp", "--kv-host", link.decode_addr]),
            ("prefill", link.prefill_ns, prefill_cores, [] if layerwise else ["--no-layerwise"]),
        ):
            router = _start_relay(ns, server.router_address, started)
            worker_id = f"{role}-veth"
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "epdserve.cli", "worker", "--role", role,
                   "--router", router, "--worker-id", worker_id, "--cores", ",".join(map(str, cores)),
                   "--die-with-parent", "--cluster-key-file", str(server.key_file), *extra, *engine]
            _start_worker(cmd, server.log_dir / f"{worker_id}.log", started)
            wait_for_workers(server, _is_ready(worker_id), READY_TIMEOUT_S, f"{worker_id} to register")
    except BaseException:
        stop_namespaced(started)
        raise
    return started


def signal_pid(pid: int, sig: int) -> None:
    """Send ``sig`` to a process that may already have exited."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_namespaced(started: NamespacedWorkers) -> None:
    """Stop the namespaced workers (SIGTERM), then their relays."""
    for process in started.workers:
        stop_process(process, signal.SIGTERM)
    for process in started.relays:
        stop_process(process, signal.SIGTERM)
