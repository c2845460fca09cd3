"""A colocated worker of tensor-parallel size 2 served over HTTP: real router, worker and rank
processes; greedy output identical to transformers (float32); the ranks go with the server."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import hf_greedy
from serving import start_server, stop_server

from epdserve.models.loader import load_model_info

pytestmark = pytest.mark.slow


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_colocated_tp2_serves_greedy_identical(tmp_path, gemma3_gguf, hf_gemma3):
    prompt = [2, *[100 + (13 * i) % 5000 for i in range(40)]]
    expected = load_model_info(str(gemma3_gguf)).tokenizer.decode(hf_greedy(hf_gemma3, prompt, 10))
    server = start_server(["--model", str(gemma3_gguf), "--dtype", "float32", "--max-model-len", "512",
                           "--kv-cache-memory", "0.05", "--colocated-workers", "1", "--cores-per-worker", "2",
                           "--tensor-parallel-size", "2"], str(tmp_path))
    try:
        (worker,) = server.workers()
        ranks = children_of(worker["pid"])
        assert len(ranks) >= 1  # rank 1 (multiprocessing may add its resource tracker)
        body = {"model": "gemma-3-270m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), "a rank outlived its worker"


def test_tp_with_role_switching_is_refused_before_starting():
    proc = subprocess.run([sys.executable, "-m", "epdserve.cli", "serve", "--prefill-workers", "1",
                           "--decode-workers", "1", "--decode-tp", "2", "--cores-per-worker", "2",
                           "--role-switching", "manual"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "tensor-parallel size > 1 serves text workers without role switching" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "epdserve.cli", "serve", "--prefill-workers", "1",
                           "--decode-workers", "1", "--prefill-tp", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs --cores-per-worker >= 2" in proc.stderr
