"""Structured outputs below the HTTP layer: the request fields -> one grammar (``epdserve.structured``),
the engine's per-request matchers and masks (``engine/grammar.py``, replay on a decode worker), the CPU
bitmask kernel, and logit_bias in the sampler."""

from __future__ import annotations

import json
import re

import llguidance
import msgspec
import pytest
import torch

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.engine.grammar import GrammarMasks
from epdserve.models.layers import paged_attention_cpu
from epdserve.models.loader import load_default_tokenizer, load_model
from epdserve.request import Request
from epdserve.sampling import SamplingParams
from epdserve.structured import StructuredFields, grammar_for, grammar_tokenizer, json_schema_grammar
from epdserve.validate import (
    InvalidFieldError,
    RequestLimits,
    SamplingFields,
    check_sampling,
    sampling_params,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def lltokenizer(tokenizer):
    return grammar_tokenizer(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize("fields", [
    StructuredFields(response_format={"type": "json_object"}),
    StructuredFields(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    StructuredFields(structured_outputs={"json": SCHEMA}),
    StructuredFields(structured_outputs={"json": json.dumps(SCHEMA)}),
    StructuredFields(structured_outputs={"regex": "[a-z]+"}),
    StructuredFields(structured_outputs={"choice": ["a", "b"]}),
    StructuredFields(structured_outputs={"grammar": 'start: "x" | "y"'}),
    StructuredFields(structured_outputs={"grammar": 'root ::= "x" | "y"'}),  # GBNF
    StructuredFields(structured_outputs={"json_object": True}),
    StructuredFields(guided_json=SCHEMA),
    StructuredFields(guided_regex="[0-9]{2}"),
    StructuredFields(guided_choice=["yes", "no"]),
    StructuredFields(guided_grammar='start: "a"+'),
])
def test_each_source_builds_a_grammar(fields, lltokenizer):
    grammar = grammar_for(fields, lltokenizer)
    assert grammar is not None
    assert not llguidance.LLMatcher(lltokenizer, grammar, log_level=0).is_error()


def test_no_constraint(lltokenizer):
    assert grammar_for(StructuredFields(), lltokenizer) is None
    assert grammar_for(StructuredFields(response_format={"type": "text"}), lltokenizer) is None
    assert grammar_for(StructuredFields(structured_outputs={}), lltokenizer) is None


@pytest.mark.parametrize(("fields", "param"), [
    (StructuredFields(response_format="json"), "response_format"),
    (StructuredFields(response_format={"type": "yaml"}), "response_format"),
    (StructuredFields(response_format={"type": "json_schema"}), "response_format"),
    (StructuredFields(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (StructuredFields(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
     "response_format"),
    (StructuredFields(guided_json="{not json"), "guided_json"),
    (StructuredFields(guided_json=[1, 2]), "guided_json"),
    (StructuredFields(guided_regex="(unclosed"), "guided_regex"),
    (StructuredFields(guided_regex=""), "guided_regex"),
    (StructuredFields(guided_choice=[]), "guided_choice"),
    (StructuredFields(guided_choice=["ok", ""]), "guided_choice"),
    (StructuredFields(guided_choice=["x"] * 257), "guided_choice"),
    (StructuredFields(guided_grammar="start: undefined_rule"), "guided_grammar"),
    (StructuredFields(guided_regex="a\ud800"), "guided_regex"),
    (StructuredFields(guided_choice=["\udc80"]), "guided_choice"),
    (StructuredFields(guided_json={"type": "string", "pattern": "\ud800"}), "guided_json"),
    (StructuredFields(guided_json='{"type": "string", "enum": ["\\ud800"]}'), "guided_json"),
    (StructuredFields(structured_outputs={"regex": "a", "json": SCHEMA}), "structured_outputs"),
    (StructuredFields(structured_outputs={"schema": SCHEMA}), "structured_outputs.schema"),
    (StructuredFields(structured_outputs={"json_object": 1}), "structured_outputs.json_object"),
    (StructuredFields(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
])
def test_bad_constraints_name_their_field(fields, param, lltokenizer):
    with pytest.raises(InvalidFieldError) as info:
        grammar_for(fields, lltokenizer)
    assert info.value.param == param


LIMITS = RequestLimits(vocab_size=49152, max_model_len=1024)


def test_logit_bias_and_grammar_in_sampling_params():
    grammar = json_schema_grammar(SCHEMA, "x")
    params = sampling_params(SamplingFields(logit_bias={"7": -100, "42": 2.5}, grammar=grammar), 5, LIMITS)
    assert params.logit_bias == ((7, -100.0), (42, 2.5)) and params.grammar == grammar
    # They travel between processes as they are (control messages encode the dataclass).
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    for bad in ({"x": 1}, {"-1": 1}, {"49152": 1}, {"1": 100.5}, {"1": float("nan")}, {"1": True}, [1], {"1" * 30: 1},
                {str(i): 1 for i in range(1025)}):
        with pytest.raises(InvalidFieldError) as info:
            check_sampling(SamplingFields(logit_bias=bad), LIMITS)
        assert info.value.param == "logit_bias"
    for name in ("ignore_eos", "min_tokens"):
        with pytest.raises(InvalidFieldError) as info:
            check_sampling(SamplingFields(grammar=grammar, **{name: 1 if name == "min_tokens" else True}), LIMITS)
        assert info.value.param == name


def _allowed(masks: GrammarMasks, request: Request) -> set[int]:
    logits = torch.zeros(1, masks.vocab_size)
    assert masks.apply(logits, [request]) == {}
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_a_matcher_built_late_replays_the_tokens_so_far(tokenizer):
    """A decode worker's matcher starts from the tokens the prefill worker sampled: it allows
    exactly what the matcher that saw them one by one allows."""
    grammar = json_schema_grammar(SCHEMA, "x")
    ids = tokenizer.encode('{"n": 12, "ok": true}', add_special_tokens=False)
    params = SamplingParams(max_tokens=64, grammar=grammar)
    live, late = GrammarMasks(tokenizer, 49152), GrammarMasks(tokenizer, 49152)
    stepped = Request("a", [1, 2, 3], params, eos_token_ids=tokenizer.eos_token_ids)
    for k, token in enumerate(ids):
        allowed = _allowed(live, stepped)
        assert token in allowed
        replayed = Request(f"b{k}", [1, 2, 3], params, eos_token_ids=tokenizer.eos_token_ids)
        replayed.output_token_ids = list(ids[:k])
        assert _allowed(late, replayed) == allowed
        late.release(replayed.request_id)
        assert live.accept(stepped, token) is None
        stepped.output_token_ids.append(token)
    # The object is complete: only the end of the sequence is allowed now.
    assert _allowed(live, stepped) == set(tokenizer.eos_token_ids)
    assert live.accept(stepped, ids[0]) is not None  # a refused token is an error, not a silent pass
    live.release("a")
    assert len(live) == 0 and len(late) == 0


def test_rows_without_a_grammar_are_untouched(tokenizer):
    masks = GrammarMasks(tokenizer, 49152)
    free = Request("free", [1], SamplingParams(), eos_token_ids=tokenizer.eos_token_ids)
    bound = Request("bound", [1], SamplingParams(grammar=json_schema_grammar({"type": "integer"}, "x")),
                    eos_token_ids=tokenizer.eos_token_ids)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 49152).to(dtype)
        before = logits.clone()
        masks.apply(logits, [free, bound, free])
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        allowed = torch.isfinite(logits[1])
        digits = {tokenizer.decode([t]) for t in torch.nonzero(allowed).flatten().tolist()}
        assert digits and all(re.fullmatch(r"-?[0-9]*", d) for d in digits), sorted(digits)[:10]


@pytest.mark.skipif(not paged_attention_cpu.is_available(), reason="the CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_matches_unpacking_with_torch(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab = 49150  # not a multiple of 32: the last word's high bits fall outside
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    bitmask[:, ::3] = 0
    bitmask[:, 1::5] = -1
    rows = [4, 0, 2, 6, 1]
    logits = torch.randn(7, vocab, generator=generator).to(dtype)
    expected = logits.clone()
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(5, -1)[:, :vocab].bool()
    for j, row in enumerate(rows):
        expected[row] = expected[row].masked_fill(~allowed[j], float("-inf"))
    paged_attention_cpu.apply_token_bitmask_(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.apply_token_bitmask_(logits, bitmask, torch.tensor([0, 1, 2, 3, 7]))


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(dtype="float32", kv_cache_memory_gib=0.25), load_model(None, torch.float32))


def test_engine_follows_the_grammar_and_the_bias(engine):
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(f"Question {i}: is it true?") for i in range(4)]
    grammar = grammar_for(StructuredFields(guided_choice=["yes, certainly", "no"]), None)
    for temperature in (0.0, 1.0):
        results = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=temperature, seed=3,
                                                          grammar=grammar))
        for (completion,) in results:
            assert completion.text in ("yes, certainly", "no") and completion.finish_reason == "stop"
    assert len(engine.runner.grammar) == 0  # every matcher released with its request
    (free,), = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
    (banned,), = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0,
                                                             logit_bias=((free.token_ids[0], -100.0),)))
    assert banned.token_ids[0] != free.token_ids[0]
    forced_token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    (forced,), = engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=1.0, seed=1,
                                                             logit_bias=((forced_token, 100.0),)))
    assert forced.token_ids == [forced_token, forced_token]
