"""Benchmark metrics (vLLM's definitions) on hand-made timelines, and the client end to end.

The end-to-end tests run the client against ``ScriptedServer``, a stand-in OpenAI-shaped SSE
server started in this file that emits a scripted sequence of chunks with known delays. It is
a stand-in because the subject here is the client's measurement, not a server; an end-to-end
test against a real epdserve server is a separate test, added with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import pytest
from aiohttp import web

from epdserve.bench.cli import add_bench_parser
from epdserve.bench.client import ClientConfig, SseParser, request_body, run_benchmark
from epdserve.bench.metrics import RequestOutput, compute_metrics, percentile_label, ttft_breakdown_ms
from epdserve.bench.report import RunInfo, build_result, format_table
from epdserve.bench.workloads import SampleRequest


def _out(
    ttft: float, itl: tuple[float, ...], num_tokens: int | None, success: bool = True, **kw
) -> RequestOutput:
    latency = ttft + sum(itl)
    fields = {
        "success": success,
        "start_s": 0.0,
        "latency_s": latency if success else 0.5,
        "ttft_s": ttft if success else 0.0,
        "itl_s": itl if success else (),
        "prompt_len": 10,
        "output_tokens": num_tokens,
        "generated_text": "x" * (len(itl) + 1),
        "error": "" if success else "HTTP 503: overloaded",
    }
    fields.update(kw)
    return RequestOutput(**fields)


# A: 3 tokens, TTFT 100 ms, gaps 20 and 30 ms -> TPOT 25 ms, E2EL 150 ms
# B: 1 token, TTFT 200 ms -> no TPOT (counts as 0 against a TPOT SLO)
# C: failed
TIMELINE = (_out(0.100, (0.020, 0.030), 3), _out(0.200, (), 1), _out(0.0, (), None, success=False))


def test_ttft_tpot_itl_e2el_definitions():
    m = compute_metrics(TIMELINE, duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert m.output_lens == (3, 1, 0)
    assert (m.total_input, m.total_output) == (20, 4)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.0)
    assert m.total_token_throughput == pytest.approx(12.0)
    s = m.summaries
    assert s["ttft"].mean_ms == pytest.approx(150.0) and s["ttft"].median_ms == pytest.approx(150.0)
    assert s["tpot"].mean_ms == pytest.approx(25.0) and s["tpot"].std_ms == pytest.approx(0.0)  # only A
    assert s["itl"].mean_ms == pytest.approx(25.0)  # pooled: [20, 30]
    assert dict(s["itl"].percentiles_ms)[99] == pytest.approx(29.9)
    assert s["e2el"].mean_ms == pytest.approx(175.0)  # A 150, B 200
    assert m.request_goodput is None


def test_goodput_counts_failed_requests_as_misses():
    assert compute_metrics(TIMELINE, 2.0, [99], {"ttft": 150}).request_goodput == pytest.approx(0.5)  # A
    assert compute_metrics(TIMELINE, 2.0, [99], {"ttft": 250}).request_goodput == pytest.approx(1.0)  # A, B
    # B has no TPOT, so only its TTFT decides; A's 25 ms TPOT misses 10 ms.
    assert compute_metrics(TIMELINE, 2.0, [99], {"ttft": 250, "tpot": 10}).request_goodput == pytest.approx(
        0.5
    )
    assert compute_metrics(TIMELINE, 2.0, [99], {"e2el": 1000}).request_goodput == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics(TIMELINE, 2.0, [99], {"itl": 5})


def test_output_tokens_fall_back_to_the_tokenizer_then_to_chunks():
    no_usage = _out(0.1, (0.01, 0.01), None, generated_text="a b c d")
    assert compute_metrics([no_usage], 1.0, [99], count_tokens=lambda t: len(t.split())).total_output == 4
    assert compute_metrics([no_usage], 1.0, [99]).total_output == 3


def test_no_samples_give_zeros():
    m = compute_metrics([TIMELINE[2]], 1.0, [99])
    assert (m.completed, m.failed) == (0, 1)
    assert m.summaries["ttft"].mean_ms == 0.0 and m.summaries["tpot"].percentiles_ms == ((99.0, 0.0),)


def test_percentile_labels():
    assert [percentile_label(p) for p in (50, 99.0, 99.9, 0.5)] == ["50", "99", "99.9", "0.5"]


REQUIRED_KEYS = [
    *("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness"),
    *("max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens"),
    *("request_throughput", "request_goodput", "output_throughput", "total_token_throughput"),
    *("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"),
]


def test_result_keys_and_table_follow_vllm():
    percentiles = [50, 90, 99, 99.9]
    metrics = compute_metrics(TIMELINE, 2.0, percentiles, {"ttft": 150})
    info = RunInfo("openai", "m", "tok", 3, float("inf"), 1.0, None)
    result = build_result(info, TIMELINE, 2.0, metrics)
    for key in REQUIRED_KEYS:
        assert key in result, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in result
    assert result["request_rate"] == "inf" and result["request_goodput"] == pytest.approx(0.5)
    assert result["ttfts"] == [0.1, 0.2, 0.0] and result["itls"][0] == [0.02, 0.03]
    assert result["errors"][2].startswith("HTTP 503")
    json.dumps(result)  # serializable as is

    table = format_table(result)
    assert table.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "Request goodput (req/s):                 0.50" in table
    assert "P99.9 TTFT (ms):" in table and "Mean TPOT (ms):                          25.00" in table
    only_ttft = build_result(info, TIMELINE, 2.0, metrics, percentile_metrics=("ttft",))
    assert "mean_ttft_ms" in only_ttft and "mean_itl_ms" not in only_ttft


def test_ttft_breakdown_from_server_timing():
    timed = [
        _out(0.1, (), 1, timing={"queue_ms": 2.0, "prefill_ms": 10, "note": "x"}),
        _out(0.1, (), 1, timing={"queue_ms": 4.0, "prefill_ms": "n/a"}),
        _out(0.1, (), 1),
    ]
    breakdown = ttft_breakdown_ms(timed)
    assert set(breakdown) == {"queue_ms", "prefill_ms"}
    assert breakdown["queue_ms"]["mean"] == pytest.approx(3.0)
    assert breakdown["prefill_ms"] == {"mean": 10.0, "p99": 10.0}
    assert ttft_breakdown_ms(TIMELINE) == {}


def test_sse_parser_handles_split_events_crlf_and_comments():
    parser = SseParser()
    assert parser.feed(b'data: {"a":') == []
    assert parser.feed(b" 1}\r\n\r\n: ping\n\ndata:[DONE]\n") == ['{"a": 1}']
    assert parser.feed(b"\n") == ["[DONE]"]
    assert parser.feed(b"data: one\ndata: two\n\ndata: tail") == ["one\ntwo"]
    assert parser.close() == ["tail"]


def test_request_body_fields():
    req = SampleRequest("hi", 1, 5)
    chat = request_body(ClientConfig("u", "m", is_chat=True, ignore_eos=True, return_timing=True), req)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 5
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["ignore_eos"] and chat["return_timing"] and chat["temperature"] == 0.0
    plain = request_body(ClientConfig("u", "m", is_chat=False), req)
    assert plain["prompt"] == "hi" and "ignore_eos" not in plain and "return_timing" not in plain


# ---- against the stand-in server ----------------------------------------------------------

FIRST_DELAY_S = 0.05  # request received -> first content chunk
TOKEN_DELAY_S = 0.01  # between content chunks
SERVER_PROMPT_TOKENS = 7
SERVER_TIMING = {"queue_ms": 1.5, "encode_ms": 0.0, "prefill_ms": 40.0, "first_token_ms": 48.0}


class ScriptedServer:
    """Stand-in OpenAI-shaped server: prompt ``fail-503`` gets HTTP 503, ``sse-error`` one token then
    an SSE error event; any other prompt streams ``max_tokens`` tokens with the delays above."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(timeout=10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        is_chat = "messages" in body
        prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
        if prompt == "fail-503":
            error = {"error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}}
            return web.json_response(error, status=503, headers={"Retry-After": "1"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

        def chunk(text: str) -> dict:
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            return {"choices": [choice]}

        if is_chat:  # the role chunk comes at once and carries no content: it must not count as TTFT
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        num_tokens = 1 if prompt == "sse-error" else body["max_tokens"]
        for i in range(num_tokens):
            await asyncio.sleep(FIRST_DELAY_S if i == 0 else TOKEN_DELAY_S)
            await send(chunk(f" t{i}"))
        if prompt == "sse-error":
            await send({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
        else:
            usage = {"prompt_tokens": SERVER_PROMPT_TOKENS, "completion_tokens": num_tokens}
            final = {"choices": [], "usage": usage}
            if body.get("return_timing"):
                final["timing"] = SERVER_TIMING
            await send(final)
        await send("[DONE]")
        await response.write_eof()
        return response


@pytest.fixture(scope="module")
def server():
    srv = ScriptedServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("is_chat", [False, True])
def test_client_measures_scripted_stream(server, is_chat):
    endpoint = "/v1/chat/completions" if is_chat else "/v1/completions"
    config = ClientConfig(server.base_url + endpoint, "stand-in", is_chat=is_chat, return_timing=is_chat)
    requests = [SampleRequest("hello", 3, 4)] * 3 + [
        SampleRequest("fail-503", 3, 4),
        SampleRequest("sse-error", 3, 4),
    ]
    run = asyncio.run(run_benchmark(config, requests, [0.0] * len(requests)))
    ok, http_503, sse_error = run.outputs[:3], run.outputs[3], run.outputs[4]
    for out in ok:
        assert out.success and out.error == ""
        assert out.ttft_s >= FIRST_DELAY_S
        assert out.output_tokens == 4 and out.prompt_len == SERVER_PROMPT_TOKENS
        assert len(out.itl_s) == 3
        # Causality bounds only: a chunk cannot arrive before the server wrote it.
        assert out.ttft_s + sum(out.itl_s) >= FIRST_DELAY_S + 3 * TOKEN_DELAY_S
        assert out.latency_s >= out.ttft_s + sum(out.itl_s) - 1e-9
        assert out.generated_text == " t0 t1 t2 t3"
        assert out.timing == (SERVER_TIMING if is_chat else None)
    assert not http_503.success and http_503.error == "HTTP 503: overloaded"
    assert not sse_error.success and "engine died" in sse_error.error

    metrics = compute_metrics(run.outputs, run.duration_s, [99])
    assert (metrics.completed, metrics.failed) == (3, 2)
    assert metrics.total_output == 12 and metrics.output_lens == (4, 4, 4, 0, 0)
    assert metrics.summaries["ttft"].mean_ms >= FIRST_DELAY_S * 1000
    assert compute_metrics(
        run.outputs, run.duration_s, [99], {"e2el": 60_000}
    ).request_goodput == pytest.approx(3 / run.duration_s)
    if is_chat:
        assert ttft_breakdown_ms(run.outputs)["prefill_ms"] == {"mean": 40.0, "p99": 40.0}


def test_max_concurrency_serializes_requests(server):
    config = ClientConfig(server.base_url + "/v1/completions", "stand-in", is_chat=False, max_concurrency=1)
    run = asyncio.run(run_benchmark(config, [SampleRequest("hello", 3, 2)] * 3, [0.0] * 3))
    starts = sorted(out.start_s for out in run.outputs)
    ends = sorted(out.start_s + out.latency_s for out in run.outputs)
    assert all(next_start >= end for next_start, end in zip(starts[1:], ends))


def _tokenizer_file(directory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_bench_serve_command_end_to_end(server, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="epdserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(
        [
            *("bench", "serve", "--base-url", server.base_url, "--tokenizer", _tokenizer_file(tmp_path)),
            *("--random-input-len", "12", "--random-output-len", "3", "--num-prompts", "6"),
            *("--request-rate", "200", "--burstiness", "0.5", "--max-concurrency", "3"),
            *("--goodput", "ttft:60000", "tpot:60000", "--metric-percentiles", "50,99.9"),
            *("--return-timing", "--disable-tqdm", "--endpoint", "/v1/chat/completions"),
            *("--result-json", str(tmp_path / "out" / "result.json"), "--plots", str(tmp_path / "plots")),
        ]
    )
    assert ns.func(ns) == 0
    stdout = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in stdout
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert (result["completed"], result["failed"], result["model_id"]) == (6, 0, "stand-in")
    assert result["backend"] == "openai-chat" and result["max_concurrency"] == 3
    assert result["output_lens"] == [3] * 6 and result["request_goodput"] > 0
    assert "p99.9_itl_ms" in result and "ttft_breakdown_ms" in result
    assert server.bodies[-1]["ignore_eos"] is True  # on by default for the random dataset
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "itl_cdf.png",
        "timeline.png",
        "ttft_cdf.png",
    ]


def test_attainment_per_service_class_uses_the_class_slos():
    from epdserve.bench.metrics import class_attainment
    from epdserve.service import ClassSLO

    outputs = [
        _out(0.05, (0.01,) * 4, 5),  # realtime, fast: met
        _out(0.50, (0.01,) * 4, 5),  # realtime, TTFT 500 ms > 100: missed
        _out(0.05, (0.2,) * 4, 5),  # interactive, TPOT 200 ms > 100: missed
        _out(0.05, (0.01,) * 4, 5, success=False, error="HTTP 429: slo_unreachable"),  # interactive, refused
        _out(9.0, (1.0,), 2),  # batch: no SLO
    ]
    classes = ["realtime", "realtime", "interactive", "interactive", "batch"]
    slos = {"realtime": ClassSLO(0.1, None), "interactive": ClassSLO(1.0, 0.1)}
    per_class = class_attainment(outputs, classes, slos)
    assert per_class["realtime"] == {"num_requests": 2, "num_refused": 0, "num_completed": 2, "num_slo_met": 1,
                                     "attainment_of_completed": 0.5, "attainment": 0.5}
    assert per_class["interactive"]["num_refused"] == 1 and per_class["interactive"]["num_slo_met"] == 0
    assert per_class["batch"]["num_slo_met"] is None and per_class["batch"]["attainment"] is None
    result = build_result(RunInfo("openai", "m", "t", 5, 1.0, 1.0, None), outputs, 10.0,
                          compute_metrics(outputs, 10.0, (50.0,)), service_classes=per_class,
                          request_classes=classes)
    assert result["request_service_classes"] == classes
    assert "realtime:" in format_table(result)
    body = request_body(ClientConfig("http://x/v1/completions", "m", False),
                        SampleRequest("hi", 1, 4, service_tier="flex"))
    assert body["service_tier"] == "flex"
