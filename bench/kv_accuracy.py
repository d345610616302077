"""KV cache dtypes against a full-precision cache: logits error and greedy agreement. CPU, reference path.

    PYTHONPATH=. python3 bench/kv_accuracy.py [--model demo] [--prompts 6] [--tokens 32]

For each prompt, the same engine settings with `--kv-cache-dtype` auto (float32 on the CPU: the
reference), bf16, fp8 (e4m3) and nvfp4 (E2M1 with an e4m3 scale per 16 values), the last two with
their per-layer scales at 1.0 (the default) and set from each engine's first prefill
(`--kv-scale-calibration`; the first prompt's, so later prompts are measured with scales they did
not set): relative RMS of the logits after the prompt's prefill and after each of the first 8
decode steps (teacher-forced on the reference's tokens, so that every dtype sees the same
context), and how many greedy tokens agree before the first difference with the reference's and
with the bf16 cache's tokens. Bytes per token are the pool's (every full-attention layer, K and V).
Prints a table last.
"""

from __future__ import annotations

import argparse

import torch

from ft.engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    # "x": scales 1.0 (the default); "x, calibrated": --kv-scale-calibration (set from the first prefill)
    kinds = ("bf16", "fp8", "fp8, calibrated", "nvfp4", "nvfp4, calibrated")

    def engine(kind: str):
        dtype, _, calibrated = kind.partition(", ")
        return LLM(model=args.model, device="cpu", dtype="float32", num_tokens=4096, kv_cache_dtype=dtype,
                   kv_scale_calibration=bool(calibrated)).engine

    engines = {d: engine(d) for d in ("auto", *kinds)}
    vocab = engines["auto"].model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, min(vocab, 5000), (64 + 48 * i,), generator=gen).tolist() for i in range(args.prompts)]
    rows = {d: {"err": [], "agree": 0, "agree_bf16": 0, "total": 0} for d in kinds}
    for p in prompts:
        want = run(engines["auto"], p, args.tokens)
        free = {d: run(engines[d], p, args.tokens) for d in kinds}
        for d in kinds:
            forced = run(engines[d], p, 8, teacher=want["tokens"][:8])
            rows[d]["err"] += [rel(a, b) for a, b in zip(forced["logits"], want["logits"])]
            rows[d]["agree"] += first_difference(free[d]["tokens"], want["tokens"])
            rows[d]["agree_bf16"] += first_difference(free[d]["tokens"], free["bf16"]["tokens"])
            rows[d]["total"] += args.tokens
    print(f"\n{args.model}, {args.prompts} prompts of 64-{64 + 48 * (args.prompts - 1)} tokens, {args.tokens} greedy tokens")
    print("| KV dtype | bytes per token (vs bf16) | logits rel RMS vs fp32 KV, median / max | greedy tokens agreeing "
          "before the first difference, vs fp32 KV | vs bf16 KV |")
    print("|---|---|---|---|---|")
    bf16 = engines["bf16"].pools.kv
    for d in kinds:
        kv, r = engines[d].pools.kv, rows[d]
        err = sorted(r["err"])
        per_token = kv.bytes_per_page // kv.page_size
        print(f"| {d} | {per_token:,} ({kv.bytes_per_page / bf16.bytes_per_page:.3f}x) | {err[len(err) // 2]:.2e} / "
              f"{err[-1]:.2e} | {r['agree']} of {r['total']} ({r['agree'] / r['total']:.0%}) | "
              + ("-" if d == "bf16" else f"{r['agree_bf16']} of {r['total']} ({r['agree_bf16'] / r['total']:.0%})")
              + " |")


def first_difference(a: list[int], b: list[int]) -> int:
    """How many tokens agree before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(engine, prompt: list[int], n: int, teacher: list[int] | None = None) -> dict:
    """Greedy decode of n tokens (or the teacher's tokens fed back): the tokens and the logits
    after the prefill and after each step."""
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    engine.run_until_done([seq])
    logits, tokens = [engine.last_logits[0].clone()], [seq.output_ids[0]]
    ctx = prompt + [teacher[0] if teacher else seq.output_ids[0]]
    for i in range(1, n):
        # NOTE: each step re-prefills the context (the prefix cache makes it one token of work)
        seq = engine.add_request(ctx, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        engine.run_until_done([seq])
        logits.append(engine.last_logits[0].clone())
        tokens.append(seq.output_ids[0])
        ctx.append(teacher[i] if teacher else seq.output_ids[0])
    return {"logits": logits, "tokens": tokens}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


if __name__ == "__main__":
    main()
