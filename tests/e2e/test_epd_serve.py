"""E/P/D end to end: images through the OpenAI chat API, encode workers, embedding slabs.

Real router, worker processes and shared-memory slabs on loopback. The vision tower is
seeded (no checkpoint is shipped), so outputs are compared across topologies, not judged.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image
from serving import SMALL, Server, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
EXACT = [*SMALL, "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "0.3"]


def image_bytes(seed: int, size: tuple[int, int] = (96, 64), fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_body(urls: list[str], text: str = "Describe the images.", **kw) -> dict:
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "return_timing": True, **kw}


def chat(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def wait_slabs_free(server: Server) -> None:
    def free() -> bool:
        slabs = [w["embedding_slab"] for w in server.workers() if "embedding_slab" in w and w["state"] == "ready"]
        return all(s["num_free_rows"] == s["num_rows"] for s in slabs)

    server.wait_until(free, 10, "every embedding slab row free")
    server.wait_all_blocks_free()


REQUESTS = [[image_bytes(1)], [image_bytes(2), image_bytes(3, (700, 300))]]  # 1 tile; 1 + (2x1 + global)


def greedy(server: Server) -> list[list[int]]:
    out = []
    for images in REQUESTS:
        r = chat(server, chat_body([data_url(d) for d in images], logprobs=True))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["timing"]["num_images"] == len(images) and body["timing"]["encode_ms"] > 0
        out.append([t["token"] for t in body["choices"][0]["logprobs"]["content"]])
    return out


@pytest.fixture(scope="module")
def e_colocated(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("e_colocated")
    server = start_server(EXACT + ["--encode-workers", "1", "--colocated-workers", "1", "--max-images-per-request", "4",
                                   "--step-trace-dir", str(log_dir / "steps")], str(log_dir))
    server.step_trace_dir = log_dir / "steps"
    yield server
    stop_server(server)


def test_greedy_identical_colocated_e_colocated_epd(e_colocated, tmp_path):
    reference = greedy(e_colocated)
    assert reference[0] != reference[1]
    in_process = start_server(EXACT + ["--colocated-workers", "1", "--cores-per-worker", "2", "--vision", "default"],
                              str(tmp_path / "in_process"))
    try:
        assert greedy(in_process) == reference
        in_process.wait_all_blocks_free()
    finally:
        stop_server(in_process)
    # Pipelined over shared memory, then unpipelined over TCP (both transports and both prefill
    # paths, in two servers).
    for name, extra in (("epd", []),
                        ("epd_tcp_unpipelined", ["--embed-transport", "tcp", "--kv-transport", "tcp",
                                                 "--no-encode-pipeline"])):
        epd = start_server(EXACT + ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1", *extra],
                           str(tmp_path / name))
        try:
            assert greedy(epd) == reference, name
            wait_slabs_free(epd)
        finally:
            stop_server(epd)
    wait_slabs_free(e_colocated)


def test_repeated_image_hits_the_encoder_cache_and_slab_space_returns(e_colocated):
    image = data_url(image_bytes(42))
    first = chat(e_colocated, chat_body([image])).json()["timing"]
    second = chat(e_colocated, chat_body([image, image])).json()["timing"]
    assert first["num_encoder_cache_hits"] == 0
    assert second["num_encoder_cache_hits"] == 2
    encoder = next(w for w in e_colocated.workers() if w["role"] == "encode")
    e_colocated.wait_until(lambda: e_colocated.worker(encoder["id"])["load"]["num_encoder_cache_hits"] >= 2, 5,
                           "the encoder's load report")
    metrics = httpx.get(f"{e_colocated.url}/metrics").text
    assert "epdserve_encoder_cache_hits_total 2.0" in metrics or "epdserve_encoder_cache_hits_total" in metrics
    wait_slabs_free(e_colocated)
    # --step-trace-dir: the encode worker records its batches (for calibrate, a neighbour's busy
    # time and the encoder cost's samples) with the tiles each computed: none for cache hits.
    lines = (e_colocated.step_trace_dir / f"{encoder['id']}.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["role"] == "encode"
    batches = [json.loads(line) for line in lines[1:]]
    assert batches and all(b["wall_s"] > 0 and b["num_images"] >= 1 for b in batches)
    assert any(b["num_tiles"] >= 1 for b in batches) and batches[-1]["num_tiles"] == 0


def _png_claiming_size(width: int, height: int) -> bytes:
    """A small valid PNG whose header claims ``width`` x ``height`` pixels."""
    png = image_bytes(5, (8, 8))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return png[:8] + chunk + png[8 + 25:]


@pytest.mark.parametrize("urls, fragment", [
    ([data_url(b"\x89PNG\r\n\x1a\n not really a png")], "image"),
    ([data_url(image_bytes(6)[:200])], "image"),  # truncated
    ([data_url(image_bytes(7, fmt="GIF"), "image/gif")], "GIF"),
    ([data_url(_png_claiming_size(20000, 20000))], "pixels"),
    ([data_url(image_bytes(i)) for i in range(5)], "at most 4"),
    (["https://example.com/cat.png"], "not allowed"),
    (["data:text/plain;base64,aGVsbG8="], "not an image"),
    (["data:image/png;base64,%%%"], "base64"),
    (["ftp://example.com/a.png"], "data: URL or an http"),
])
def test_bad_images_are_400_and_workers_keep_serving(e_colocated, urls, fragment):
    r = chat(e_colocated, chat_body(urls))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    assert all(w["state"] == "ready" for w in e_colocated.workers())
    ok = chat(e_colocated, chat_body([data_url(image_bytes(8))]))
    assert ok.status_code == 200


def test_text_only_server_rejects_images(tmp_path):
    server = start_server(SMALL + ["--colocated-workers", "1", "--cores-per-worker", "2"], str(tmp_path))
    try:
        r = chat(server, chat_body([data_url(image_bytes(1))]))
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]
    finally:
        stop_server(server)


def _stream(server: Server, body: dict, events: list) -> None:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        if r.status_code != 200:
            events.append((time.monotonic(), json.dumps({"error": r.read().decode()})))
            return
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))


def test_killing_an_encode_worker_fails_only_its_requests(tmp_path):
    # Eight large images keep the encoder busy for seconds: the kill lands mid-request.
    # No automatic restart: the encoder stays dead.
    server = start_server(SMALL + ["--max-model-len", "8192", "--kv-cache-memory", "0.5", "--encode-workers", "1",
                                   "--colocated-workers", "1", "--max-worker-restarts", "0"],
                          str(tmp_path))
    try:
        big = [data_url(image_bytes(100 + i, (1000, 1000))) for i in range(6)]
        events: list = []
        thread = threading.Thread(target=_stream, args=(server, chat_body(big, max_tokens=4), events))
        thread.start()
        encoder = next(w for w in server.workers() if w["role"] == "encode")
        server.wait_until(lambda: server.worker(encoder["id"])["load"]["num_running"] > 0, 30, "encoding to start")
        killed_at = time.monotonic()
        os.kill(encoder["pid"], signal.SIGKILL)
        text = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        thread.join(60)
        errors = [(t, d) for t, d in events if '"error"' in d]
        assert errors and errors[0][0] - killed_at < 2.0, events
        assert "encode worker" in errors[0][1]
        assert text.status_code == 200  # a request that needs no encoder is served
        assert server.worker(encoder["id"])["state"] == "dead"
        again = chat(server, chat_body([data_url(image_bytes(9))]))
        assert again.status_code == 503 and again.headers.get("Retry-After")
        wait_slabs_free(server)
    finally:
        stop_server(server)


def test_client_disconnect_mid_encode_frees_slab_space(e_colocated):
    big = [data_url(image_bytes(200, (1000, 700)))]  # 5 tiles
    with httpx.stream("POST", f"{e_colocated.url}/v1/chat/completions", timeout=60,
                      json={**chat_body(big), "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk: admitted, encoding under way; then hang up
    wait_slabs_free(e_colocated)
    assert chat(e_colocated, chat_body([data_url(image_bytes(10))])).status_code == 200


def test_vlm_checkpoint_serves_identically_in_process_and_split(tmp_path):
    """A real (tiny, random) Idefics3 checkpoint directory: its own tower, connector, image
    tokens and a chat template that iterates content parts."""
    from tiny_vlm import write_tiny_vlm

    model_dir = tmp_path / "tiny-vlm"
    model_dir.mkdir()
    write_tiny_vlm(model_dir)
    common = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "0.05"]
    body = {**chat_body([data_url(image_bytes(1)), data_url(image_bytes(2, (300, 200)))], logprobs=True),
            "model": "tiny-vlm", "max_tokens": 6}
    outputs = []
    for name, flags in (("in_process", ["--colocated-workers", "1", "--cores-per-worker", "2"]),
                        ("epd", ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"])):
        server = start_server(common + flags, str(tmp_path / name))
        try:
            r = chat(server, body)
            assert r.status_code == 200, r.text
            outputs.append([t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]])
            assert r.json()["timing"]["num_images"] == 2
            if name == "epd":
                wait_slabs_free(server)
        finally:
            stop_server(server)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_worker_that_dies_at_start_up_fails_serve_promptly(tmp_path):
    """The router reads the checkpoint's config and tokenizer; the workers' weights are gone,
    so every worker exits while loading: serve says so at once instead of waiting out its
    start-up timeout."""
    from tiny_vlm import write_tiny_vlm

    from epdserve.bench import BenchError

    model_dir = tmp_path / "tiny-vlm"
    model_dir.mkdir()
    write_tiny_vlm(model_dir)
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    started = time.monotonic()
    with pytest.raises(BenchError, match="workers exited during start-up: colocated-0"):
        start_server(["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "512",
                      "--kv-cache-memory", "0.05", "--colocated-workers", "1"], str(tmp_path / "logs"), timeout_s=120)
    assert time.monotonic() - started < 100  # the start-up timeout is 300 s
