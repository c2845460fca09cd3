"""Start and stop a real ``epdserve serve`` (router + worker processes) for end-to-end tests."""

from __future__ import annotations

import glob
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

READY = re.compile(r"epdserve ready in [\d.]+ s: (http://[\d.:]+) .*workers connect to (tcp://[\d.:]+)")
SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "0.1"]


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    router: str
    log_dir: str
    api_key: str | None = None

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
                and w["load"]["num_transferring"] == 0 and w["load"]["num_requests"] == 0
                for w in live
            )

        self.wait_until(free, timeout_s, "every KV block free on every live worker")


def start_server(args: list[str], log_dir: str, timeout_s: float = 180.0) -> Server:
    cmd = [sys.executable, "-m", "epdserve.cli", "serve", "--port", "0", "--worker-log-dir", log_dir, *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = READY.search(line)
        if match:
            api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
            return Server(process, match.group(1), match.group(2), log_dir, api_key)
    stop_server_process(process)
    raise AssertionError("server did not become ready:\n" + "".join(lines[-20:]))


def stop_server_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_server(server: Server) -> None:
    pids = [w["pid"] for w in server.workers()] if server.process.poll() is None else []
    stop_server_process(server.process)
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
    return glob.glob(f"/dev/shm/epdserve-kv-{pid}-*")
