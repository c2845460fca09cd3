"""Start and stop a real ``epdserve serve`` for an experiment arm, and read its state.

The server runs as a child process on a free port; it is ready when it prints its ready line
(read with a bounded wait, no polling). It stops on SIGINT, which makes it stop its workers;
``stop_server`` then waits for every worker process it reported to be gone.
"""

from __future__ import annotations

import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from epdserve.bench import BenchError
from epdserve.envs import get_api_key

READY = re.compile(r"epdserve ready in [\d.]+ s: (http://[\d.:]+) .*workers connect to (tcp://[\d.:]+)")
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.1  # between /v1/workers reads while waiting for a worker state change
HTTP_TIMEOUT_S = 10.0
NUM_LOG_LINES_SHOWN = 20


@dataclass
class RunningServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    router_address: str  # tcp://127.0.0.1:PORT, the socket workers register on
    log_dir: Path
    args: tuple[str, ...]  # the serve flags it was started with
    key_file: Path | None = None  # the cluster secret, for workers started by hand

    @property
    def command(self) -> str:
        """The serve command line, for reports."""
        return "epdserve serve " + " ".join(self.args)


def start_server(args: list[str], log_dir: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> RunningServer:
    """Start ``epdserve serve ARGS --port 0`` and return once it prints its ready line."""
    log_dir.mkdir(parents=True, exist_ok=True)
    key_args: list[str] = []
    key_file = None
    if "--cluster-key-file" not in args:  # written by the server, read by workers started by hand
        key_file = log_dir / "cluster.key"
        key_args = ["--cluster-key-file", str(key_file)]
    cmd = [sys.executable, "-m", "epdserve.cli", "serve", "--port", "0", "--worker-log-dir", str(log_dir), *args,
           *key_args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               stdin=subprocess.DEVNULL)
    match = wait_for_line(process, READY, timeout_s, f"epdserve serve {' '.join(args)}")
    _drain_output(process, log_dir / "server.log")
    return RunningServer(process, match.group(1), match.group(2), log_dir, tuple(args), key_file)


def wait_for_line(process: subprocess.Popen, pattern: re.Pattern, timeout_s: float, what: str) -> re.Match:
    """Read the child's stdout (a text pipe) until a line matches ``pattern``, at most
    ``timeout_s`` seconds; on failure the child is stopped and BenchError names ``what``."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = pattern.search(line)
            if match:
                return match
    stop_process(process)
    tail = " | ".join(line.strip() for line in lines[-NUM_LOG_LINES_SHOWN:])
    raise BenchError(f"{what} did not become ready: {tail or 'no output'}")


def _drain_output(process: subprocess.Popen, path: Path) -> None:
    """Copy the server's remaining output to a file from a thread, so its pipe never fills."""

    def copy() -> None:
        assert process.stdout is not None
        with open(path, "a", encoding="utf-8", buffering=1) as out:  # line-buffered: readable while serving
            out.writelines(process.stdout)

    threading.Thread(target=copy, name="server-log", daemon=True).start()


def stop_process(process: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Signal a child (SIGINT: a server stops its workers), then wait, bounded, for its exit."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def auth_headers(server: RunningServer) -> dict[str, str]:
    """The API key the server was started with (``--api-key``, else ``$EPDSERVE_API_KEY``), as a header."""
    args = list(server.args)
    key = args[args.index("--api-key") + 1] if "--api-key" in args[:-1] else get_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def list_workers(server: RunningServer) -> list[dict]:
    """``/v1/workers``: id, role, pid, state and load of each worker the router knows."""
    return httpx.get(f"{server.url}/v1/workers", headers=auth_headers(server), timeout=HTTP_TIMEOUT_S).json()["data"]


def stop_server(server: RunningServer) -> None:
    """SIGINT the server, then wait (bounded) for the worker processes it reported to exit."""
    pids: list[int] = []
    if server.process.poll() is None:
        try:
            pids = [w["pid"] for w in list_workers(server) if w["state"] != "dead"]
        except (httpx.HTTPError, KeyError, ValueError):
            pids = []
    stop_process(server.process)
    for pid in pids:
        wait_for_exit(pid, STOP_TIMEOUT_S)


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Wait on a pidfd until process ``pid`` exits; True when it is gone within the limit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            return bool(selector.select(timeout=timeout_s))
    finally:
        os.close(fd)


def wait_for_workers(
    server: RunningServer, is_done: Callable[[list[dict]], bool], timeout_s: float, what: str
) -> list[dict]:
    """Read ``/v1/workers`` until ``is_done(workers)`` holds; the router publishes worker state
    changes nowhere else, so this is a bounded poll. Raises BenchError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = list_workers(server)
        if is_done(workers):
            return workers
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


def metric_value(server: RunningServer, name: str) -> float:
    """The value of one counter or gauge from ``/metrics``, summed over its labels (0.0 when
    absent)."""
    text = httpx.get(f"{server.url}/metrics", headers=auth_headers(server), timeout=HTTP_TIMEOUT_S).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def epdserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "epdserve.cli", *args]


def run_command(cmd: list[str], commands: list[str]) -> None:
    """Run an ``epdserve`` command, note it for the report; BenchError with its last output line on failure."""
    shown = "epdserve " + shlex.join(cmd[3:])
    commands.append(shown)
    print(f"$ {shown}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        raise BenchError(f"{shown} failed ({proc.returncode}): {lines[-1]}")
