"""A request that fails inside a worker fails alone; fatal errors end the worker, which restarts.

Unit tests drive ``LLMEngine`` on the real default model with injected faults
(``epdserve/faults.py``); end-to-end tests run ``epdserve serve`` (P/D and colocated) with
``--debug-fault`` and check what clients and the other requests see.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
import zmq
from conftest import PROMPTS, assert_all_blocks_free
from serving import SMALL, Server, start_server, stop_server

from epdserve.auth import CurveGate, make_curve_server, new_key
from epdserve.cluster import messages as m
from epdserve.cluster.local import RestartPolicy, WorkerLaunch, WorkerSupervisor, start_worker
from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.engine.failures import EXIT_FATAL, is_fatal
from epdserve.envs import EPDSERVE_CLUSTER_KEY
from epdserve.errors import ConfigError
from epdserve.faults import FaultKind, FaultSpec, parse_fault
from epdserve.models.loader import load_model
from epdserve.request import MMInput
from epdserve.sampling import SamplingParams

VICTIM_SEED = 7
NUM_TOKENS = 8


def greedy(seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, seed=seed, **kw)


# -- fault specs and the fatal predicate -----------------------------------------------------
def test_parse_fault_syntax():
    assert parse_fault("sample-error:7") == FaultSpec(FaultKind.SAMPLE_ERROR, 7)
    assert parse_fault("detok-error:7:3") == FaultSpec(FaultKind.DETOK_ERROR, 7, after=3)
    assert parse_fault("hang-step:7") == FaultSpec(FaultKind.HANG_STEP, 7, seconds=30.0)
    assert parse_fault("hang-step:7:2.5") == FaultSpec(FaultKind.HANG_STEP, 7, seconds=2.5)
    assert parse_fault("hang-step:7:seconds=1:after=2") == FaultSpec(FaultKind.HANG_STEP, 7, 2, 1.0)
    assert parse_fault("fatal:-3:after=1") == FaultSpec(FaultKind.FATAL, -3, after=1)


@pytest.mark.parametrize("text", ["sample-error", "boom:7", "fatal:x", "fatal:7:after=-1", "fatal:7:when=3",
                                  "sample-error:7:1.5"])
def test_bad_fault_spec_is_a_config_error(text):
    with pytest.raises(ConfigError):
        parse_fault(text)


def test_is_fatal():
    assert is_fatal(torch.OutOfMemoryError("out of memory"))
    assert is_fatal(MemoryError())
    assert is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal(KeyboardInterrupt())
    assert not is_fatal(RuntimeError("index 70000 is out of bounds"))
    assert not is_fatal(IndexError("bad token id"))


# -- the engine: step isolation ------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_model(None, torch.float32)


def make_engine(loaded, *faults: str) -> LLMEngine:
    args = EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05,
                      faults=tuple(parse_fault(f) for f in faults))
    return LLMEngine(args, loaded=loaded)


@pytest.fixture(scope="module")
def batch_prompts(smollm2_fp32) -> list[list[int]]:
    engine = make_engine(smollm2_fp32)
    return [engine.encode_prompt(p) for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def reference(smollm2_fp32, batch_prompts) -> list[list[int]]:
    """Greedy tokens of the batch without faults."""
    results = make_engine(smollm2_fp32).generate(batch_prompts, greedy())
    return [c[0].token_ids for c in results]


@pytest.mark.parametrize("fault, num_good_tokens", [
    ("sample-error:7", 0), ("sample-error:7:after=3", 3), ("detok-error:7", 0), ("detok-error:7:after=5", 5),
])
def test_fault_fails_only_its_request(smollm2_fp32, batch_prompts, reference, fault, num_good_tokens):
    engine = make_engine(smollm2_fp32, fault)
    victim = 1
    params = [greedy(VICTIM_SEED if i == victim else None) for i in range(len(batch_prompts))]
    results = engine.generate(batch_prompts, params)
    for i, (completion,) in enumerate(results):
        if i == victim:
            assert completion.finish_reason == "error"
            assert "injected" in completion.error
            # The tokens before the fault were produced normally (and streamed).
            assert completion.token_ids == reference[i][:num_good_tokens]
        else:
            assert completion.error is None and completion.finish_reason == "length"
            assert completion.token_ids == reference[i]
    assert_all_blocks_free(engine)


def test_bad_stop_token_id_in_sampler_fails_only_its_request(smollm2_fp32, batch_prompts, reference):
    """A real bug, no injection: an out-of-vocabulary stop token id banned while min_tokens
    is not reached makes the batched sampler raise; only that request fails."""
    engine = make_engine(smollm2_fp32)
    bad = greedy(stop_token_ids=(10**9,), min_tokens=2)
    params = [bad if i == 2 else greedy() for i in range(len(batch_prompts))]
    results = engine.generate(batch_prompts, params)
    assert results[2][0].finish_reason == "error" and "IndexError" in results[2][0].error
    others = [i for i in range(len(batch_prompts)) if i != 2]
    assert [results[i][0].token_ids for i in others] == [reference[i] for i in others]
    assert_all_blocks_free(engine)


def test_model_step_failure_fails_its_batch_and_the_engine_goes_on(smollm2_fp32, batch_prompts, reference):
    """An exception in the forward pass (here: an image marked ready without its embedding)
    fails every request of that step's batch, frees their blocks; later requests run."""
    engine = make_engine(smollm2_fp32)
    broken = MMInput(offset=1, length=2, num_embeds=2, content_hash="ab" * 8, is_ready=True)
    engine.add_request(batch_prompts[0], greedy(), "broken", mm_inputs=[broken])
    engine.add_request(batch_prompts[1], greedy(), "bystander")
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"broken", "bystander"}
    assert all(o.finished and o.finish_reason == "error" and "RuntimeError" in o.error for o in outputs)
    assert_all_blocks_free(engine)
    assert engine.generate([batch_prompts[2]], greedy())[0][0].token_ids == reference[2]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("fault", ["sample-error:7", "detok-error:7"])
def test_failed_prefill_request_releases_its_transfer_hold(smollm2_fp32, batch_prompts, fault):
    """Prefill role of a P/D pair: a finished prefill keeps its blocks until its transfer
    ends; one that fails gives them back at once."""
    engine = make_engine(smollm2_fp32, fault)
    for request_id, seed in (("victim", VICTIM_SEED), ("healthy", None)):
        engine.add_prefill_request(request_id, batch_prompts[0], greedy(seed), "decode-0", [[1, 2, 3, 4]])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id["victim"].error is not None and by_id["victim"].finish_reason == "error"
    assert by_id["healthy"].error is None and len(by_id["healthy"].new_token_ids) == 1
    assert set(engine.scheduler.transferring) == {"healthy"}  # its transfer is still due
    engine.abort("healthy")
    assert_all_blocks_free(engine)


def test_hang_step_delays_one_step_and_fails_nothing(smollm2_fp32, batch_prompts, reference, caplog):
    engine = make_engine(smollm2_fp32, f"hang-step:{VICTIM_SEED}:0.01:after=2")
    params = [greedy(VICTIM_SEED if i == 0 else None) for i in range(len(batch_prompts))]
    with caplog.at_level(logging.WARNING, logger="epdserve.engine"):
        results = engine.generate(batch_prompts, params)
    assert [c[0].token_ids for c in results] == reference
    assert caplog.text.count("injected hang") == 1  # once, although the request ran on
    assert_all_blocks_free(engine)


def test_fatal_fault_propagates(smollm2_fp32, batch_prompts):
    engine = make_engine(smollm2_fp32, "fatal:7:after=2")
    engine.add_request(batch_prompts[0], greedy(VICTIM_SEED))
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(NUM_TOKENS):
            engine.step()


# -- the local launcher's supervisor --------------------------------------------------------
def test_supervisor_restarts_a_dying_worker_up_to_its_limit(tmp_path, caplog):
    """Real ``epdserve worker`` processes that exit at once (a bad flag, status 2): each exit
    is seen, the worker restarted under its id with its arguments, until the limit."""
    launch = WorkerLaunch("colocated-9", "colocated", "tcp://127.0.0.1:9", (), ("--debug-fault", "bogus"),
                          str(tmp_path / "worker.log"))
    policy = RestartPolicy(max_restarts=2, initial_backoff_s=0.05, max_backoff_s=0.1)
    started = []

    _supervise(launch, policy, started, caplog, until="not restarted")
    assert "colocated-9" in caplog.text and "not restarted (2 restarts allowed" in caplog.text
    assert len(started) == 2 and all(w.launch == launch for w in started)
    assert len({w.pid for w in started}) == 2
    assert caplog.text.count("stopped: exit status 2") == 3
    assert (tmp_path / "worker.log").read_text().count("--debug-fault must be") == 3


def test_supervisor_leaves_a_worker_that_stopped_cleanly_down(tmp_path, caplog):
    """Exit status 0 means the worker was asked to stop (e.g. Ctrl-C to the process group)."""
    launch = WorkerLaunch("colocated-8", "colocated", "tcp://127.0.0.1:9", (), ("--help",))
    started = []

    _supervise(launch, RestartPolicy(initial_backoff_s=0.05), started, caplog, until="colocated-8")
    assert "stopped cleanly; not restarted" in caplog.text and started == []


def _supervise(launch: WorkerLaunch, policy: RestartPolicy, started: list, caplog, until: str) -> None:
    """Run a supervisor over one worker until its log says ``until`` (bounded), then close it."""

    async def supervise() -> None:
        supervisor = WorkerSupervisor(policy, started.append)
        supervisor.add(start_worker(launch))
        supervisor.start()
        deadline = time.monotonic() + 60
        while until not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        supervisor.close()

    with caplog.at_level(logging.WARNING, logger="epdserve.local"):
        asyncio.run(supervise())


def test_restart_policy_is_validated():
    with pytest.raises(ConfigError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ConfigError):
        RestartPolicy(initial_backoff_s=10, max_backoff_s=1)


# -- one prefill worker process, driven over its router socket ------------------------------
class RouterSocket:
    """The router's end of a worker's control socket (a test drives the worker directly),
    CURVE-authenticated with a fresh cluster key (``env`` hands it to the worker)."""

    def __init__(self) -> None:
        self.key = new_key()
        self.env = {**os.environ, EPDSERVE_CLUSTER_KEY: self.key.hex()}
        self.ctx = zmq.Context()
        self.gate = CurveGate(self.ctx, self.key)
        self.sock = self.ctx.socket(zmq.ROUTER)
        make_curve_server(self.sock, self.key)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.worker_id = b""

    def recv(self, timeout_s: float) -> m.Message:
        """The next message from the worker's control socket (heartbeats are skipped)."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            identity, payload = self.sock.recv_multipart()
            if not identity.endswith(b"/hb"):
                return m.decode(payload)
        raise AssertionError(f"no message from the worker within {timeout_s:g} s")

    def send(self, msg: m.Msg) -> None:
        self.sock.send_multipart([self.worker_id, m.encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.gate.stop()
        self.ctx.term()


@pytest.mark.slow
def test_prefill_worker_fails_bad_requests_alone_and_ends_each_transfer_once(tmp_path):
    """A Submit the worker cannot take (a sampling field of the wrong type: the frame does not
    decode) and a request whose sampling raises each fail alone, with exactly one TransferDone,
    while a normal request beside them is served."""
    router = RouterSocket()
    worker_id = "prefill-t"
    with open(tmp_path / "worker.log", "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "epdserve.cli", "worker", "--role", "prefill", "--router", router.address,
             "--worker-id", worker_id, "--die-with-parent", "--max-model-len", "256", "--kv-cache-memory", "0.05",
             "--debug-fault", f"sample-error:{VICTIM_SEED}"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=router.env)
    try:
        assert isinstance(router.recv(120), m.Register)
        router.worker_id = worker_id.encode()
        prompt = list(range(100, 140))
        sampling = msgspec.to_builtins(greedy())
        for request_id, fields in (("bad", {**sampling, "max_tokens": "many"}),
                                   ("victim", {**sampling, "seed": VICTIM_SEED}), ("ok", sampling)):
            router.send(m.Submit(request_id, prompt, fields, kv_target="decode-x", kv_target_block_ids=[[1, 2, 3]]))
        failed: dict[str, str] = {}
        transfers: dict[str, int] = {}
        outputs: list[m.TokenOutput] = []
        while not (set(failed) == {"bad", "victim"} and outputs and set(transfers) == {"bad", "victim", "ok"}):
            match router.recv(60):
                case m.RequestFailed(request_id=request_id, message=message):
                    failed[request_id] = message
                case m.TransferDone(request_id=request_id):
                    transfers[request_id] = transfers.get(request_id, 0) + 1
                case m.Outputs(outputs=items):
                    outputs += items
        # A marker: the worker answers an Abort of an unknown prefill at once, after anything
        # the steps before it had to report.
        router.send(m.Abort("marker"))
        while not isinstance(msg := router.recv(60), m.TransferDone) or msg.request_id != "marker":
            if isinstance(msg, m.TransferDone):
                transfers[msg.request_id] += 1
        assert "malformed" in failed["bad"] and "max_tokens" in failed["bad"] and "injected sampling fault" in failed["victim"]
        assert [o.request_id for o in outputs] == ["ok"] and len(outputs[0].token_ids) == 1
        assert transfers == {"bad": 1, "victim": 1, "ok": 1}
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(30)
        router.close()


# -- end to end: epdserve serve ------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct"
# seed -> (fault, where it fires on a P/D pair)
FAULTS = {
    101: "sample-error:101",  # first token: the prefill worker
    102: "sample-error:102:after=2",  # third token: the decode worker
    103: "detok-error:103:after=1",  # second token: the decode worker
    105: "detok-error:105",  # first token: the prefill worker
    104: "fatal:104:after=1",  # second token: the decode worker exits
}
LAYOUTS = {
    "pd": ["--prefill-workers", "1", "--decode-workers", "1"],
    "colocated": ["--colocated-workers", "1"],
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"faults-{request.param}")
    faults = [arg for spec in FAULTS.values() for arg in ("--debug-fault", spec)]
    server = start_server(SMALL + LAYOUTS[request.param] + faults, str(log_dir))
    yield server
    stop_server(server)


def complete(server: Server, prompt: str, seed: int | None = None, max_tokens: int = NUM_TOKENS,
             stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if seed is not None:
        body["seed"] = seed
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def assert_openai_error(body: dict, fragment: str) -> None:
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert fragment in error["message"]


def pids(server: Server) -> dict[str, int]:
    return {w["id"]: w["pid"] for w in server.workers() if w["state"] == "ready"}


@pytest.mark.slow
@pytest.mark.parametrize("seed, fragment", [(101, "sampling"), (102, "sampling"), (103, "detokenizing"),
                                            (105, "detokenizing")])
def test_faulty_request_fails_alone(server, seed, fragment):
    expected = complete(server, PROMPTS[5], max_tokens=24)
    assert expected.status_code == 200, expected.text
    before = pids(server)
    # A normal request runs alongside the faulty one (batched with it where they overlap).
    results: dict[str, httpx.Response] = {}
    bystander = threading.Thread(target=lambda: results.update(ok=complete(server, PROMPTS[5], max_tokens=24)))
    bystander.start()
    failed = complete(server, PROMPTS[6], seed=seed)
    bystander.join(60)
    assert 400 <= failed.status_code < 600 and failed.status_code != 500, failed.text
    assert_openai_error(failed.json(), fragment)
    assert results["ok"].status_code == 200, results["ok"].text
    assert results["ok"].json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    assert pids(server) == before  # every worker still ready, none restarted
    after = complete(server, PROMPTS[7])
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == NUM_TOKENS
    server.wait_all_blocks_free()


@pytest.mark.slow
def test_stream_gets_an_error_event_after_its_tokens(server):
    events: list[dict] = []
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "seed": 102}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert "error" in events[-1], events
    assert_openai_error(events[-1], "sampling")
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-1])  # tokens before the fault
    assert complete(server, PROMPTS[7]).status_code == 200
    server.wait_all_blocks_free()


@pytest.mark.slow
def test_fatal_error_exits_the_worker_and_it_is_restarted(server):
    role = "colocated" if any(w["role"] == "colocated" for w in server.workers()) else "decode"
    worker_id = f"{role}-0"
    old_pid = server.worker(worker_id)["pid"]
    failed = complete(server, PROMPTS[3], seed=104)
    assert failed.status_code == 503, failed.text
    assert_openai_error(failed.json(), "failed")

    def restarted() -> bool:
        w = server.worker(worker_id)
        return w["state"] == "ready" and w["pid"] != old_pid

    server.wait_until(restarted, 120, f"{worker_id} to be restarted and ready")
    ok = complete(server, PROMPTS[7])
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == NUM_TOKENS
    server.wait_all_blocks_free()
    # The supervisor logged the worker's distinctive exit status.
    log = Path(server.log_dir) / "server.log"
    server.wait_until(lambda: re.search(rf"{worker_id} \(pid {old_pid}\) stopped: exit status {EXIT_FATAL}",
                                        log.read_text()) is not None, 10, "the supervisor's log line")
