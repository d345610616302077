"""A tiktoken vocabulary converted to `tokenizer.json` (`ft.tools.tiktoken_vocab`) encodes as tiktoken
does: checked against tiktoken's rule written out here (split by the pattern; a piece that is a token
is taken whole; else join, again and again, the adjacent pair that forms the lowest-ranked token), on a
small vocabulary trained here (with a token reachable only whole and one joined from a higher-ranked
part), and on the Qwen3.5 vocabulary of Qwen3.8-Flash-Next when its reference copy is beside the repo.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
import tokenizers

from ft.engine.text.tokenizer import Tokenizer
from ft.tools.tiktoken_vocab import ensure_tokenizer_json

QWEN35 = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen3.5-tokenizer"
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = ("The tokenizer of the seeds' model reads text like this: numbers 12345, punctuation!? and\n"
        "new lines, unicode — café, naïve, 東京 and 人力资源, emoji 🙂, and repeated words words words.\n")


def tiktoken_encode(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    out = []
    for piece in regex.findall(pattern, text):
        b = piece.encode()
        if b in ranks:
            out.append(ranks[b])
            continue
        parts = [b[i: i + 1] for i in range(len(b))]
        while True:
            joins = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
            if not joins:
                break
            _, i = min(joins)
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        out.extend(ranks[p] for p in parts)
    return out


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """256 byte tokens, then `merges` joins of the most frequent adjacent pair within the pieces."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([c]) for c in p.encode()] for p in regex.findall(PATTERN, text * 3)]
    for _ in range(merges):
        counts: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        ranks.setdefault(best[0] + best[1], len(ranks))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i: i + 2] = [best[0] + best[1]]
                i += 1
    return ranks


def write_vocab(folder: Path, ranks: dict[bytes, int], special: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (folder / "special_tokens_and_pattern.json").write_text(json.dumps({"pattern": PATTERN, "special_tokens": special}))
    return folder


def test_small_vocabulary_encodes_as_tiktoken(tmp_path):
    ranks = train_ranks(TEXT, 120)
    n = len(ranks)
    whole = "Zürich".encode()  # reachable only whole: no split of it is two tokens
    added = [whole, b" words words", b" wordswords", b"wordswords"]  # the last: a higher-ranked part of the one before
    assert not any(t in ranks for t in added)
    assert not any(whole[:i] in ranks and whole[i:] in ranks for i in range(1, len(whole)))
    for i, t in enumerate(added):
        ranks[t] = n + i
    special = {"<|endoftext|>": n + 4, "<|im_start|>": n + 5, "<|im_end|>": n + 6}
    folder = write_vocab(tmp_path / "vocab", ranks, special)
    tok = Tokenizer.from_dir(folder)  # no tokenizer.json: converted into the cache
    samples = [TEXT, "Zürich café wordswords words words", "  leading spaces\n\n\ttabs", "🙂🙂 x"]
    for s in samples:
        assert tok.encode(s) == tiktoken_encode(s, ranks, PATTERN), s
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("Zürich") == [n] and tok.encode(" wordswords") == [n + 2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == n + 5
    assert tok.eos_token_ids >= {n + 6, n + 4}
    assert "<|im_start|>assistant\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                 add_generation_prompt=True)
    again = ensure_tokenizer_json(folder)  # the cached conversion is reused
    assert tokenizers.Tokenizer.from_file(str(again / "tokenizer.json")).encode(TEXT).ids == tok.encode(TEXT)


@pytest.mark.skipif(not QWEN35.is_dir(), reason="the Qwen3.5 tokenizer's reference copy is not beside the repo")
def test_qwen35_vocabulary_encodes_as_tiktoken():
    spec = json.loads((QWEN35 / "special_tokens_and_pattern.json").read_text())
    ranks = {base64.b64decode(t): int(r) for t, r in
             (line.split() for line in next(QWEN35.glob("*.tiktoken")).read_text().splitlines() if line)}
    tok = Tokenizer.from_dir(QWEN35)
    text = TEXT + " 俱乐部的人力资源 Qwen3.8-Flash-Next: hybrid linear attention, 512 experts, NVFP4.\n" * 2
    assert tok.encode(text) == tiktoken_encode(text, ranks, spec["pattern"])
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|endoftext|>") == [248044] and 248046 in tok.eos_token_ids
