"""A real P/D server with an encode worker, approached by peers that do not hold its cluster
secret, and by one that holds it but sends frames that do not fit: none of them gets a frame
written, and every worker keeps serving."""

from __future__ import annotations

import socket
import struct
import time

import httpx
import msgspec
import pytest
import torch
import zmq
from conftest import closed_by_peer
from serving import SMALL, start_server, stop_server

from epdserve.auth import AuthError, make_curve_client, new_key, prove_to_peer, read_key_file
from epdserve.cluster import messages as m
from epdserve.config import resolve_dtype_name
from epdserve.transfer.slab_tcp import TcpSlabSender
from epdserve.transfer.tcp import LayerFrame, TcpKVSender

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server([*SMALL, "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"],
                     str(tmp_path_factory.mktemp("strangers")))
    yield s
    stop_server(s)


def _address(listener: str) -> tuple[str, int]:
    host, port = listener.rsplit(":", 1)
    return host, int(port)


def _complete(server) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_stranger_cannot_register(server):
    ctx = zmq.Context()
    try:
        for name, key in (("evil-plain", None), ("evil-wrong-key", new_key())):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, name.encode())
            sock.setsockopt(zmq.SNDTIMEO, 2000)  # the handshake fails: the message never leaves
            if key is not None:
                make_curve_client(sock, key)
            sock.connect(server.router)
            try:
                sock.send(m.encode(m.Register(worker_id=name, role="decode", pid=1, host="x", model_name=MODEL,
                                              max_model_len=1024, num_kv_blocks=64, block_size=16)))
            except zmq.Again:
                pass
        time.sleep(1.5)
        assert {w["id"] for w in server.workers()} == {"encode-0", "prefill-0", "decode-0"}
    finally:
        ctx.destroy(linger=0)
    assert _complete(server)


def test_a_stranger_cannot_open_a_kv_or_slab_connection(server):
    workers = {w["role"]: w for w in server.workers()}
    kv_host, kv_port = _address(workers["decode"]["kv_listener"])
    slab_host, slab_port = _address(workers["prefill"]["slab_listener"])
    with pytest.raises(AuthError):
        TcpKVSender(kv_host, kv_port, new_key())
    with pytest.raises(AuthError):
        TcpSlabSender(slab_host, slab_port, 8, 4, torch.float32, new_key())
    # No handshake at all: bytes shaped like a frame are never read as one.
    for host, port in ((kv_host, kv_port), (slab_host, slab_port)):
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(struct.pack("!I", 8) + b"\x95" * 8 + bytes(4096))
            assert closed_by_peer(sock)
    assert _complete(server)
    assert {w["pid"] for w in server.workers()} == {w["pid"] for w in workers.values()}


def test_a_member_frame_that_does_not_fit_is_refused_without_writing(server):
    key = read_key_file(str(server.key_file))
    decode = next(w for w in server.workers() if w["role"] == "decode")
    host, port = _address(decode["kv_listener"])
    before = decode["load"]["num_kv_writes_refused"]
    # SmolLM2-135M: 3 KV heads of 64 per layer, K and V, in the worker's dtype.
    row_bytes = 2 * 3 * 64 * getattr(torch, resolve_dtype_name("auto", "cpu")).itemsize
    # A frame of no open reservation (a late write): read, dropped, the connection stays.
    with socket.create_connection((host, port), timeout=5) as sock:
        prove_to_peer(sock, key, b"kv")
        header = msgspec.msgpack.encode(LayerFrame("nobody", 12345, 0, 4, 4 * row_bytes))
        sock.sendall(struct.pack("!I", len(header)) + header + bytes(4 * 8 + 4 * row_bytes))
        # An oversized one: the header alone closes the connection.
        header = msgspec.msgpack.encode(LayerFrame("nobody", 12345, 0, 1 << 40, 1 << 50))
        sock.sendall(struct.pack("!I", len(header)) + header)
        assert closed_by_peer(sock)
    server.wait_until(lambda: server.worker(decode["id"])["load"]["num_kv_writes_refused"] >= before + 2, 10,
                      "the refused frames to be counted")
    assert server.worker(decode["id"])["pid"] == decode["pid"]
    assert _complete(server)
    server.wait_all_blocks_free()
