"""The ``epdserve`` command line.

Every user-facing error ends as one line on stderr and a nonzero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from epdserve.cli_args import add_engine_args, engine_args_from
from epdserve.envs import get_log_level
from epdserve.errors import EpdserveError

EXIT_USAGE = 2
DEFAULT_GENERATE_TOKENS = 64  # generate's output tokens per prompt without --max-tokens


def _generate(ns: argparse.Namespace) -> int:
    from dataclasses import replace

    from epdserve.engine.engine import LLMEngine
    from epdserve.errors import InvalidRequestError
    from epdserve.validate import (
        RequestLimits,
        SamplingFields,
        check_prompt_ids,
        check_prompt_text,
        check_sampling,
        longest_token_chars,
        sampling_params,
    )

    if ns.prompt is None and ns.prompts_file is None:
        raise InvalidRequestError("give --prompt TEXT or --prompts-file FILE")
    if ns.prompts_file is not None:
        try:
            with open(ns.prompts_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise InvalidRequestError(f"cannot read prompts file: {e.strerror}: {ns.prompts_file}") from None
        except UnicodeDecodeError:
            raise InvalidRequestError(f"prompts file {ns.prompts_file} is not UTF-8 text") from None
        if not prompts:
            raise InvalidRequestError(f"prompts file {ns.prompts_file} has no prompts")
    else:
        prompts = [ns.prompt]
    fields = SamplingFields(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            stop=ns.stop, ignore_eos=ns.ignore_eos)
    engine = LLMEngine(engine_args_from(ns))
    # The same bounds as a request to the server.
    limits = RequestLimits(vocab_size=engine.loaded.spec.vocab_size, max_model_len=engine.max_model_len, max_n=1,
                           max_chars_per_token=longest_token_chars(engine.tokenizer.backend.get_vocab()))
    check_sampling(fields, limits)
    prompt_ids, params = [], []
    for prompt in prompts:
        ids = engine.encode_prompt(check_prompt_text(prompt, limits), chat=ns.chat)
        check_prompt_ids(ids, limits)
        engine.validate_prompt(ids)  # and the prompt's KV blocks fit the cache
        room = engine.max_model_len - len(ids)
        # Without --max-tokens: DEFAULT_GENERATE_TOKENS, or what the context leaves when less.
        fit = fields if ns.max_tokens is not None else replace(fields, max_tokens=min(DEFAULT_GENERATE_TOKENS, room))
        prompt_ids.append(ids)
        params.append(sampling_params(fit, len(ids), limits))
    results = engine.generate(prompt_ids, params)
    for prompt, (completion,) in zip(prompts, results):
        if ns.json:
            print(json.dumps({
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "num_prompt_tokens": completion.num_prompt_tokens,
            }, ensure_ascii=False))
        elif len(prompts) == 1:
            print(completion.text)
        else:
            print(f"--- {prompt}\n{completion.text}")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    import asyncio

    from epdserve.router.serve import serve

    try:  # libuv's event loop: less CPU per streamed token than asyncio's own
        import uvloop
    except ImportError:
        return asyncio.run(serve(ns))
    return uvloop.run(serve(ns))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve", description="Disaggregated LLM serving: encode / prefill / decode.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with one engine")
    gen.add_argument("--prompt", default=None, help="the prompt text")
    gen.add_argument("--prompts-file", default=None, help="one prompt a line, all batched through the engine")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"output tokens per prompt (default {DEFAULT_GENERATE_TOKENS}, or what the context leaves)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object a line per prompt")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from epdserve.router.serve import add_serve_args

    srv = sub.add_parser("serve", help="OpenAI-compatible server over colocated or P/D worker pools")
    add_serve_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    from epdserve.cluster.worker_cli import add_worker_parser

    add_worker_parser(sub)

    from epdserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from epdserve.planner.plan_cli import add_plan_parser
    from epdserve.sim.cli import add_simulate_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)

    from epdserve.planner.profile_cli import add_profile_parser

    add_profile_parser(sub)

    from epdserve.planner.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=get_log_level(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    ns = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = ns.func
    try:
        return func(ns)
    except EpdserveError as e:
        print(f"epdserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
