"""A byte relay from a loopback port inside a network namespace to one in this namespace.

    python -m epdserve.bench.experiments.relay --netns NS --target 127.0.0.1:PORT

prints ``relay listening on 127.0.0.1:<port> in NS`` once its listening socket exists (created
inside NS), then copies bytes both ways for every connection until it is terminated or its
parent exits. Workers started inside NS reach the router through it.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import signal
import socket

from epdserve.bench.experiments.netns import InNamespace

READ_BYTES = 2**16
PR_SET_PDEATHSIG = 1


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(READ_BYTES):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _relay(listener: socket.socket, target_host: str, target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, target_writer), _pump(target_reader, writer))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m epdserve.bench.experiments.relay")
    parser.add_argument("--netns", required=True, help="namespace whose loopback the relay listens on")
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to, in this namespace")
    ns = parser.parse_args()
    host, _, port = ns.target.rpartition(":")
    ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # exit with the experiment
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with InNamespace(ns.netns):
        listener = socket.create_server(("127.0.0.1", 0))
    print(f"relay listening on 127.0.0.1:{listener.getsockname()[1]} in {ns.netns}", flush=True)
    try:
        asyncio.run(_relay(listener, host, int(port)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
