"""The built-in demo checkpoint: a tiny Qwen3-Next MoE with random weights, NVFP4-quantized.

`ensure_demo_checkpoint()` returns a directory laid out exactly like a Hugging Face / ModelOpt
NVFP4 Qwen3-Next checkpoint (config.json, hf_quant_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), generating it on first use. It
exercises every code path of the engine (hybrid linear/full attention, 64 routed experts, the
shared expert, NVFP4 weights) in a few megabytes, with no download.

Everything is deterministic: the byte-level BPE tokenizer is trained on the corpus below, and the
weights come from a `torch.Generator` seeded with `DEMO_SEED`, so every generation writes the
same bytes. The cache folder is named after `DEMO_VERSION`; bump it whenever the generator's
output changes so that stale copies are never reused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEMO_NAME = "ft-demo"
DEMO_SEED = 20261129
DEMO_VERSION = 1
DEMO_DIRNAME = f"demo-v{DEMO_VERSION}"

# Special tokens, in the order they are appended after the byte-level BPE vocabulary.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

VOCAB_SIZE = 320
BPE_VOCAB_SIZE = VOCAB_SIZE - len(SPECIAL_TOKENS)  # 256 byte tokens + 61 merges
ENDOFTEXT_ID = BPE_VOCAB_SIZE  # 317
IM_START_ID = BPE_VOCAB_SIZE + 1  # 318
IM_END_ID = BPE_VOCAB_SIZE + 2  # 319

_NUM_LAYERS = 8
_FULL_ATTENTION_INTERVAL = 4

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": _NUM_LAYERS,
    "layer_types": [
        "full_attention" if (i + 1) % _FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(_NUM_LAYERS)
    ],
    "full_attention_interval": _FULL_ATTENTION_INTERVAL,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "dtype": "bfloat16",
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

# ChatML in Qwen's style: optional system turn, user/assistant turns, tool results wrapped in
# <tool_response> inside a user turn, and `<|im_start|>assistant\n` as the generation prompt.
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- elif message.content is iterable and message.content is not mapping %}\n"
    "        {%- set parts = namespace(text='') %}\n"
    "        {%- for part in message.content %}\n"
    "            {%- if part.type == 'text' %}\n"
    "                {%- set parts.text = parts.text + part.text %}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "        {%- set content = parts.text %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if message.role in ['system', 'user', 'assistant'] %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('unsupported chat role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen2/Qwen3's pre-tokenizer split pattern (contractions, letters, single digits, punctuation
# runs, newlines, spaces), applied before the byte-level mapping.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The text the demo's BPE merges are learned from. Any UTF-8 text still encodes (byte fallback
# is built in to byte-level BPE); this only decides which frequent pairs become single tokens.
_CORPUS = """\
The demo model is small, but it is shaped like the real thing. It has the same kinds of layers,
the same names for its tensors, and the same way of storing its weights in four bits. When you ask
it a question, the answer will not make much sense, because the weights are random. That is fine:
the point of the demo is to show that the engine can load a model, route each token to a few of its
experts, and stream the reply back to you, one token at a time.

A user writes a message and the assistant replies. The system message sets the tone of the chat.
The user can ask about the weather, the time, a recipe, or the meaning of a word. The assistant
should answer in a clear and helpful way, and it should say so when it does not know the answer.
Then the user may ask another question, and the conversation goes on until one of them stops.

There are three things to remember. First, the prompt is turned into tokens. Second, the model
reads the tokens and predicts the next one. Third, the new token is added to the text, and the
model runs again. This is how the text grows, one piece after another, until the end token comes.

In the morning the sun rises over the hills, and the light falls on the river and the trees. The
birds sing in the garden, the children walk to school, and the people in the town start their
work. In the evening the air is cool, the streets are quiet, and the lights come on in the houses.
We like to read, to write, to learn, and to share what we know with the people around us.

Numbers such as 1, 2, 3, 10, 42 and 2026 are split into single digits. Words like engine, expert,
router, token, layer, memory, cache and server appear in this text so that they get short codes.
Hello, world! How are you today? I am well, thank you. Please tell me more about the model.
"""


# ----------------------------------------------------------------------------------- tokenizer
def build_tokenizer():
    """The demo's byte-level BPE `tokenizers.Tokenizer` (deterministic, 320 tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"demo tokenizer: BPE training gave {tok.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}"
        )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
         for t in SPECIAL_TOKENS]
    )
    for token, expected in zip(SPECIAL_TOKENS, (ENDOFTEXT_ID, IM_START_ID, IM_END_ID)):
        if tok.token_to_id(token) != expected:
            raise RuntimeError(f"demo tokenizer: {token} got id {tok.token_to_id(token)}, expected {expected}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json of the demo (Qwen's fields, PreTrainedTokenizerFast class)."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in zip((ENDOFTEXT_ID, IM_START_ID, IM_END_ID), SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": DEMO_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


# ------------------------------------------------------------------------------------- weights
def hf_tensor_specs(cfg: dict[str, Any] = DEMO_CONFIG) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a Qwen3NextForCausalLM checkpoint, in a fixed order.

    Names and shapes are those `transformers` writes with `save_pretrained` (per-expert weights).
    `init` is one of: linear, router, embed, norm, ones, conv, a_log, dt_bias.
    """
    h = cfg["hidden_size"]
    n_heads, n_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    n_exp, moe_i = cfg["num_experts"], cfg["moe_intermediate_size"]
    shared_i, dense_i = cfg["shared_expert_intermediate_size"], cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    sparse_step = cfg.get("decoder_sparse_step", 1)
    mlp_only = set(cfg.get("mlp_only_layers") or ())

    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, h), "embed")]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
        if kind == "linear_attention":
            a = p + "linear_attn."
            specs += [
                (a + "in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h), "linear"),
                (a + "in_proj_ba.weight", (2 * nv, h), "linear"),
                (a + "conv1d.weight", (conv_dim, 1, cfg["linear_conv_kernel_dim"]), "conv"),
                (a + "dt_bias", (nv,), "dt_bias"),
                (a + "A_log", (nv,), "a_log"),
                (a + "norm.weight", (dv,), "ones"),
                (a + "out_proj.weight", (h, value_dim), "linear"),
            ]
        else:
            a = p + "self_attn."
            specs += [
                (a + "q_proj.weight", (n_heads * hd * 2, h), "linear"),  # query and output gate
                (a + "k_proj.weight", (n_kv * hd, h), "linear"),
                (a + "v_proj.weight", (n_kv * hd, h), "linear"),
                (a + "o_proj.weight", (h, n_heads * hd), "linear"),
                (a + "q_norm.weight", (hd,), "norm"),
                (a + "k_norm.weight", (hd,), "norm"),
            ]
        m = p + "mlp."
        if i not in mlp_only and n_exp > 0 and (i + 1) % sparse_step == 0:
            specs.append((m + "gate.weight", (n_exp, h), "router"))
            for e in range(n_exp):
                x = f"{m}experts.{e}."
                specs += [
                    (x + "gate_proj.weight", (moe_i, h), "linear"),
                    (x + "up_proj.weight", (moe_i, h), "linear"),
                    (x + "down_proj.weight", (h, moe_i), "linear"),
                ]
            specs += [
                (m + "shared_expert.gate_proj.weight", (shared_i, h), "linear"),
                (m + "shared_expert.up_proj.weight", (shared_i, h), "linear"),
                (m + "shared_expert.down_proj.weight", (h, shared_i), "linear"),
                (m + "shared_expert_gate.weight", (1, h), "linear"),
            ]
        else:
            specs += [
                (m + "gate_proj.weight", (dense_i, h), "linear"),
                (m + "up_proj.weight", (dense_i, h), "linear"),
                (m + "down_proj.weight", (h, dense_i), "linear"),
            ]
    specs += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (vocab, h), "embed")]
    return specs


def _normal(shape: tuple[int, ...], std: float, g) -> Any:
    """float32 normal(0, std) samples of `shape`, from uniform draws by Box-Muller in float64.

    torch's own `normal_` picks a vectorized path by CPU features, whose results may differ in
    the last bits between machines; uniform draws are produced serially by the generator, and
    float64 transcendental functions are accurate to an ulp, far below float32/bf16 rounding,
    so these samples are the same on any machine (not just on the same one).
    """
    import torch

    n = math.prod(shape)
    half = (n + 1) // 2
    u = torch.empty(2 * half, dtype=torch.float64).uniform_(generator=g)
    radius = torch.sqrt(-2.0 * torch.log1p(-u[:half]))  # 1 - u in (0, 1]
    angle = (2.0 * math.pi) * u[half:]
    z = torch.cat((radius * torch.cos(angle), radius * torch.sin(angle)))[:n]
    return (z * std).to(torch.float32).reshape(shape)


def build_weights(cfg: dict[str, Any] = DEMO_CONFIG, seed: int = DEMO_SEED) -> dict[str, Any]:
    """Random bfloat16 weights in Hugging Face names: float32 values from a seeded generator,
    drawn in the fixed order of `hf_tensor_specs`, then rounded to bfloat16."""
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    std = {"linear": 0.02, "router": 0.1, "embed": 0.05, "norm": 0.05, "conv": 0.2}
    out: dict[str, torch.Tensor] = {}
    for name, shape, init in hf_tensor_specs(cfg):
        if init in std:
            t = _normal(shape, std[init], g)  # norms are applied as (1 + weight)
        elif init == "a_log":
            u = torch.empty(shape, dtype=torch.float64).uniform_(generator=g)
            t = torch.log(1.0 + 15.0 * u).to(torch.float32)  # log(uniform(1, 16))
        elif init in ("ones", "dt_bias"):
            t = torch.ones(shape, dtype=torch.float32)
        else:  # pragma: no cover - hf_tensor_specs only yields the kinds above
            raise AssertionError(init)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


# -------------------------------------------------------------------------------- generation
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def _single_thread():
    """Run torch on one CPU thread: the demo's tensors are small, and waking a thread pool for
    each small op costs far more than the op (10x slower generation on a 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_tokenizer_files(dst: str | Path) -> Path:
    """Write only the demo's tokenizer.json, tokenizer_config.json and generation_config.json."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(dst / "tokenizer.json"), pretty=True)
    _write_json(dst / "tokenizer_config.json", tokenizer_config())
    _write_json(dst / "generation_config.json", generation_config())
    return dst


def write_demo_checkpoint(dst: str | Path) -> Path:
    """Write the demo checkpoint's files into `dst` (created if needed; existing files replaced)."""
    import torch
    from safetensors.torch import save_file

    import ft
    from ft.tools.quantize import DEFAULT_EXCLUDE, quantize_state_dict, write_quant_config

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    write_tokenizer_files(dst)
    with _single_thread():
        state = build_weights(DEMO_CONFIG, DEMO_SEED)
        # Quantize float32 copies of the bfloat16 values: the result is bit-identical (every
        # bf16 value is exact in float32, and the quantizer computes in float32), and CPU
        # reductions over 16-element blocks run faster in float32 than in bf16.
        quantized, excluded = quantize_state_dict(
            {k: v.float() for k, v in state.items()}, exclude=DEFAULT_EXCLUDE
        )
        tensors = {}
        for name, t in sorted(quantized.items()):
            if name in state and t.dtype == torch.float32:  # passed through unquantized
                t = state[name]
            tensors[name] = t.contiguous()
        del state, quantized
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})

    quant_cfg = write_quant_config(dst, sorted(excluded), producer_version=f"freetoken-{ft.__version__}")
    config = dict(DEMO_CONFIG)
    config["quantization_config"] = quant_cfg
    _write_json(dst / "config.json", config)
    return dst


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED_FILES)


def default_cache_dir() -> Path:
    """`$FT_CACHE_DIR`, else `~/.cache/freetoken`."""
    env = os.environ.get("FT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "freetoken"


def ensure_demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Directory of the demo checkpoint under `cache_dir` (default: `default_cache_dir()`),
    generated on first use. Safe when several processes race: each builds a private temporary
    copy and renames it into place atomically; the losers discard theirs."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = base / DEMO_DIRNAME
    if _is_complete(final):
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIRNAME}.tmp-", dir=base))
    try:
        write_demo_checkpoint(tmp)
        # mkdtemp (and safetensors) make private files; the cache is an ordinary folder.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o644)
        for attempt in range(2):
            try:
                os.rename(tmp, final)  # atomic; fails when `final` exists and is not empty
                return final
            except OSError:
                if _is_complete(final):  # another process won the race
                    return final
                if attempt == 1 or not final.exists():
                    raise
                # A broken leftover (interrupted by hand, files deleted): move it aside, retry.
                stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIRNAME}.stale-", dir=base))
                try:
                    os.rename(final, stale / "old")
                except OSError:
                    if _is_complete(final):
                        return final
                    raise
                finally:
                    shutil.rmtree(stale, ignore_errors=True)
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
