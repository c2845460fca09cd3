"""Per-token cost of the two CPU grammar libraries on the default model's tokenizer, one run,
side by side: llguidance (what epdserve uses) and xgrammar (when installed).

    python benchmarks/grammar_backends.py [--repeats 5]

For a JSON schema of the structured-output benchmark's kind, each library: the time to build a
matcher for the schema (compile + matcher; xgrammar caches compiled grammars, so its second
build is a lookup), and the time to compute the next-token mask, per token, while a valid JSON
text is fed through the matcher; then the cost of masking a batch of logits with the masks
(epdserve's CPU kernel, torch ops, and xgrammar's function), and what the P/D hand-off costs
the decode worker (a matcher built and the tokens so far replayed). Medians over ``--repeats``.
xgrammar is not a dependency of epdserve (it needs torch, transformers and triton); install it
into the venv to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import torch

from epdserve.engine.grammar import GrammarMasks
from epdserve.models.layers import paged_attention_cpu
from epdserve.models.loader import load_default_tokenizer
from epdserve.structured import grammar_tokenizer, json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "year", "tags", "rating"],
    "additionalProperties": False,
}
TEXT = json.dumps({"title": "The Long Road Home", "year": 2015, "tags": ["drama", "family", "travel"], "rating": 4})


def _llguidance(tokenizer, vocab: int, ids: list[int]) -> tuple[float, float]:
    lltokenizer = grammar_tokenizer(tokenizer.backend.to_str(), vocab, tokenizer.eos_token_ids)
    grammar = json_schema_grammar(SCHEMA, "schema")
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    build = time.perf_counter() - start
    mask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    spent = 0.0
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        spent += time.perf_counter() - start
        assert matcher.consume_token(token), "the text does not follow the schema"
    return build, spent / len(ids)


def _xgrammar(tokenizer, vocab: int, ids: list[int], state: dict) -> tuple[float, float] | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if "compiler" not in state:
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(tokenizer.eos_token_ids))
        state["compiler"] = xgrammar.GrammarCompiler(info)
        state["mask"] = xgrammar.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(state["compiler"].compile_json_schema(json.dumps(SCHEMA)))
    build = time.perf_counter() - start
    spent = 0.0
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(state["mask"], 0)
        spent += time.perf_counter() - start
        assert matcher.accept_token(token)
    return build, spent / len(ids)


def _apply_ms(fn, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_default_tokenizer()
    vocab = tokenizer.vocab_size
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    print(f"schema text: {len(ids)} tokens, vocabulary {vocab}, {torch.get_num_threads()} threads")
    rows: dict[str, list[tuple[float, float]]] = {"llguidance": [], "xgrammar": []}
    state: dict = {}
    for _ in range(args.repeats):
        rows["llguidance"].append(_llguidance(tokenizer, vocab, ids))
        result = _xgrammar(tokenizer, vocab, ids, state)
        if result is not None:
            rows["xgrammar"].append(result)
    for name, results in rows.items():
        if not results:
            print(f"{name:>10}: not installed")
            continue
        build = statistics.median(r[0] for r in results) * 1e3
        per_token = statistics.median(r[1] for r in results) * 1e6
        print(f"{name:>10}: matcher build {build:6.2f} ms   next-token mask {per_token:6.1f} us/token")
    # The P/D hand-off: the decode worker builds the matcher and replays the tokens so far (the
    # prefill worker's first token; after a preemption, all of them).
    lltokenizer = grammar_tokenizer(tokenizer.backend.to_str(), vocab, tokenizer.eos_token_ids)
    grammar = json_schema_grammar(SCHEMA, "schema")
    for replayed in (1, len(ids)):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
            assert matcher.consume_tokens(ids[:replayed])
            times.append(time.perf_counter() - start)
        print(f"hand-off: matcher build + replay of {replayed:>2} tokens {statistics.median(times) * 1e3:6.2f} ms")
    masks = GrammarMasks(tokenizer, vocab)
    for batch in (1, 16, 64):
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
        logits = torch.randn(batch, vocab).to(torch.bfloat16)
        rows_t = torch.arange(batch)
        line = f"mask {batch:>2} x {vocab} bf16 logits:"
        if paged_attention_cpu.is_available():
            line += f"  kernel {_apply_ms(lambda: paged_attention_cpu.apply_token_bitmask_(logits, bitmask, rows_t)):.3f} ms"

        def with_torch() -> None:
            allowed = masks._unpack(bitmask)[:, :vocab]
            logits.masked_fill_(~allowed, float("-inf"))

        line += f"  torch ops {_apply_ms(with_torch):.3f} ms"
        if "compiler" in state:
            import xgrammar
            line += f"  xgrammar {_apply_ms(lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask)):.3f} ms"
        print(line)


if __name__ == "__main__":
    main()
