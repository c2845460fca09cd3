"""``epdserve serve``: the router (HTTP + worker socket) and its local worker processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time

from epdserve.errors import ConfigError

log = logging.getLogger("epdserve.serve")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="HTTP address (loopback by default)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    g.add_argument("--router-port", type=int, default=0, help="worker socket port (0: any free port)")
    g.add_argument("--prefill-workers", type=int, default=None, help="default 1 (0 with --colocated-workers)")
    g.add_argument("--decode-workers", type=int, default=None, help="default 1 (0 with --colocated-workers)")
    g.add_argument("--colocated-workers", type=int, default=0, help="workers that prefill and decode (chunked)")
    g.add_argument("--cores-per-worker", type=int, default=1)
    g.add_argument("--kv-transport", choices=("shm", "tcp"), default="shm")
    g.add_argument("--no-layerwise", action="store_true", help="push KV in bulk after prefill, not per layer")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds for a KV transfer to land")
    g.add_argument("--transfer-policy", choices=("fail", "recompute"), default="fail")
    g.add_argument("--max-pending", type=int, default=512, help="requests in the server at once (then 429)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", action="append", default=None, help="model names clients may use")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--worker-log-dir", default=None, help="write each worker's output to DIR/<id>.log")
    # Fault injection for tests: prefill workers never finish a KV transfer.
    g.add_argument("--debug-stall-kv-transfers", action="store_true", help=argparse.SUPPRESS)


def worker_engine_args(ns: argparse.Namespace) -> list[str]:
    """The engine options of ``serve`` passed on to its workers."""
    args = ["--dtype", ns.dtype, "--device", ns.device, "--block-size", str(ns.block_size),
            "--max-num-seqs", str(ns.max_num_seqs), "--kv-cache-memory", str(ns.kv_cache_memory),
            "--seed", str(ns.seed)]
    if ns.model is not None:
        args += ["--model", ns.model]
    for flag, value in (("--max-model-len", ns.max_model_len), ("--max-num-batched-tokens", ns.max_num_batched_tokens),
                        ("--num-kv-blocks", ns.num_kv_blocks)):
        if value is not None:
            args += [flag, str(value)]
    if ns.no_prefix_caching:
        args.append("--no-prefix-caching")
    if ns.no_chunked_prefill:
        args.append("--no-chunked-prefill")
    return args


def plan_workers(ns: argparse.Namespace) -> list[str]:
    colocated = ns.colocated_workers
    prefill = ns.prefill_workers if ns.prefill_workers is not None else (0 if colocated else 1)
    decode = ns.decode_workers if ns.decode_workers is not None else (0 if colocated else 1)
    if min(prefill, decode, colocated) < 0:
        raise ConfigError("worker counts must not be negative")
    if (prefill > 0) != (decode > 0):
        raise ConfigError("P/D serving needs at least one prefill and one decode worker")
    if prefill + decode + colocated == 0:
        raise ConfigError("no workers requested")
    if ns.cores_per_worker < 1:
        raise ConfigError("--cores-per-worker must be at least 1")
    return ["prefill"] * prefill + ["decode"] * decode + ["colocated"] * colocated


async def serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from epdserve.cluster.local import LocalWorker, assign_cores, spawn_worker, stop_workers
    from epdserve.models.loader import load_model_info
    from epdserve.router.api import ServedModel, create_app
    from epdserve.router.core import Router, RouterConfig

    roles = plan_workers(ns)
    if ns.worker_log_dir:
        os.makedirs(ns.worker_log_dir, exist_ok=True)
    info = load_model_info(ns.model)
    max_model_len = ns.max_model_len or min(info.spec.max_position_embeddings, 4096)
    names = tuple(ns.served_model_name or [info.spec.name])
    served = ServedModel(names, info.tokenizer, max_model_len, info.spec.vocab_size)
    config = RouterConfig(transfer_timeout_s=ns.transfer_timeout, transfer_policy=ns.transfer_policy,
                          max_pending=ns.max_pending)
    router = Router(config, port=ns.router_port)
    await router.start()
    started = time.monotonic()
    extra = worker_engine_args(ns) + ["--kv-transport", ns.kv_transport]
    extra += ["--no-layerwise"] if ns.no_layerwise else []
    extra += ["--debug-stall-kv-transfers"] if ns.debug_stall_kv_transfers else []
    workers: list[LocalWorker] = []
    counters: dict[str, int] = {}
    for role, cores in zip(roles, assign_cores(len(roles), ns.cores_per_worker)):
        counters[role] = counters.get(role, 0) + 1
        worker_id = f"{role}-{counters[role] - 1}"
        log_path = f"{ns.worker_log_dir}/{worker_id}.log" if ns.worker_log_dir else None
        worker = spawn_worker(worker_id, role, router.address, cores, extra, log_path)
        workers.append(worker)
        router.watch_process(worker_id, worker.pid)
    try:
        need = {role: roles.count(role) for role in set(roles)}
        if not await router.wait_for_workers(need, ns.startup_timeout):
            dead = [w.worker_id for w in workers if w.process.poll() is not None]
            detail = f"; exited: {', '.join(dead)}" if dead else ""
            print(f"epdserve: error: workers did not register within {ns.startup_timeout:g} s{detail}", file=sys.stderr)
            return 2
        app = create_app(router, served, ns.api_key)
        # The listening socket exists before uvicorn runs: its port is known, and connections
        # made right after the ready line wait in its backlog.
        try:
            sock = socket.create_server((ns.host, ns.port), backlog=2048)
        except OSError as e:
            print(f"epdserve: error: cannot listen on {ns.host}:{ns.port}: {e.strerror}", file=sys.stderr)
            return 2
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        layout = ", ".join(f"{need[r]} {r}" for r in ("prefill", "decode", "colocated") if r in need)
        url = f"http://{ns.host}:{port}"
        print(f"epdserve ready in {time.monotonic() - started:.1f} s: {url} ({layout}; model {names[0]}; "
              f"workers connect to {router.address})", flush=True)
        auth = f" -H 'Authorization: Bearer {ns.api_key}'" if ns.api_key else ""
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{names[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
              f"\"max_tokens\": 32}}'", flush=True)
        await serving
        return 0
    finally:
        await router.close()
        stop_workers(workers)
