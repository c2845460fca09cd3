"""``epdserve worker``: its flags, and the options and engine arguments they make.

    epdserve worker --role prefill|decode|colocated|encode --router tcp://HOST:PORT [options]

A worker started by hand (on this machine or another) proves the cluster secret from
``--cluster-key-file`` or ``$EPDSERVE_CLUSTER_KEY``. ``epdserve serve`` starts its own workers
with the same flags, as processes (cluster/local.py) or Ray actors (cluster/ray_cluster.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from epdserve.auth import worker_key
from epdserve.cli_args import add_engine_args, engine_args_from
from epdserve.config import ENCODE_BATCH_IMAGES
from epdserve.errors import EpdserveError
from epdserve.transfer.locality import TRANSPORTS

EXIT_USAGE = 2


def add_worker_args(wrk: argparse.ArgumentParser) -> None:
    wrk.add_argument("--role", required=True, choices=("colocated", "prefill", "decode", "encode"))
    wrk.add_argument("--router", required=True, help="the router's worker socket, tcp://HOST:PORT")
    wrk.add_argument("--worker-id", default=None)
    wrk.add_argument("--cores", default="", help="comma-separated CPU cores to pin to")
    wrk.add_argument("--cluster-key-file", default=None,
                     help="the cluster secret (the file `epdserve serve --cluster-key-file` wrote; "
                          "default: $EPDSERVE_CLUSTER_KEY)")
    wrk.add_argument("--kv-transport", choices=TRANSPORTS, default="auto",
                     help="decode: how prefill workers reach its KV pages (auto: shared memory on this node, "
                          "TCP from other nodes)")
    wrk.add_argument("--kv-host", default="127.0.0.1",
                     help="the address this worker's KV (decode) or slab (prefill/colocated) listener binds and "
                          "offers to workers on other nodes")
    wrk.add_argument("--no-layerwise", action="store_true", help="prefill: push KV in bulk after prefill")
    wrk.add_argument("--reservation-lease", type=float, default=120.0,
                     help="decode: seconds a KV reservation waits for its KV before it expires")
    wrk.add_argument("--vision", default=None, help="take images with this vision tower: 'default' or 'smolvlm-256m' (seeded), 'checkpoint' (the model directory's own)")
    wrk.add_argument("--embed-slab-mb", type=float, default=0.0, help="prefill/colocated: embedding slab for encode workers (0: encode in-process)")
    wrk.add_argument("--embed-transport", choices=TRANSPORTS, default="auto", help="how encode workers reach the slab")
    wrk.add_argument("--encode-batch-images", type=int, default=ENCODE_BATCH_IMAGES,
                     help="images per encoder forward pass")
    wrk.add_argument("--encoder-cache-mb", type=float, default=256.0, help="content-hash embedding cache")
    wrk.add_argument("--step-trace-dir", default=None, help="write every model step (encode: every encoder batch) to DIR/<worker id>.jsonl (for epdserve calibrate)")
    wrk.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    wrk.add_argument("--debug-stall-kv-transfers", action="store_true", help=argparse.SUPPRESS)
    add_engine_args(wrk)


def add_worker_parser(sub) -> None:
    """``worker`` as a subcommand of ``epdserve``."""
    wrk = sub.add_parser("worker", help="a worker that registers with a running router")
    add_worker_args(wrk)
    wrk.set_defaults(func=run_worker_command)


def run_worker_command(ns: argparse.Namespace) -> int:
    """The body of ``epdserve worker``: its exit status."""
    # Imported here: they bring torch, which the other subcommands (simulate, plan, bench,
    # their --help) never need, and build_parser imports this module for every one of them.
    from epdserve.cluster.encode_worker import EncodeWorkerOptions, run_encode_worker
    from epdserve.cluster.worker import WorkerOptions, run_worker

    engine_args = engine_args_from(ns) if ns.role != "encode" else None  # bad flags fail before the key is read
    key = worker_key(ns.cluster_key_file)
    cores = tuple(int(c) for c in ns.cores.split(",")) if ns.cores else ()
    if ns.role == "encode":
        return run_encode_worker(EncodeWorkerOptions(
            router=ns.router, worker_id=ns.worker_id or f"encode-{os.getpid()}", model=ns.model,
            vision=ns.vision, dtype=ns.dtype, device=ns.device, seed=ns.seed, cores=cores,
            max_batch_images=ns.encode_batch_images, cache_bytes=int(ns.encoder_cache_mb * (1 << 20)),
            die_with_parent=ns.die_with_parent, cluster_key=key, step_trace_dir=ns.step_trace_dir,
        ))
    opts = WorkerOptions(
        role=ns.role, router=ns.router, cores=cores, kv_transport=ns.kv_transport, kv_host=ns.kv_host,
        layerwise=not ns.no_layerwise, die_with_parent=ns.die_with_parent,
        reservation_lease_s=ns.reservation_lease,
        stall_kv_transfers=ns.debug_stall_kv_transfers, vision=ns.vision, embed_slab_mb=ns.embed_slab_mb,
        embed_transport=ns.embed_transport,
        max_batch_images=ns.encode_batch_images, encoder_cache_mb=ns.encoder_cache_mb,
        step_trace_dir=ns.step_trace_dir, cluster_key=key,
        **({"worker_id": ns.worker_id} if ns.worker_id else {}),
    )
    return run_worker(opts, engine_args)


def run_worker_argv(argv: Sequence[str]) -> int:
    """``epdserve worker ARGV`` in this process (a Ray actor's body): its exit status."""
    parser = argparse.ArgumentParser(prog="epdserve worker")
    add_worker_args(parser)
    ns = parser.parse_args(argv)
    try:
        return run_worker_command(ns)
    except EpdserveError as e:
        print(f"epdserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
