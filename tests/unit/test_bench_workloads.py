"""Benchmark workloads: datasets, the tokenizer wrapper, the arrival process, argument errors.

A word-level tokenizer built here (``w0`` .. ``w49`` plus three special tokens) stands in for a
model's: it round-trips text exactly, so prompt lengths can be checked to the token.
"""

from __future__ import annotations

import argparse
import json
import math
import socket

import numpy as np
import pytest

from epdserve.bench import BenchError
from epdserve.bench.args import load_workload
from epdserve.bench.cli import add_bench_parser
from epdserve.bench.workloads import (
    TRACE_BLOCK_TOKENS,
    arrival_offsets,
    load_tokenizer,
    random_requests,
    sharegpt_requests,
    trace_requests,
)

NUM_WORDS = 50
SPECIAL_IDS = (0, 1, 2)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, **{f"w{i}": i + 3 for i in range(NUM_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "[UNK]"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return load_tokenizer(str(tokenizer_path.parent))


def _bench_ns(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epdserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


# ---- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_loads_from_file_or_directory(tokenizer_path, tok):
    assert load_tokenizer(str(tokenizer_path)).encode("w0 w1") == tok.encode("w0 w1") == [3, 4]
    assert tok.vocab_size == NUM_WORDS + len(SPECIAL_IDS)
    assert not set(tok.allowed_ids().tolist()) & set(SPECIAL_IDS)
    with pytest.raises(BenchError, match="no tokenizer.json"):
        load_tokenizer(str(tokenizer_path.parent / "missing"))


# ---- random -------------------------------------------------------------------------------


def test_random_lengths_within_range_ratio_and_exact(tok):
    requests = random_requests(tok, 200, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    assert len(requests) == 200
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.expected_output_len for r in requests]
    assert 20 <= min(input_lens) and max(input_lens) <= 60
    assert 10 <= min(output_lens) and max(output_lens) <= 30
    assert len(set(input_lens)) > 10  # lengths really vary
    for r in requests:
        ids = tok.encode(r.prompt)
        assert len(ids) == r.prompt_len
        assert not set(ids) & set(SPECIAL_IDS)


def test_random_is_seeded(tok):
    a = random_requests(tok, 5, 16, 8, 0.3, seed=7)
    assert a == random_requests(tok, 5, 16, 8, 0.3, seed=7)
    assert a != random_requests(tok, 5, 16, 8, 0.3, seed=8)


def test_random_range_ratio_zero_gives_fixed_lengths(tok):
    requests = random_requests(tok, 10, 16, 8, 0.0, seed=0)
    assert {(r.prompt_len, r.expected_output_len) for r in requests} == {(16, 8)}


def test_random_rejects_bad_range_ratio(tok):
    with pytest.raises(BenchError, match="range-ratio"):
        random_requests(tok, 1, 16, 8, 1.0, seed=0)


# ---- trace --------------------------------------------------------------------------------


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_trace_replays_timestamps_and_shares_hashed_blocks(tmp_path, tok):
    path = _write_lines(
        tmp_path / "trace.jsonl",
        [
            json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 300, "hash_ids": [7, 8]}),
            "",
            json.dumps({"timestamp": 2000, "input_length": 800, "output_length": 100, "hash_ids": [7, 9]}),
            json.dumps({"timestamp": 1000, "input_length": 600, "output_length": 50}),
        ],
    )
    workload = trace_requests(tok, path, None, seed=0, time_scale=0.5, length_scale=0.01)
    assert workload.arrival_offsets_s == (0.0, 0.5, 1.0)  # sorted, ms -> s, scaled
    assert [(r.prompt_len, r.expected_output_len) for r in workload.requests] == [(10, 3), (6, 1), (8, 1)]
    block_len = round(TRACE_BLOCK_TOKENS * 0.01)
    first, _, third = (tok.encode(r.prompt) for r in workload.requests)
    assert first[:block_len] == third[:block_len]  # both start with hash id 7
    assert first[block_len : 2 * block_len] != third[block_len : 2 * block_len]

    assert len(trace_requests(tok, path, 2, seed=0).requests) == 2


def test_azure_csv_trace_replays_like_the_simulator_reads_it(tmp_path, tok):
    from epdserve.sim.workload import trace_workload

    path = _write_lines(tmp_path / "azure.csv", ["arrived_at,num_prefill_tokens,num_decode_tokens",
                                                  "0.0,400,40", "2.5,1000,120", "1.0,200,10"])
    workload = trace_requests(tok, path, None, seed=0, time_scale=0.5, length_scale=0.05)
    assert workload.arrival_offsets_s == (0.0, 0.5, 1.25)  # sorted, seconds, scaled
    assert [(r.prompt_len, r.expected_output_len) for r in workload.requests] == [(20, 2), (10, 1), (50, 6)]
    sim = trace_workload(path, 0.5, 0.05, None, None, None, False)  # the simulator's reading of the same file
    assert list(sim.arrival_s) == list(workload.arrival_offsets_s)
    assert list(sim.input_lens) == [r.prompt_len for r in workload.requests]
    assert list(sim.output_lens) == [r.expected_output_len for r in workload.requests]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not a JSON object"),
        (json.dumps({"timestamp": 5, "output_length": 3}), "'input_length'"),
        (json.dumps({"timestamp": -1, "input_length": 3, "output_length": 3}), "'timestamp'"),
        (json.dumps({"timestamp": 5, "input_length": 3, "output_length": 3, "hash_ids": "x"}), "hash_ids"),
    ],
)
def test_malformed_trace_line_names_its_number(tmp_path, tok, bad_line, message):
    good = json.dumps({"timestamp": 0, "input_length": 4, "output_length": 2})
    path = _write_lines(tmp_path / "trace.jsonl", [good, good, bad_line])
    with pytest.raises(BenchError, match=f"trace.jsonl:3: .*{message}"):
        trace_requests(tok, path, None, seed=0)


def test_missing_trace_file(tmp_path, tok):
    with pytest.raises(BenchError, match="cannot read trace"):
        trace_requests(tok, str(tmp_path / "nope.jsonl"), None, seed=0)


# ---- ShareGPT -----------------------------------------------------------------------------


def _words(n: int, start: int = 0) -> str:
    return " ".join(f"w{(start + i) % NUM_WORDS}" for i in range(n))


def test_sharegpt_parsing_filters_and_oversamples(tmp_path, tok):
    data = [
        {"conversations": [{"from": "human", "value": _words(10)}, {"from": "gpt", "value": _words(6)}]},
        {"conversations": [{"from": "human", "value": _words(12, 3)}, {"from": "gpt", "value": _words(9)}]},
        {"conversations": [{"from": "human", "value": _words(20)}]},  # one turn: dropped
        {"conversations": [{"from": "human", "value": _words(2)}, {"from": "gpt", "value": _words(9)}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    requests = sharegpt_requests(tok, str(path), 2, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in requests) == [(10, 6), (12, 9)]
    assert {r.prompt for r in requests} == {_words(10), _words(12, 3)}

    oversampled = sharegpt_requests(tok, str(path), 5, seed=0)
    assert len(oversampled) == 5 and {r.prompt_len for r in oversampled} <= {10, 12}
    fixed = sharegpt_requests(tok, str(path), 2, seed=0, output_len=3)
    assert {r.expected_output_len for r in fixed} == {3}


def test_sharegpt_errors(tmp_path, tok):
    not_json = tmp_path / "bad.json"
    not_json.write_text("[{", encoding="utf-8")
    with pytest.raises(BenchError, match="not JSON"):
        sharegpt_requests(tok, str(not_json), 1, seed=0)
    not_list = tmp_path / "dict.json"
    not_list.write_text("{}", encoding="utf-8")
    with pytest.raises(BenchError, match="JSON list"):
        sharegpt_requests(tok, str(not_list), 1, seed=0)
    with pytest.raises(BenchError, match="cannot read dataset"):
        sharegpt_requests(tok, str(tmp_path / "missing.json"), 1, seed=0)


# ---- dataset selection and CLI errors -----------------------------------------------------


def test_unknown_dataset_is_an_error(tok):
    with pytest.raises(BenchError, match="unknown dataset 'nope'"):
        load_workload(_bench_ns("--base-url", "http://127.0.0.1:1", "--dataset", "nope"), tok)


def test_dataset_path_rules(tok, tmp_path):
    with pytest.raises(BenchError, match="needs --dataset-path"):
        load_workload(_bench_ns("--base-url", "http://x", "--dataset", "sharegpt"), tok)
    with pytest.raises(BenchError, match="takes no --dataset-path"):
        load_workload(_bench_ns("--base-url", "http://x", "--dataset-path", "f.json"), tok)
    trace = _write_lines(
        tmp_path / "t.jsonl", [json.dumps({"timestamp": 0, "input_length": 4, "output_length": 2})]
    )
    ns = _bench_ns(
        "--base-url", "http://x", "--dataset", "trace", "--dataset-path", trace, "--request-rate", "5"
    )
    with pytest.raises(BenchError, match="does not apply to a trace"):
        load_workload(ns, tok)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--dataset", "nope"), "unknown dataset 'nope'"),
        (("--dataset", "sharegpt", "--dataset-path", "/nonexistent/sg.json"), "cannot read dataset"),
        (("--goodput", "ttft=5"), "--goodput takes KEY:MS"),
        (("--goodput", "itl:5"), "--goodput metric must be one of"),
        (("--metric-percentiles", "50,abc"), "--metric-percentiles"),
        (("--percentile-metrics", "ttft,foo"), "--percentile-metrics"),
        (("--num-prompts", "2", "--random-input-len", "8"), "cannot reach server at http://127.0.0.1:"),
    ],
)
def test_cli_errors_are_one_line_and_nonzero(tokenizer_path, capsys, extra, message):
    ns = _bench_ns(
        "--base-url", f"http://127.0.0.1:{_free_port()}", "--tokenizer", str(tokenizer_path), *extra
    )
    assert ns.func(ns) != 0
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


# ---- arrivals -----------------------------------------------------------------------------


def test_arrivals_are_seeded():
    a = arrival_offsets(100, request_rate=4.0, burstiness=0.5, seed=3)
    assert a == arrival_offsets(100, request_rate=4.0, burstiness=0.5, seed=3)
    assert a != arrival_offsets(100, request_rate=4.0, burstiness=0.5, seed=4)
    assert all(np.diff(a) > 0)


def test_arrivals_match_vllm_stream():
    """Gamma draws from the legacy global stream, then rescaled so the last is n / rate."""
    n, rate, burstiness, seed = 50, 8.0, 2.0, 11
    np.random.seed(seed)
    cumulative = np.cumsum(
        [np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(n)]
    )
    expected = cumulative * (n / rate / cumulative[-1])
    assert np.allclose(arrival_offsets(n, rate, burstiness, seed), expected)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate(burstiness):
    n, rate = 20000, 10.0
    gaps = np.diff([0.0, *arrival_offsets(n, rate, burstiness, seed=0)])
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=1e-9)
    # Gamma(k) gaps have a coefficient of variation of 1/sqrt(k): burstiness shapes the spread.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_bad_rate_or_burstiness():
    with pytest.raises(BenchError):
        arrival_offsets(5, 0.0, 1.0, seed=0)
    with pytest.raises(BenchError):
        arrival_offsets(5, 1.0, -1.0, seed=0)
