"""`ft generate`: one prompt through the engine, streamed to the terminal or as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ft.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt", description="Generate text for one prompt.",
                       usage="%(prog)s [MODEL] --prompt TEXT [options]")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: the smallest set of "
                   "tokens whose probabilities add up to P (1: all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--sample-seed", type=int, default=None, metavar="N",
                   help="seed of this request's sampling (default: a random one)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ft.engine.base.sampling_params import SamplingParams
    from ft.errors import FreeTokenError
    from ft.preflight import build_engine, check_model

    def say(line: str) -> None:  # a startup phase begins (unless --no-progress)
        print(f"ft generate: {line}", file=sys.stderr, flush=True)

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = None
    try:
        config = engine_config_from_args(args)
        if config.max_running_requests is None:  # one request: no room for others (nor KV for them)
            config = dataclasses.replace(config, max_running_requests=1)
        check_model(config)  # one line for a user error, before anything loads
        engine = build_engine(config, say if args.progress is not False else None)
        tok = engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
        ids = tok.encode(text)
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.sample_seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        )
        t0 = time.perf_counter()
        seq = engine.add_request(ids, params)
        first = None
        while not seq.is_finished:
            for s in engine.step():
                if first is None:
                    first = time.perf_counter()
                if not args.json and s is seq:  # the text this token releases (stop strings applied)
                    sys.stdout.write(seq.text.delta)
                    sys.stdout.flush()
        end = time.perf_counter()
    except FreeTokenError as e:
        print(f"ft generate: {e}", file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.close()  # tensor parallelism: the worker ranks leave with this one
    n = len(seq.output_ids)
    decode_s = end - (first or end)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    if args.json:
        print(json.dumps({
            "text": engine.text_of(seq), "token_ids": seq.output_ids, "prompt_tokens": len(ids),
            "finish_reason": seq.finish_reason, "time_to_first_token_s": round((first or end) - t0, 4),
            "decode_tokens_per_s": round(rate, 2),
        }))
    else:
        print()
        print(f"[{n} tokens, {seq.finish_reason}; first token {(first or end) - t0:.2f} s, "
              f"decode {rate:.1f} tokens/s]", file=sys.stderr)
    return 0
