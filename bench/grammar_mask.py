"""Token-mask computation time per token of the grammar engines, on the demo tokenizer (byte-level
BPE, 320 tokens). Not a test; CPU only.

    PYTHONPATH=. python3 bench/grammar_mask.py [--tokens 2000]

For each engine installed (llguidance: what FreeToken uses; outlines-core, for comparison), a
small object schema is walked by drawing a random allowed token each step (seeded), restarting when
the grammar completes; reports the setup time (tokenizer index, schema compilation) and the mean
mask time per token. xgrammar is not measured: it needs torch, triton, transformers and
apache-tvm-ffi at install time (see ft/engine/text/grammar.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from ft.engine.text.grammar import GrammarCompiler, json_schema_spec, mask_words
from ft.tools.demo import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, build_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"},
                                                                                "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def allowed_ids(row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:vocab]
    return bits.nonzero().flatten().tolist()


def bench_llguidance(tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    compiler = GrammarCompiler(build_tokenizer().to_str(), VOCAB_SIZE, [IM_END_ID, ENDOFTEXT_ID])
    spec = json_schema_spec(SCHEMA)
    matcher = compiler.matcher(spec)
    setup = time.perf_counter() - t0
    rng = random.Random(0)
    row = torch.zeros(mask_words(VOCAB_SIZE), dtype=torch.int32)
    spent = 0.0
    for _ in range(tokens):
        t = time.perf_counter()
        matcher.fill(row)
        spent += time.perf_counter() - t
        ids = allowed_ids(row, VOCAB_SIZE)
        tok = rng.choice(ids)
        matcher.accept(tok)
        if matcher.done:
            matcher = compiler.matcher(spec)
    return setup, spent / tokens


def bench_outlines(tokens: int) -> tuple[float, float] | None:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    tok = build_tokenizer()
    t0 = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    for i in range(VOCAB_SIZE):
        if i in (ENDOFTEXT_ID, IM_END_ID) or i >= tok.get_vocab_size():
            continue
        text = tok.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass")
        vocab.setdefault(text, []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(IM_END_ID, vocab))
    guide = Guide(index)
    setup = time.perf_counter() - t0
    rng = random.Random(0)
    spent = 0.0
    for _ in range(tokens):
        t = time.perf_counter()
        ids = list(guide.get_tokens())
        spent += time.perf_counter() - t
        tok_id = rng.choice(ids)
        if tok_id == IM_END_ID or guide.is_finished():
            guide = Guide(index)
            continue
        guide.advance(tok_id)
    return setup, spent / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    rows = [("llguidance", bench_llguidance(args.tokens))]
    try:
        rows.append(("outlines-core", bench_outlines(args.tokens)))
    except Exception as e:  # NOTE: a comparison only: its API or its regex support may not fit
        print(f"outlines-core: not measured ({type(e).__name__}: {e})")
    print(f"{'engine':<14} {'setup ms':>9} {'mask us/token':>14}")
    for name, r in rows:
        if r is not None:
            print(f"{name:<14} {r[0] * 1e3:9.1f} {r[1] * 1e6:14.1f}")


if __name__ == "__main__":
    main()
