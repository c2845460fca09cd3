"""The cluster secret at each channel: strangers get no frame read, members' frames are checked
against what the receiver reserved. Real listeners and sockets on loopback, no worker model."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq
from conftest import closed_by_peer

from epdserve.auth import AuthError, make_curve_client, new_key, parse_key, read_key_file, serve_key
from epdserve.cluster import messages as m
from epdserve.errors import ConfigError
from epdserve.router.core import Router
from epdserve.transfer.fence import ReservationFence
from epdserve.transfer.locality import pick_transport, this_node
from epdserve.transfer.slab_tcp import SlabFrame, TcpSlabReceiver, TcpSlabSender
from epdserve.transfer.tcp import LayerFrame, TcpKVReceiver, TcpKVSender

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, LAYERS = 8, 4, 2, 8, 2
KEY = new_key()


class KVSide:
    """A decode worker's KV receiver over a small pool, recording what it landed or refused."""

    def __init__(self, key: bytes = KEY) -> None:
        self.caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM) for _ in range(LAYERS)]
        self.fence = ReservationFence(1, NUM_BLOCKS)
        self.landed: list[str] = []
        self.refused: list[tuple[str, str]] = []
        self.event = threading.Event()
        self.receiver = TcpKVReceiver(self.caches, self._landed, self.fence, [0] * LAYERS, key,
                                      on_refused=self._refused)

    def _landed(self, request_id: str) -> None:
        self.landed.append(request_id)
        self.event.set()

    def _refused(self, request_id: str, reason: str) -> None:
        self.refused.append((request_id, reason))
        self.event.set()

    def wait(self, what: str) -> None:
        assert self.event.wait(10), f"no {what} within 10 s"
        self.event.clear()

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture
def kv():
    side = KVSide()
    yield side
    side.close()


def _kv(value: float, n: int) -> torch.Tensor:
    return torch.full((2, n, HEADS, DIM), value)


def _slots(blocks: list[int]) -> torch.Tensor:
    return torch.tensor([b * BLOCK_SIZE + o for b in blocks for o in range(BLOCK_SIZE)], dtype=torch.int64)


def _raw_frame(frame: LayerFrame) -> bytes:
    header = msgspec.msgpack.encode(frame)
    return struct.pack("!I", len(header)) + header


# -- the secret itself ------------------------------------------------------------------
def test_key_files_are_private_and_well_formed(tmp_path):
    path = tmp_path / "cluster.key"
    key = serve_key(str(path))  # generated and written
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_key_file(str(path)) == key and serve_key(str(path)) == key
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_key_file(str(path))
    with pytest.raises(ConfigError, match="hexadecimal"):
        parse_key("not hex", "test")
    with pytest.raises(ConfigError, match="hexadecimal"):
        parse_key("ab" * 8, "test")


# -- KV over TCP ------------------------------------------------------------------------
def test_kv_listener_refuses_a_peer_without_the_key(kv):
    with pytest.raises(AuthError):
        TcpKVSender(kv.receiver.host, kv.receiver.port, new_key())
    # A stranger that skips the handshake and writes a frame: nothing is read as a frame.
    generation = kv.fence.open([[1]], "r")
    with socket.create_connection((kv.receiver.host, kv.receiver.port), timeout=5) as stranger:
        stranger.recv(64)  # the listener's challenge
        frame = _raw_frame(LayerFrame("r", generation, 0, 4, 4 * 2 * HEADS * DIM * 4))
        stranger.sendall(frame + _slots([1]).numpy().tobytes() + _kv(7.0, 4).numpy().tobytes())
        assert closed_by_peer(stranger)
    assert kv.receiver.num_refused_peers == 2
    assert float(kv.caches[0].abs().max()) == 0.0 and kv.landed == [] and kv.refused == []


def test_kv_frames_are_checked_against_their_reservation(kv):
    sender = TcpKVSender(kv.receiver.host, kv.receiver.port, KEY)
    try:
        g_a = kv.fence.open([[2, 3]], "a")
        g_b = kv.fence.open([[5]], "b")
        # Blocks outside the reservation: refused, nothing written, the request fails.
        sender.write("a", g_a, 0, 0, _kv(9.0, 4), _slots([5]), np.array([5]))
        kv.wait("refusal")
        assert kv.refused[-1][0] == "a" and "outside" in kv.refused[-1][1]
        # A frame naming another request's reservation.
        sender.write("a", g_b, 0, 0, _kv(9.0, 4), _slots([5]), np.array([5]))
        kv.wait("refusal")
        assert kv.refused[-1][0] == "a" and "another request" in kv.refused[-1][1]
        # The connection still serves: a good frame lands, then its end marker.
        sender.write("a", g_a, 1, 0, _kv(1.0, 8), _slots([2, 3]), np.array([2, 3]))
        sender.finish("a", g_a)
        kv.wait("landing")
        assert kv.landed == ["a"]
        assert float(kv.caches[1][:, 2:4].min()) == 1.0
        assert float(kv.caches[0].abs().max()) == 0.0 and float(kv.caches[1][:, 5].abs().max()) == 0.0
        assert kv.receiver.num_refused_frames == 2
    finally:
        sender.close()


@pytest.mark.parametrize("case", ["more-than-reserved", "size-mismatch", "unknown-layer", "huge-header"])
def test_kv_frame_of_an_untrustworthy_size_closes_the_connection(kv, case):
    """Without writing and before allocating: the header alone is refused."""
    generation = kv.fence.open([[1]], "r")
    row_bytes = 2 * HEADS * DIM * 4
    sock = socket.create_connection((kv.receiver.host, kv.receiver.port), timeout=5)
    try:
        from epdserve.auth import prove_to_peer

        prove_to_peer(sock, KEY, b"kv")
        if case == "huge-header":
            sock.sendall(struct.pack("!I", 1 << 30))
        else:
            tokens, size, layer = {"more-than-reserved": (8, 8 * row_bytes, 0),
                                   "size-mismatch": (4, (1 << 31), 0),
                                   "unknown-layer": (4, 4 * row_bytes, LAYERS)}[case]
            sock.sendall(_raw_frame(LayerFrame("r", generation, layer, tokens, size)))
        assert closed_by_peer(sock)
    finally:
        sock.close()
    assert float(kv.caches[0].abs().max()) == 0.0 and kv.landed == []
    if case != "huge-header":
        assert [rid for rid, _ in kv.refused] == ["r"]


# -- embedding slabs over TCP -----------------------------------------------------------
def test_slab_listener_refuses_strangers_and_frames_outside_the_slab():
    rows = torch.zeros(8, 4, dtype=torch.float32)
    landed = []
    receiver = TcpSlabReceiver(rows, lambda rid, i: landed.append((rid, i)), lambda *a: True, threading.Lock(), KEY)
    try:
        with pytest.raises(AuthError):
            TcpSlabSender(receiver.host, receiver.port, 8, 4, torch.float32, new_key())
        sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
        with sock:
            from epdserve.auth import prove_to_peer

            prove_to_peer(sock, KEY, b"slab")
            header = msgspec.msgpack.encode(SlabFrame("r", 0, 6, 4, 4 * 4 * 4))  # rows 6..10 of 8
            sock.sendall(struct.pack("!I", len(header)) + header + bytes(64))
            assert closed_by_peer(sock)
        assert receiver.num_refused_peers == 1 and receiver.num_refused_frames == 1
        assert float(rows.abs().max()) == 0.0 and landed == []
    finally:
        receiver.close()


# -- which way a peer is reached ----------------------------------------------------------
def test_transport_is_chosen_by_node():
    here = this_node()
    assert pick_transport("auto", "seg", 1234, here) == "shm"
    assert pick_transport("auto", "seg", 1234, "another-node") == "tcp"
    assert pick_transport("tcp", "", 1234, here) == "tcp"
    with pytest.raises(ValueError, match="another node"):
        pick_transport("shm", "seg", 0, "another-node")


# -- the router's control socket --------------------------------------------------------
def _register(worker_id: str) -> m.Register:
    return m.Register(worker_id=worker_id, role="colocated", pid=1, host="h", model_name="x", max_model_len=64,
                      num_kv_blocks=4, block_size=16)


def test_router_admits_only_members_and_each_speaks_for_itself():
    """A socket without the key (plain, or CURVE with another secret) never gets a Register
    through; a member's frames that speak for another worker are dropped."""

    async def scenario() -> dict:
        router = Router(KEY)
        await router.start()
        ctx = zmq.Context()
        sockets = []

        def dealer(identity: str, key: bytes | None) -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)  # a stranger's handshake fails: its sends never leave
            if key is not None:
                make_curve_client(sock, key)
            sock.connect(router.address)
            sockets.append(sock)
            return sock

        try:
            for name, key in (("plain", None), ("wrong", new_key())):
                try:
                    dealer(name, key).send(m.encode(_register(name)))
                except zmq.Again:
                    pass
            member = dealer("member", KEY)
            member.send(m.encode(_register("member")))
            member.send(m.encode(_register("victim")))  # speaks for another id
            member.send(m.encode(m.Heartbeat("victim", m.Load(0, 0, 0, 0))))
            deadline = time.monotonic() + 10
            while router.registry.get("member") is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # time for the strangers' frames, were any to get through
            return {w: router.registry.get(w) is not None for w in ("plain", "wrong", "member", "victim")}
        finally:
            for sock in sockets:
                sock.close()
            ctx.term()
            await router.close()

    assert asyncio.run(scenario()) == {"plain": False, "wrong": False, "member": True, "victim": False}
