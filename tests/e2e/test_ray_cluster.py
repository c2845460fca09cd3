"""``epdserve serve --cluster ray`` on a Ray cluster of several nodes started by the test.

The nodes are ``ray.cluster_utils.Cluster`` nodes: each its own raylet and worker processes,
named by its own Ray node id, on this machine's one address. Workers on different nodes then
move KV and embeddings over TCP (locality is by node id), which is the cross-host path; what
these nodes do not emulate is a link between them (benchmarks/cross_host.py shapes one with
network namespaces, where a Ray cluster's nodes all have to reach one GCS address).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving import SMALL, Server, start_server, stop_server

from epdserve.cluster.ray_cluster import ROLE_LABEL
from epdserve.transfer.segments import unlink_segments_of

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
EXACT = [*SMALL, "--dtype", "float32"]
STORE = 80 << 20  # object store per node: the workers put nothing in it
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _node(cluster: Cluster, role: str):
    return cluster.add_node(num_cpus=1, object_store_memory=STORE, labels={ROLE_LABEL: role})


@pytest.fixture(scope="module")
def cluster():
    # The head runs no workers (0 CPUs): the router's process joins it as a driver.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": STORE})
    try:
        yield c
    finally:
        c.shutdown()


def _serve(cluster: Cluster, args: list[str], log_dir) -> Server:
    return start_server([*EXACT, "--cluster", "ray", "--ray-address", cluster.address, "--placement", "by-label",
                         "--worker-lease", "1", *args], str(log_dir))


def _complete(server: Server, prompt: str, max_tokens: int = 16) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _offline(prompt: str, max_tokens: int = 16) -> str:
    out = subprocess.run([sys.executable, "-m", "epdserve.cli", "generate", "--prompt", prompt, "--max-tokens",
                          str(max_tokens), "--json", *EXACT], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["text"]


def _metric(server: Server, line_prefix: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_prefix))


def test_prefill_decode_and_encode_on_three_nodes(cluster, tmp_path):
    nodes = {role: _node(cluster, role) for role in ("prefill", "decode", "encode")}
    cluster.wait_for_nodes()
    server = _serve(cluster, ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"], tmp_path)
    try:
        workers = {w["role"]: w for w in server.workers()}
        assert {role: workers[role]["node"] for role in nodes} == {role: n.node_id for role, n in nodes.items()}
        assert workers["decode"]["kv_listener"] and workers["prefill"]["slab_listener"]
        for prompt in PROMPTS:
            assert _complete(server, prompt) == _offline(prompt)
        assert _metric(server, 'epdserve_kv_transfer_bytes_total{transport="tcp"}') > 0
        assert _metric(server, 'epdserve_kv_transfer_bytes_total{transport="shm"}') == 0
        # An image: encoded on the encode node, its embedding over TCP into the prefill node's slab.
        from test_epd_serve import chat_body, data_url, image_bytes

        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body([data_url(image_bytes(1))]), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["timing"]["num_images"] == 1
        # The router counts the bytes when the encoder's report arrives, on another channel than
        # the embedding itself: it may come after the response (bounded wait).
        deadline = time.monotonic() + 10.0
        while _metric(server, "epdserve_embedding_transfer_bytes_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(server, "epdserve_embedding_transfer_bytes_total") > 0
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
        for node in nodes.values():
            cluster.remove_node(node)


def _stream(server: Server, prompt: str, events: list) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))
    except httpx.HTTPError as e:
        events.append((time.monotonic(), json.dumps({"error": str(e)})))


def test_a_lost_node_fails_only_its_requests_and_its_worker_rejoins(cluster, tmp_path):
    prefill = _node(cluster, "prefill")
    decodes = [_node(cluster, "decode"), _node(cluster, "decode")]
    cluster.wait_for_nodes()
    server = _serve(cluster, ["--prefill-workers", "1", "--decode-workers", "2", "--max-worker-restarts", "3"],
                    tmp_path)
    added = []
    try:
        by_node = {w["node"]: w for w in server.workers() if w["role"] == "decode"}
        victim_node = decodes[1]
        victim = by_node[victim_node.node_id]
        streams: list[list] = [[] for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(server, f"Story {i}:", streams[i])) for i in range(4)]
        for t in threads:
            t.start()
        server.wait_until(lambda: all(server.worker(w["id"])["load"]["num_running"] > 0 for w in by_node.values()),
                          60, "both decode workers to be decoding")
        killed_at = time.monotonic()
        cluster.remove_node(victim_node)  # its raylet and every process on it
        for t in threads:
            t.join(120)
        # A lost machine takes its shared memory with it; the emulated node shares this host's
        # /dev/shm, where the killed worker's KV pool and fence would stay: gone with the node too.
        unlink_segments_of(victim["pid"])
        errored = [e for e in streams if any('"error"' in d for _, d in e)]
        finished = [e for e in streams if e and e[-1][1] == "[DONE]" and e not in errored]
        assert errored and finished and len(errored) + len(finished) == 4
        first_error = min(next(t for t, d in e if '"error"' in d) for e in errored)
        print(f"first error {first_error - killed_at:.2f} s after the node's removal")
        assert first_error - killed_at < 2.5
        server.wait_all_blocks_free(30)  # nothing leaked on the surviving workers
        # Ray restarts the lost worker's actor on a node that can take it; it rejoins under its id.
        added.append(_node(cluster, "decode"))
        server.wait_until(lambda: server.worker(victim["id"])["state"] == "ready"
                          and server.worker(victim["id"])["node"] == added[0].node_id, 120,
                          "the lost worker to rejoin from the new node")
        for prompt in PROMPTS:
            assert _complete(server, prompt, 8)
        server.wait_all_blocks_free(30)
    finally:
        stop_server(server)
        for node in [prefill, decodes[0], *added]:
            cluster.remove_node(node)
