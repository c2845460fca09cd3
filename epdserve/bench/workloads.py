"""Benchmark workloads: the tokenizer, the prompts of each dataset, and the arrival process.

Datasets (``--dataset``):
- ``random``: synthetic prompts of sampled token lengths, as vLLM's RandomDataset builds them.
- ``random-mm``: ``random`` prompts plus synthetic images (``mm_workloads``); chat endpoint.
- ``sharegpt``: first human turn as the prompt, the reply's length as the output length.
- ``trace``: a request trace replayed at its own timestamps (Mooncake JSONL or Azure CSV).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from epdserve.bench import BenchError
from epdserve.bench.traces import TRACE_BLOCK_TOKENS, read_any_trace

DATASETS = ("random", "random-mm", "sharegpt", "trace")
MAX_LENGTH_RETRIES = 10  # decode/re-encode rounds spent hitting an exact prompt length


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens as counted here; the server's usage.prompt_tokens replaces it when reported
    expected_output_len: int  # tokens; sent as max_tokens
    images: tuple[str, ...] = ()  # image URLs (data URLs), after the text in one chat message
    service_tier: str | None = None  # sent as ``service_tier`` (bench serve --service-class-mix)


@dataclass(frozen=True)
class Workload:
    requests: tuple[SampleRequest, ...]
    arrival_offsets_s: tuple[float, ...] | None  # trace send times; None: use --request-rate


@dataclass(frozen=True)
class BenchTokenizer:
    """A ``tokenizers.Tokenizer`` with the few operations the benchmark needs."""

    backend: Any  # tokenizers.Tokenizer
    source: str  # path it was loaded from, or "default"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def allowed_ids(self) -> np.ndarray:
        """Vocabulary ids that are not special tokens, ascending."""
        special = [i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special]
        return np.setdiff1d(np.arange(self.vocab_size), np.asarray(special, dtype=np.int64))

    def num_special_tokens_to_add(self) -> int:
        return len(self.encode("", add_special_tokens=True)) - len(self.encode(""))


def load_tokenizer(path: str | None) -> BenchTokenizer:
    """Load ``tokenizer.json`` (a file, or a directory holding one); None: the default model's."""
    from tokenizers import Tokenizer

    if path is None:
        try:
            from epdserve.models.loader import load_default_tokenizer
        except ImportError:
            raise BenchError("no default tokenizer is available; pass --tokenizer PATH") from None
        loaded = load_default_tokenizer()
        # An epdserve or Hugging Face tokenizer wraps the ``tokenizers`` object it runs on.
        backend = getattr(loaded, "backend_tokenizer", None) or getattr(loaded, "backend", loaded)
        if isinstance(backend, (str, os.PathLike)):
            return load_tokenizer(os.fspath(backend))
        if not isinstance(backend, Tokenizer):
            raise BenchError("the default tokenizer is not a tokenizers.Tokenizer; pass --tokenizer PATH")
        return BenchTokenizer(backend, "default")
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise BenchError(f"no tokenizer.json at {path}")
    try:
        return BenchTokenizer(Tokenizer.from_file(str(file)), str(path))
    except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exception
        raise BenchError(f"cannot load tokenizer {file}: {e}") from None


def _fit_to_length(
    tok: BenchTokenizer, token_ids: list[int], target_len: int, rng: np.random.Generator, allowed: np.ndarray
) -> tuple[str, int]:
    """Decode, re-encode and trim or pad until the text encodes to ``target_len`` tokens.

    Tokenizers do not round-trip arbitrary id sequences (adjacent pieces may merge), so the
    length is corrected a few times; the returned count is the text's actual length.
    """
    ids = list(token_ids)
    for _ in range(MAX_LENGTH_RETRIES + 1):
        text = tok.decode(ids)
        ids = tok.encode(text)
        if len(ids) > target_len:
            ids = ids[:target_len]
        elif len(ids) < target_len:
            ids += allowed[rng.integers(0, len(allowed), size=target_len - len(ids))].tolist()
        else:
            return text, target_len
    text = tok.decode(ids)
    return text, tok.count(text)


def random_requests(
    tok: BenchTokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths uniform in [len*(1-r), len*(1+r)], prompt tokens taken
    consecutively from the non-special vocabulary at a uniformly random offset."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - tok.num_special_tokens_to_add())
    input_low = math.floor(real_input_len * (1 - range_ratio))
    input_high = math.ceil(real_input_len * (1 + range_ratio))
    output_low = max(1, math.floor(output_len * (1 - range_ratio)))
    output_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if input_low < 1:
        raise BenchError(f"--random-input-len {input_len} is too small for range ratio {range_ratio}")
    input_lens = rng.integers(input_low, input_high + 1, size=num_prompts)
    output_lens = rng.integers(output_low, output_high + 1, size=num_prompts)
    offsets = rng.integers(0, tok.vocab_size, size=num_prompts)
    allowed = tok.allowed_ids()
    requests = []
    for i in range(num_prompts):
        ids = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        text, prompt_len = _fit_to_length(tok, ids, int(input_lens[i]), rng, allowed)
        requests.append(SampleRequest(text, prompt_len, int(output_lens[i])))
    return requests


def sharegpt_requests(
    tok: BenchTokenizer, path: str, num_prompts: int, seed: int, output_len: int | None = None
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle with ``seed``, keep pairs with 4 <= prompt <= 1024 tokens,
    output >= 4 (unless ``output_len`` fixes it) and prompt + output <= 2048, oversample if short."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BenchError(f"cannot read dataset {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BenchError(f"{path} is not JSON: line {e.lineno}: {e.msg}") from None
    if not isinstance(data, list):
        raise BenchError(f"{path}: a ShareGPT file is a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    py_rng = random.Random(seed)
    py_rng.shuffle(entries)
    requests: list[SampleRequest] = []
    for entry in entries:
        if len(requests) >= num_prompts:
            break
        turns = entry["conversations"]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            continue
        prompt, completion = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tok.encode(prompt, add_special_tokens=True))
        new_output_len = output_len if output_len is not None else len(tok.encode(completion, True))
        too_short = prompt_len < 4 or (output_len is None and new_output_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + new_output_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, new_output_len))
    if not requests:
        raise BenchError(f"{path}: no usable conversation (two turns, prompt of 4..1024 tokens)")
    if len(requests) < num_prompts:
        requests += py_rng.choices(requests, k=num_prompts - len(requests))
    return requests


def trace_requests(
    tok: BenchTokenizer,
    path: str,
    num_prompts: int | None,
    seed: int,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
) -> Workload:
    """Replay a trace (``traces.read_any_trace``): Mooncake JSONL (``timestamp`` in ms from the
    start, ``input_length``, ``output_length``, optional ``hash_ids``) or Azure CSV. Equal hash
    ids give equal prompt blocks, so shared prefixes survive.

    Send times are ``timestamp * time_scale``; lengths are ``length * length_scale`` (at least 1).
    """
    if time_scale <= 0 or length_scale <= 0:
        raise BenchError("--trace-time-scale and --trace-length-scale must be > 0")
    records = read_any_trace(path)
    records = records[:num_prompts] if num_prompts is not None else records
    allowed = tok.allowed_ids()
    block_len = max(1, round(TRACE_BLOCK_TOKENS * length_scale))
    rng = np.random.default_rng(seed)
    requests = []
    for record in records:
        input_len = max(1, round(record.input_length * length_scale))
        output_len = max(1, round(record.output_length * length_scale))
        ids: list[int] = []
        for h in record.hash_ids:
            block_rng = np.random.default_rng([seed, h])
            ids += allowed[block_rng.integers(0, len(allowed), size=block_len)].tolist()
        ids = ids[:input_len]
        ids += allowed[rng.integers(0, len(allowed), size=input_len - len(ids))].tolist()
        text, prompt_len = _fit_to_length(tok, ids, input_len, rng, allowed)
        requests.append(SampleRequest(text, prompt_len, output_len))
    return Workload(tuple(requests), tuple(r.arrival_s * time_scale for r in records))


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start, vLLM's arrival process.

    Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)) (burstiness 1 is
    Poisson); the cumulative times are then rescaled so the last one is exactly
    ``num_requests / rate``. The draws use ``np.random.RandomState(seed)``, the stream vLLM's
    ``np.random.seed(seed)`` gives. A rate of inf sends everything at time 0.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise BenchError("--request-rate and --burstiness must be > 0")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = np.random.RandomState(seed).gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate / times[-1])).tolist()
