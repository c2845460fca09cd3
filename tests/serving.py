"""Start and stop a real ``epdserve serve`` (router + worker processes) for end-to-end tests."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from epdserve.bench.experiments import launch

SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "0.1"]


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    router: str
    log_dir: str
    api_key: str | None = None
    step_trace_dir: Path | None = None  # set by tests that serve with --step-trace-dir
    key_file: Path | None = None  # the cluster secret, for workers a test starts by hand

    @property
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def workers(self) -> list[dict]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        return httpx.get(f"{self.url}/v1/workers", headers=headers, timeout=10).json()["data"]

    def worker(self, worker_id: str) -> dict:
        return next(w for w in self.workers() if w["id"] == worker_id)

    def wait_until(self, predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
        """Bounded wait on server state (load reports arrive with heartbeats)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_all_blocks_free(self, timeout_s: float = 10.0) -> None:
        def free() -> bool:
            live = [w for w in self.workers() if w["state"] == "ready"]
            return all(
                w["load"]["num_used_blocks"] == 0 and w["load"]["num_reserved"] == 0
                and w["load"].get("num_used_state_slots", 0) == 0
                and w["load"]["num_transferring"] == 0 and w["load"]["num_requests"] == 0
                for w in live
            )

        self.wait_until(free, timeout_s, "every KV block free on every live worker")


def start_server(args: list[str], log_dir: str, timeout_s: float = 180.0) -> Server:
    """``epdserve serve ARGS`` on a free port (the experiments' launcher: bounded wait for the
    ready line, output drained to a file so the pipe never fills)."""
    running = launch.start_server(args, Path(log_dir), timeout_s)
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    return Server(running.process, running.url, running.router_address, log_dir, api_key,
                  key_file=running.key_file)


def stop_server(server: Server) -> None:
    pids = [w["pid"] for w in server.workers()] if server.process.poll() is None else []
    launch.stop_process(server.process)
    deadline = time.monotonic() + 15
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"worker {pid} outlived the server"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def shm_segments(pid: int) -> list[str]:
    """The shared-memory segments process ``pid`` created (KV pools, fences, state, slabs)."""
    return glob.glob(f"/dev/shm/epdserve-*-{pid}-*")
