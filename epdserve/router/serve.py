"""``epdserve serve``: the router (HTTP + worker socket) and its local worker processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from epdserve.cli_args import engine_argv
from epdserve.cluster.ray_cluster import PLACEMENTS
from epdserve.config import ENCODE_BATCH_IMAGES
from epdserve.envs import EPDSERVE_API_KEY, get_api_key
from epdserve.errors import ConfigError
from epdserve.roles import Role
from epdserve.router.admission import ADMISSION_POLICIES
from epdserve.router.role_control import add_role_switching_args, role_control_config
from epdserve.router.role_switch import ROLE_SWITCHING
from epdserve.router.workers import DEFAULT_ROUTING, ROUTING_POLICIES
from epdserve.service import parse_class_slos
from epdserve.transfer.locality import TRANSPORTS

log = logging.getLogger("epdserve.serve")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="HTTP address (loopback by default)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    g.add_argument("--router-host", default=None,
                   help="address of the worker socket, the one workers on other hosts connect to (default: loopback; "
                        "with --cluster ray, this node's address)")
    g.add_argument("--router-port", type=int, default=0, help="worker socket port (0: any free port)")
    g.add_argument("--cluster-key-file", default=None,
                   help="the cluster secret workers must prove: read from FILE, or generated and written there "
                        "(mode 0600) for workers started by hand (default: generated, handed to this server's workers only)")
    g.add_argument("--prefill-workers", type=int, default=None, help="default 1 (0 with --colocated-workers)")
    g.add_argument("--decode-workers", type=int, default=None, help="default 1 (0 with --colocated-workers)")
    g.add_argument("--colocated-workers", type=int, default=0, help="workers that prefill and decode (chunked)")
    g.add_argument("--encode-workers", type=int, default=0, help="vision encode workers in front of prefill / colocated workers")
    g.add_argument("--cores-per-worker", type=int, default=1)
    g.add_argument("--prefill-tp", type=int, default=None,
                   help="tensor-parallel size of prefill workers (default --tensor-parallel-size); it may differ "
                        "from --decode-tp: KV heads are re-sharded on the way")
    g.add_argument("--decode-tp", type=int, default=None,
                   help="tensor-parallel size of decode workers (default --tensor-parallel-size)")
    g.add_argument("--decode-num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV blocks per group of decode workers (default: --num-kv-blocks / --kv-cache-memory): "
                        "decode holds every running sequence's whole context, prefill only the prompts in flight")
    g.add_argument("--decode-no-prefix-caching", action="store_true",
                   help="decode workers keep no prefix cache: every P/D request's whole prompt KV is sent, as "
                        "when decode held nothing (prefill workers keep theirs unless --no-prefix-caching)")
    g.add_argument("--kv-transport", choices=TRANSPORTS, default="auto",
                   help="how prefill workers reach decode workers' KV pages: auto (shared memory on one node, "
                        "TCP between nodes), or always one of them")
    g.add_argument("--no-layerwise", action="store_true", help="push KV in bulk after prefill, not per layer")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds for a KV transfer to land")
    g.add_argument("--transfer-policy", choices=("fail", "recompute"), default="fail")
    g.add_argument("--max-pending", type=int, default=512, help="requests in the server at once (then 429)")
    d = parser.add_argument_group("deadlines and liveness")
    d.add_argument("--first-token-timeout", type=float, default=120.0,
                   help="seconds from admission to the first token; then the request fails (0: no limit)")
    d.add_argument("--worker-lease", type=float, default=1.0,
                   help="seconds without a heartbeat before a worker is suspected and its requests fail "
                        "(it serves again once its heartbeats return and it reconciles)")
    d.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds one worker step may run before the worker is treated like a dead one")
    d.add_argument("--decode-queue-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="P/D: seconds a request may wait (by service class and priority, then arrival) for KV blocks or a sequence "
                        "seat on a full decode worker; then 503 no_kv_blocks (0: 503 at once)")
    d.add_argument("--reservation-lease", type=float, default=120.0,
                   help="decode workers: seconds a KV reservation waits for its KV before it expires")
    g.add_argument("--routing", choices=ROUTING_POLICIES, default=DEFAULT_ROUTING,
                   help="pick the worker with the fewest prompt tokens still to prefill (then fewest requests), "
                        "by requests in hand alone, or by predicted time to first token from the KV blocks "
                        "each worker holds (prefix-aware)")
    g.add_argument("--routing-ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="prefix-aware: among workers predicted to meet this TTFT, take the one that computes "
                        "the fewest prompt tokens (default: the fastest predicted)")
    g.add_argument("--service-class-slo", action="append", default=None, metavar="CLASS=ttft:MS[,tpot:MS]",
                   help="a service class's SLO (classes: realtime, interactive, batch; requests name theirs by "
                        "service_tier or priority); /metrics counts the requests that met it "
                        "(epdserve_class_requests_total)")
    g.add_argument("--admission", choices=ADMISSION_POLICIES, default="queue",
                   help="queue: refuse only at the queue bounds (429) and KV bounds (503); predictive: also refuse "
                        "at once (429 slo_unreachable, Retry-After) a request of a class with a TTFT SLO that no "
                        "worker is predicted to meet from what is queued there (batch work is deferred instead)")
    add_role_switching_args(parser.add_argument_group("role switching"), ROLE_SWITCHING)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: $EPDSERVE_API_KEY, "
                        "which keeps the key out of process listings)")
    g.add_argument("--public-metrics", action="store_true", help="serve /metrics, /v1/workers, /v1/roles and /v1/traffic without the API key")
    g.add_argument("--max-n", type=int, default=16, help="sequences one request may ask for (n)")
    g.add_argument("--max-request-bytes", type=int, default=64 << 20,
                   help="largest request body in bytes (then 413)")
    g.add_argument("--served-model-name", action="append", default=None, help="model names clients may use")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument("--max-worker-restarts", type=int, default=5,
                   help="restart a worker that dies at most N times in 10 minutes, with back-off (0: never)")
    g.add_argument("--worker-log-dir", default=None, help="write each worker's output to DIR/<id>.log")
    g.add_argument("--step-trace-dir", default=None,
                   help="each prefill/decode/colocated worker writes its model steps (shape, time in service), "
                        "each encode worker its encoder batches, to DIR/<id>.jsonl, for epdserve calibrate")
    v = parser.add_argument_group("images")
    v.add_argument("--vision", default=None,
                   help="take images: the vision tower ('default', 'smolvlm-256m'; a VLM checkpoint brings its own). "
                        "Implied by --encode-workers; without encode workers the consumers encode in-process")
    v.add_argument("--no-encode-pipeline", action="store_true",
                   help="prefill waits for all of a request's images (default: starts as they arrive)")
    v.add_argument("--embed-slab-mb", type=float, default=64.0, help="embedding slab per prefill/colocated worker")
    v.add_argument("--embed-transport", choices=TRANSPORTS, default="auto",
                   help="how encode workers write slabs: auto (shared memory on one node, TCP between nodes), "
                        "or always one of them")
    v.add_argument("--encode-batch-images", type=int, default=ENCODE_BATCH_IMAGES,
                   help="images per encoder forward pass")
    v.add_argument("--encoder-cache-mb", type=float, default=256.0, help="content-hash embedding cache per encoder")
    v.add_argument("--max-images-per-request", type=int, default=16)
    v.add_argument("--allowed-media-domains", nargs="*", default=[], help="hosts http(s) image URLs may be fetched from")
    v.add_argument("--media-follow-redirects", action="store_true",
                   help="follow redirects of http(s) image URLs (at most 3 hops, each checked like the URL)")
    v.add_argument("--allow-private-media-addresses", action="store_true",
                   help="fetch images from loopback, private, link-local, ... addresses too")
    c = parser.add_argument_group("many machines")
    c.add_argument("--cluster", choices=("local", "ray"), default="local",
                   help="start the workers as processes on this machine, or as actors on a Ray cluster")
    c.add_argument("--ray-address", default="auto",
                   help="the Ray cluster to join ('auto': the one `ray start` runs here, or a new local one)")
    c.add_argument("--placement", choices=PLACEMENTS, default="spread",
                   help="Ray: spread workers over the nodes, pack them onto few, or put each role on the nodes "
                        "labelled with it (`ray start --labels epdserve-role=prefill`)")
    # Fault injection for tests: prefill workers never finish a KV transfer.
    g.add_argument("--debug-stall-kv-transfers", action="store_true", help=argparse.SUPPRESS)


def plan_workers(ns: argparse.Namespace) -> list[str]:
    colocated = ns.colocated_workers
    prefill = ns.prefill_workers if ns.prefill_workers is not None else (0 if colocated else 1)
    decode = ns.decode_workers if ns.decode_workers is not None else (0 if colocated else 1)
    if min(prefill, decode, colocated) < 0:
        raise ConfigError("worker counts must not be negative")
    encode = ns.encode_workers
    if encode < 0:
        raise ConfigError("worker counts must not be negative")
    if (prefill > 0) != (decode > 0):
        raise ConfigError("P/D serving needs at least one prefill and one decode worker")
    if prefill + decode + colocated == 0:
        raise ConfigError("no workers requested")
    if ns.cores_per_worker < 1:
        raise ConfigError("--cores-per-worker must be at least 1")
    if encode and ns.embed_slab_mb <= 0:
        raise ConfigError("encode workers need --embed-slab-mb > 0")
    if ns.max_n < 1 or ns.max_request_bytes < 1:
        raise ConfigError("--max-n and --max-request-bytes must be at least 1")
    if ns.max_images_per_request < 1 or ns.encode_batch_images < 1:
        raise ConfigError("--max-images-per-request and --encode-batch-images must be at least 1")
    if ns.role_switching != "off" and colocated and (prefill or decode):
        raise ConfigError("--role-switching moves workers within one layout: P/D or colocated, not both")
    sizes = {"--tensor-parallel-size": ns.tensor_parallel_size, "--prefill-tp": ns.prefill_tp,
             "--decode-tp": ns.decode_tp}
    for flag, size in sizes.items():
        if size is not None and size < 1:
            raise ConfigError(f"{flag} must be at least 1")
    if ns.decode_num_kv_blocks is not None and (ns.decode_num_kv_blocks < 2 or not decode):
        raise ConfigError("--decode-num-kv-blocks takes at least 2 blocks, for decode workers")
    if ns.decode_no_prefix_caching and (not decode or ns.role_switching != "off"):
        raise ConfigError("--decode-no-prefix-caching is for decode workers that keep their role "
                          "(without --role-switching)")
    tps = {Role.PREFILL: role_tp(ns, Role.PREFILL), Role.DECODE: role_tp(ns, Role.DECODE),
           Role.COLOCATED: ns.tensor_parallel_size}
    used = [tps[role] for role, count in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.COLOCATED, colocated))
            if count]
    if max(used, default=1) > 1 and (encode or ns.role_switching != "off"):
        raise ConfigError("tensor-parallel size > 1 serves text workers without role switching for now (the "
                          "vision encoder runs whole; a switch would re-shard the weights)")
    if max(used, default=1) > ns.cores_per_worker:
        raise ConfigError(f"tensor-parallel size {max(used)} needs --cores-per-worker >= {max(used)} (a core per rank)")
    # Encode workers first: with fewer cores than workers, they share a core with decode.
    return [Role.ENCODE] * encode + [Role.PREFILL] * prefill + [Role.DECODE] * decode + [Role.COLOCATED] * colocated


def role_tp(ns: argparse.Namespace, role: str) -> int:
    """The tensor-parallel size of ``role``'s workers: --prefill-tp / --decode-tp, else
    --tensor-parallel-size."""
    size = {Role.PREFILL: ns.prefill_tp, Role.DECODE: ns.decode_tp}.get(role)
    return ns.tensor_parallel_size if size is None else size


def is_vlm_checkpoint(model: str | None) -> bool:
    """Whether ``model`` is a vision-language checkpoint directory (it takes images by itself)."""
    if model is None or not os.path.isdir(model):
        return False
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "idefics3"
    except (OSError, ValueError, AttributeError):
        return False


def vision_args(ns: argparse.Namespace, is_vlm_checkpoint: bool) -> tuple[str | None, list[str], list[str]]:
    """The vision tower to serve (None: text only), and the extra flags of consumer and
    encode workers."""
    if ns.vision is not None:
        vision = ns.vision
    elif is_vlm_checkpoint:
        vision = "checkpoint"  # the directory's own tower and connector
    else:
        vision = "default" if ns.encode_workers else None
    if vision is None:
        return None, [], []
    common = ["--vision", vision, "--encode-batch-images", str(ns.encode_batch_images),
              "--encoder-cache-mb", str(ns.encoder_cache_mb)]
    slab = ["--embed-slab-mb", str(ns.embed_slab_mb), "--embed-transport", ns.embed_transport]
    consumer = common + (slab if ns.encode_workers else [])
    return vision, consumer, common


async def serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from epdserve.auth import serve_key
    from epdserve.cluster.local import (
        LocalWorker,
        RestartPolicy,
        WorkerSupervisor,
        assign_cores,
        spawn_worker,
        stop_workers,
    )
    from epdserve.cluster.ray_cluster import RayWorkers
    from epdserve.config import resolve_device_name
    from epdserve.gc_heap import freeze_startup_heap
    from epdserve.models.loader import load_model_info
    from epdserve.models.multimodal import RANDOM_VISION_NOTICE, load_multimodal_spec
    from epdserve.router.api import ServedModel, create_app
    from epdserve.router.config import RouterConfig
    from epdserve.router.core import Router
    from epdserve.router.images import ImageLimits

    roles = plan_workers(ns)
    restart_policy = RestartPolicy(max_restarts=ns.max_worker_restarts)
    key = serve_key(ns.cluster_key_file)
    ray_workers = None
    router_host = ns.router_host or "127.0.0.1"
    if ns.cluster == "ray":
        ray_workers = RayWorkers.connect(ns.ray_address, key, ns.placement, ns.cores_per_worker,
                                         ns.max_worker_restarts)
        router_host = ns.router_host or ray_workers.node_address()
    resolve_device_name(ns.device)  # a bad --device fails here, before any worker starts
    if ns.worker_log_dir:
        os.makedirs(ns.worker_log_dir, exist_ok=True)
    info = load_model_info(ns.model)
    mm_spec = None
    vision, consumer_extra, encode_extra = vision_args(ns, is_vlm_checkpoint(ns.model))
    if vision is not None:
        mm_spec = load_multimodal_spec(ns.model, vision)
        if mm_spec.is_random_init:
            print(f"epdserve: note: {RANDOM_VISION_NOTICE}", flush=True)
    max_model_len = ns.max_model_len or min(info.spec.max_position_embeddings, 4096)
    names = tuple(ns.served_model_name or [info.spec.name])
    limits = ImageLimits(max_images_per_request=ns.max_images_per_request,
                         allowed_media_domains=tuple(ns.allowed_media_domains),
                         follow_redirects=ns.media_follow_redirects,
                         allow_private_addresses=ns.allow_private_media_addresses)
    served = ServedModel(names, info.tokenizer, max_model_len, info.spec.vocab_size, mm_spec, limits, ns.max_n,
                         architecture=info.spec.architecture)
    # Structured outputs check grammars against the tokenizer: built meanwhile, not at the first
    # such request (a daemon thread: nothing to stop).
    threading.Thread(target=served.grammar_tokenizer, name="grammar-tokenizer", daemon=True).start()
    class_slos = parse_class_slos(ns.service_class_slo)
    config = RouterConfig(transfer_timeout_s=ns.transfer_timeout, transfer_policy=ns.transfer_policy,
                          max_pending=ns.max_pending, encode_pipelined=not ns.no_encode_pipeline,
                          routing=ns.routing, routing_ttft_slo_s=ns.routing_ttft_slo,
                          class_slos=class_slos, admission=ns.admission,
                          role_switching=ns.role_switching, role_control=role_control_config(ns, class_slos),
                          heartbeat_timeout_s=ns.worker_lease,
                          step_timeout_s=ns.step_timeout, first_token_timeout_s=ns.first_token_timeout,
                          decode_queue_timeout_s=ns.decode_queue_timeout)
    router = Router(key, config, host=router_host, port=ns.router_port)
    await router.start()
    started = time.monotonic()
    owned_host_tier = None
    if ns.kv_host_tier_gib and not ns.kv_host_tier_dir and ray_workers is None:
        # A host tier of this server alone: its workers share it, and it goes when they do.
        owned_host_tier = ns.kv_host_tier_dir = tempfile.mkdtemp(prefix="epdserve-kv-", dir="/dev/shm")
    extra = engine_argv(ns) + ["--kv-transport", ns.kv_transport]
    if ray_workers is None:
        extra += ["--kv-host", router_host]  # the address other hosts reach this one by
    extra += ["--no-layerwise"] if ns.no_layerwise else []
    extra += ["--debug-stall-kv-transfers"] if ns.debug_stall_kv_transfers else []
    workers: list[LocalWorker] = []
    supervisor = WorkerSupervisor(restart_policy, lambda w: router.watch_process(w.worker_id, w.pid))
    counters: dict[str, int] = {}

    def exited() -> list[str]:
        """Workers whose process (or Ray actor) ended."""
        if ray_workers is not None:
            return ray_workers.stopped()
        return [w.worker_id for w in workers if w.process.poll() is not None]

    for role, cores in zip(roles, assign_cores(len(roles), ns.cores_per_worker)):
        counters[role] = counters.get(role, 0) + 1
        worker_id = f"{role}-{counters[role] - 1}"
        log_path = f"{ns.worker_log_dir}/{worker_id}.log" if ns.worker_log_dir else None
        # A worker that may switch roles takes the options of every role it may take.
        may_switch = ns.role_switching != "off" and role != Role.ENCODE
        role_extra = (encode_extra if role == Role.ENCODE
                      else consumer_extra if role in (Role.PREFILL, Role.COLOCATED) or may_switch else [])
        if role == Role.DECODE or may_switch:
            role_extra = [*role_extra, "--reservation-lease", str(ns.reservation_lease)]
        if ns.step_trace_dir:
            role_extra = [*role_extra, "--step-trace-dir", ns.step_trace_dir]
        if role in (Role.PREFILL, Role.DECODE):
            role_extra = [*role_extra, "--tensor-parallel-size", str(role_tp(ns, role))]
        if role == Role.DECODE and ns.decode_num_kv_blocks is not None:
            role_extra = [*role_extra, "--num-kv-blocks", str(ns.decode_num_kv_blocks)]
        if role == Role.DECODE and ns.decode_no_prefix_caching and not ns.no_prefix_caching:
            role_extra = [*role_extra, "--no-prefix-caching"]
        if ray_workers is not None:
            ray_workers.start(worker_id, role, router.address, extra + role_extra, log_path)
            continue
        worker = spawn_worker(worker_id, role, router.address, cores, extra + role_extra, log_path, key)
        workers.append(worker)
        supervisor.add(worker)
        router.watch_process(worker_id, worker.pid)
    try:
        need = {role: roles.count(role) for role in set(roles)}
        if not await router.wait_for_workers(need, ns.startup_timeout, lambda: not exited()):
            dead = exited()
            if dead:
                logs = f" (logs in {ns.worker_log_dir})" if ns.worker_log_dir else ""
                print(f"epdserve: error: workers exited during start-up: {', '.join(dead)}{logs}", file=sys.stderr)
            else:
                print(f"epdserve: error: workers did not register within {ns.startup_timeout:g} s", file=sys.stderr)
            return 2
        supervisor.start()
        api_key = ns.api_key or get_api_key()
        app = create_app(router, served, api_key, max_request_bytes=ns.max_request_bytes,
                         public_metrics=ns.public_metrics)
        # Start-up is done: what is alive now (framework, tokenizer, libraries) stays alive.
        router.metrics.gc_frozen.set(freeze_startup_heap())
        # The listening socket exists before uvicorn runs: its port is known, and connections
        # made right after the ready line wait in its backlog.
        try:
            sock = socket.create_server((ns.host, ns.port), backlog=2048)
        except OSError as e:
            print(f"epdserve: error: cannot listen on {ns.host}:{ns.port}: {e.strerror}", file=sys.stderr)
            return 2
        port = sock.getsockname()[1]
        # Idle connections stay open longer than clients keep them (aiohttp 15 s, bench 60 s), so a
        # client never reuses a connection the server is closing under it.
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, timeout_keep_alive=75)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        layout = ", ".join(f"{need[r]} {r}" for r in (Role.ENCODE, Role.PREFILL, Role.DECODE, Role.COLOCATED) if r in need)
        url = f"http://{ns.host}:{port}"
        print(f"epdserve ready in {time.monotonic() - started:.1f} s: {url} ({layout}; model {names[0]}; "
              f"workers connect to {router.address})", flush=True)
        # The key itself is never printed: the line reads it from the environment.
        auth = f' -H "Authorization: Bearer ${EPDSERVE_API_KEY}"' if api_key else ""
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{names[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
              f"\"max_tokens\": 32}}'", flush=True)
        await serving
        return 0
    finally:
        supervisor.close()  # before the router tells the workers to shut down: no restarts
        await router.close()
        stop_workers(supervisor.workers)
        if ray_workers is not None:
            ray_workers.stop()
        if owned_host_tier is not None:
            shutil.rmtree(owned_host_tier, ignore_errors=True)
