"""The ``epdserve`` command line.

Every user-facing error ends as one line on stderr and a nonzero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from epdserve.cli_args import add_engine_args, engine_args_from
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

    return asyncio.run(serve(ns))


def _worker(ns: argparse.Namespace) -> int:
    from epdserve.cluster.worker import WorkerOptions, run_worker

    cores = tuple(int(c) for c in ns.cores.split(",")) if ns.cores else ()
    if ns.role == "encode":
        from epdserve.cluster.encode_worker import EncodeWorkerOptions, run_encode_worker

        return run_encode_worker(EncodeWorkerOptions(
            router=ns.router, worker_id=ns.worker_id or f"encode-{os.getpid()}", model=ns.model,
            vision=ns.vision, dtype=ns.dtype, device=ns.device, seed=ns.seed, cores=cores,
            max_batch_images=ns.encode_batch_images, cache_bytes=int(ns.encoder_cache_mb * (1 << 20)),
            die_with_parent=ns.die_with_parent,
        ))
    opts = WorkerOptions(
        role=ns.role, router=ns.router, cores=cores, kv_transport=ns.kv_transport, kv_host=ns.kv_host,
        layerwise=not ns.no_layerwise, die_with_parent=ns.die_with_parent,
        reservation_lease_s=ns.reservation_lease,
        stall_kv_transfers=ns.debug_stall_kv_transfers, vision=ns.vision, embed_slab_mb=ns.embed_slab_mb,
        embed_transport=ns.embed_transport,
        max_batch_images=ns.encode_batch_images, encoder_cache_mb=ns.encoder_cache_mb,
        step_trace_dir=ns.step_trace_dir,
        **({"worker_id": ns.worker_id} if ns.worker_id else {}),
    )
    return run_worker(opts, engine_args_from(ns))


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

    wrk = sub.add_parser("worker", help="a worker that registers with a running router")
    wrk.add_argument("--role", required=True, choices=("colocated", "prefill", "decode", "encode"))
    wrk.add_argument("--router", required=True, help="the router's worker socket, tcp://HOST:PORT")
    wrk.add_argument("--worker-id", default=None)
    wrk.add_argument("--cores", default="", help="comma-separated CPU cores to pin to")
    wrk.add_argument("--kv-transport", choices=("shm", "tcp"), default="shm", help="decode: how prefill reaches its KV pages")
    wrk.add_argument("--kv-host", default="127.0.0.1", help="decode + tcp: address of the KV listener")
    wrk.add_argument("--no-layerwise", action="store_true", help="prefill: push KV in bulk after prefill")
    wrk.add_argument("--reservation-lease", type=float, default=120.0,
                     help="decode: seconds a KV reservation waits for its KV before it expires")
    wrk.add_argument("--vision", default=None, help="take images with this vision tower: 'default' or 'smolvlm-256m' (seeded), 'checkpoint' (the model directory's own)")
    wrk.add_argument("--embed-slab-mb", type=float, default=0.0, help="prefill/colocated: embedding slab for encode workers (0: encode in-process)")
    wrk.add_argument("--embed-transport", choices=("shm", "tcp"), default="shm", help="how encode workers reach the slab")
    wrk.add_argument("--encode-batch-images", type=int, default=1, help="images per encoder forward pass")
    wrk.add_argument("--encoder-cache-mb", type=float, default=256.0, help="content-hash embedding cache")
    wrk.add_argument("--step-trace-dir", default=None, help="write every model step to DIR/<worker id>.jsonl (for epdserve calibrate)")
    wrk.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    wrk.add_argument("--debug-stall-kv-transfers", action="store_true", help=argparse.SUPPRESS)
    add_engine_args(wrk)
    wrk.set_defaults(func=_worker)

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
