"""Tensor parallelism: a worker of TP N is N rank processes joined by ``torch.distributed``.

Rank 0 is the engine: it schedules, keeps the block tables and samples. Ranks 1..N-1 are
followers it spawns; each holds its shard of every layer's weights and its KV heads (split
across ranks, or replicated when TP exceeds the model's KV heads: ``local_kv_heads``),
pinned to its share of the worker's cores. Each step rank 0 sends the step's inputs
(``StepInputs``: plain lists, so every rank addresses its own pages with the same block
tables) down a pipe to each follower, and every rank runs the same forward pass;
row-parallel layers all-reduce and the LM head all-gathers over the process group (gloo on
CPU, NCCL on CUDA). Only rank 0's sampler draws::

    rank 0 (engine)                          ranks 1..N-1
    schedule -> StepInputs  ----pipe---->    StepInputs
    forward(shard 0)        <-all-reduce->   forward(shard r)
    logits (all-gathered) -> sample          logits (dropped)

The pipes carry no collective, so an idle follower waits on its pipe without a timeout. A
follower exits when rank 0 says so or its pipe closes (rank 0's process is gone).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from epdserve.engine.forward import StepInputs, run_forward
from epdserve.errors import ConfigError
from epdserve.transfer.shm_pool import SharedKVPool
from epdserve.transfer.tp_plan import kv_heads_of_rank

log = logging.getLogger("epdserve.engine")

_JOIN_TIMEOUT_S = 300.0  # a follower starts and loads its shard within this
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one collective (a step's all-reduce) within this


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds (``kv_heads_of_rank``, the rule ``QKVParallelLinear`` shards by)."""
    try:
        return kv_heads_of_rank(num_kv_heads, 0, tp_size)[1]
    except ValueError:
        raise ConfigError(f"the model's {num_kv_heads} KV heads do not split over --tensor-parallel-size "
                          f"{tp_size} (nor is it a multiple of them)") from None


def rank_cores(cores: list[int], rank: int, tp_size: int) -> list[int]:
    """Rank ``rank``'s share of the worker's cores: consecutive, wrapping around (shared)
    when there are fewer cores than ranks."""
    per_rank = max(1, len(cores) // tp_size)
    return [cores[(rank * per_rank + i) % len(cores)] for i in range(per_rank)]


@dataclass(frozen=True)
class _FollowerArgs:
    model: str | None
    dtype: str
    device: str
    rank: int
    tp_size: int
    init_method: str
    cores: tuple[int, ...]


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> torch.device:
    """Rank r on CUDA uses device r (counted from the one the worker was given)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


class TPGroup:
    """Rank 0's side: the followers, their pipes and the process group."""

    def __init__(self, model: str | None, dtype: str, device: str, tp_size: int) -> None:
        if tp_size < 2:
            raise ValueError("a TP group has at least two ranks")
        self.tp_size = tp_size
        self.device = _rank_device(device, 0)
        if self.device.type == "cuda" and torch.cuda.device_count() < tp_size:
            raise ConfigError(f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs; "
                              f"{torch.cuda.device_count()} visible")
        with socket.socket() as s:  # a free port for the ranks to meet at (loopback)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_method = f"tcp://127.0.0.1:{port}"
        cores = sorted(os.sched_getaffinity(0))
        ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's threads
        self.followers, self.pipes = [], []
        for r in range(1, tp_size):
            ours, theirs = ctx.Pipe()
            args = _FollowerArgs(model, dtype, device, r, tp_size, init_method, tuple(rank_cores(cores, r, tp_size)))
            process = ctx.Process(target=_follower_main, name=f"epdserve-tp-rank{r}", args=(args, theirs), daemon=True)
            process.start()
            theirs.close()
            self.followers.append(process)
            self.pipes.append(ours)
        self.closed = False
        atexit.register(self.close)
        for r, _ in enumerate(self.pipes, 1):
            self._receive(r, "start")  # each follower is up before the group forms
        own = rank_cores(cores, 0, tp_size)
        os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own))
        dist.init_process_group(_backend(device), init_method=init_method, rank=0, world_size=tp_size,
                                timeout=_COLLECTIVE_TIMEOUT)

    def _receive(self, rank: int, what: str) -> object:
        """Rank ``rank``'s next message (bounded; a follower that died says so at once)."""
        pipe, process = self.pipes[rank - 1], self.followers[rank - 1]
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while not pipe.poll(0.2):
            if not process.is_alive() or time.monotonic() > deadline:
                self.close()
                why = f"exited with code {process.exitcode}" if not process.is_alive() else "did not answer"
                raise ConfigError(f"tensor-parallel rank {rank} {why} ({what})")
        try:
            return pipe.recv()
        except EOFError:
            self.close()
            raise ConfigError(f"tensor-parallel rank {rank} exited ({what})") from None

    def check_ready(self, error: str = "") -> None:
        """Every rank has loaded its shard (rank 0's ``error`` if it failed); raises naming
        the ranks that could not."""
        statuses = [error] + [self._receive(r, "loading its shard") for r in range(1, self.tp_size)]
        failed = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
        if failed:
            self.close()
            raise ConfigError("tensor-parallel ranks failed to load: " + "; ".join(failed))

    def send(self, command: tuple) -> None:
        for pipe in self.pipes:
            pipe.send(command)

    def allocate_kv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, layer_to_group: list[int],
                    block_size: int) -> None:
        """Each follower allocates its pages: the same block ids, its own KV heads."""
        self.send(("kv", shapes, str(dtype).removeprefix("torch."), layer_to_group, block_size))

    def attach_kv(self, pool_names: list[str], shapes: list[tuple[int, ...]], dtype: torch.dtype,
                  layer_to_group: list[int], block_size: int) -> None:
        """Each follower maps the shared pool rank 0 made for it (``pool_names[r - 1]``) as its
        pages, so that rank 0 reads and lands its KV heads (P/D)."""
        for pipe, name in zip(self.pipes, pool_names, strict=True):
            pipe.send(("kv_shm", name, shapes, str(dtype).removeprefix("torch."), layer_to_group, block_size))

    def step(self, inputs: StepInputs) -> None:
        self.send(("step", inputs))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except (OSError, ValueError):  # that follower is gone already
                pass
        deadline = time.monotonic() + 10
        for process in self.followers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(5)
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _follower_main(args: _FollowerArgs, pipe: Connection) -> None:
    from epdserve.models.loader import load_model

    os.sched_setaffinity(0, args.cores)
    torch.set_num_threads(len(args.cores))
    device = _rank_device(args.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe.send("started")
    dist.init_process_group(_backend(args.device), init_method=args.init_method, rank=args.rank,
                            world_size=args.tp_size, timeout=_COLLECTIVE_TIMEOUT)
    try:
        model = load_model(args.model, getattr(torch, args.dtype), device, args.rank, args.tp_size).model
    except Exception as e:  # reported to rank 0, which raises
        pipe.send(f"{type(e).__name__}: {e}")
        return
    pipe.send("")
    kv_caches: list[torch.Tensor] = []
    pool: SharedKVPool | None = None  # P/D: this rank's pages, shared with rank 0
    layer_to_group: list[int] = []
    block_size = 0
    with torch.inference_mode():
        while True:
            try:
                command = pipe.recv()
            except EOFError:  # rank 0 is gone
                os._exit(0)
            if command[0] == "step":
                run_forward(model, command[1], kv_caches, layer_to_group, block_size, device)
            elif command[0] == "kv":
                shapes, dtype, layer_to_group, block_size = command[1:]
                kv_caches = []  # the old pages go before the new ones are allocated
                kv_caches = [torch.zeros(s, dtype=getattr(torch, dtype), device=device) for s in shapes]
            elif command[0] == "kv_shm":
                name, shapes, dtype, layer_to_group, block_size = command[1:]
                kv_caches = []
                if pool is not None:
                    pool.close()
                pool = SharedKVPool.attach_named(name, shapes[0][1], block_size, [tuple(s[3:]) for s in shapes],
                                                 getattr(torch, dtype))
                kv_caches = pool.layers
            elif command[0] == "stop":
                break
    dist.destroy_process_group()
