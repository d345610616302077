"""A `tokenizer.json` from a tiktoken vocabulary (byte-level BPE ranks), for the `tokenizers` library.

The Qwen3.5-family vocabulary of Qwen3.8-Flash-Next is published as tiktoken ranks (`*.tiktoken`:
one base64 token and its rank a line) with a JSON of the pre-tokenization regex and the special
tokens (`special_tokens_and_pattern.json`). `Tokenizer.from_dir` reads such a folder through
`ensure_tokenizer_json`, which converts it once into a cache folder:

- tiktoken encodes a pre-token by merging, again and again, the adjacent pair whose joined bytes are
  the lowest-ranked token. A BPE whose merges are every split of every token into two tokens, each
  with the joined token's rank as its priority, makes the same choices. (One merge per token, its
  split under the lower ranks alone, is not enough: some tokens join a higher-ranked part, e.g.
  '人力资源' is 人力 + 资源 where 人力 ranks after it.) A pre-token that is itself a token is taken whole
  (`ignore_merges`), as tiktoken does: the only way to a token that is no two tokens joined ('俱乐部').
- tokens are written in the GPT-2 byte-to-character alphabet that the byte-level pre-tokenizer and
  decoder of `tokenizers` use; the regex splits first (isolated), then bytes map to characters.

tests/test_tiktoken_vocab.py checks the result against a tiktoken-style encoder written from the rule
above, on a small vocabulary in CI and on the real one when it is present.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

__all__ = ["byte_alphabet", "ensure_tokenizer_json", "find_tiktoken_files", "read_ranks",
           "tokenizer_json"]

SPECIAL_FILE = "special_tokens_and_pattern.json"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the Qwen family's turn format (the folder carries no template of its own)."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters: the printable Latin-1 bytes
    ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the others for code points from 256 up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A `.tiktoken` file: {token bytes: rank}."""
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizer_json(ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> dict:
    """The `tokenizers` JSON of a byte-level BPE equal to tiktoken's encoding with these ranks."""
    alphabet = byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges.extend([text(a), text(b)] for a, b in splits)
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for s, i in sorted(special.items(), key=lambda kv: kv[1])]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(t): r for t, r in ranks.items()}, "merges": merges},
    }


def find_tiktoken_files(folder: str | Path) -> tuple[Path, Path] | None:
    """(the `.tiktoken` ranks, the special tokens and pattern JSON) of a folder without tokenizer.json;
    None when it has no such pair."""
    folder = Path(folder)
    ranks = sorted(folder.glob("*.tiktoken"))
    special = folder / SPECIAL_FILE
    if len(ranks) != 1 or not special.is_file():
        return None
    return ranks[0], special


def ensure_tokenizer_json(folder: str | Path, cache_root: str | Path | None = None) -> Path:
    """A folder with tokenizer.json (and tokenizer_config.json: ChatML, `<|im_end|>` the end of a turn)
    converted from `folder`'s tiktoken files, made once per content in the cache (`cache_root`, else
    `ft.tools.demo.default_cache_dir()`: $FT_CACHE_DIR or ~/.cache/freetoken) and reused. Raises
    FileNotFoundError when `folder` has no tiktoken pair."""
    found = find_tiktoken_files(folder)
    if found is None:
        raise FileNotFoundError(f"{folder}: no tokenizer.json, nor a *.tiktoken file with {SPECIAL_FILE}")
    ranks_path, special_path = found
    digest = hashlib.sha256(ranks_path.read_bytes() + special_path.read_bytes()).hexdigest()[:16]
    from ft.tools.demo import default_cache_dir

    root = Path(cache_root) if cache_root else default_cache_dir()
    out = root / f"tiktoken-{digest}"
    if (out / "tokenizer.json").is_file():
        return out
    spec = json.loads(special_path.read_text())
    special = {k: int(v) for k, v in spec["special_tokens"].items()}
    data = tokenizer_json(read_ranks(ranks_path), spec["pattern"], special)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>" if "<|im_end|>" in special else None,
              "pad_token": "<|endoftext|>" if "<|endoftext|>" in special else None, "bos_token": None}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    if "<|endoftext|>" in special:  # both end a generation
        ids = [special[s] for s in ("<|im_end|>", "<|endoftext|>") if s in special]
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        pass
    return out
