"""Tokenizer wrapper: loading, round trips, special tokens, chat templates, streaming decode."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from ft.tools.demo import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    write_tokenizer_files,
)
from ft.engine.text.detokenizer import OutputText
from ft.engine.text.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

# A template in the structure of Qwen3-Next-80B-A3B-Instruct's (Qwen3 2507 "instruct" family):
# tools in the system turn, a namespace scan for the last real user query, string/non-string
# content, assistant tool calls as <tool_call> JSON, tool results grouped into one user turn.
QWEN3_NEXT_STYLE_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. 0123456789 ~!@#$%^&*()_+{}|:\"<>?",
    "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF\n",
    "héllo wörld, naïve café, Ærøskøbing, ß, Ελληνικά, русский",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 math 𝔸𝔹ℂ",
    "\u0000control\u0007chars\u001b[0m and a lone U+FFFD \ufffd",
    "",
]

TWO_TURNS = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="module")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------ basics
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_vocab_and_special_tokens(tok):
    assert tok.vocab_size == 320
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID == 317
    assert tok.token_to_id("<|im_start|>") == IM_START_ID == 318
    assert tok.token_to_id("<|im_end|>") == IM_END_ID == 319
    for token, tid in (("<|endoftext|>", 317), ("<|im_start|>", 318), ("<|im_end|>", 319)):
        assert tok.encode(token) == [tid]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == IM_START_ID and IM_END_ID in ids
    assert tok.decode(ids) == "user\nHi\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.eos_token_ids == frozenset({IM_END_ID, ENDOFTEXT_ID})
    assert tok.special_token_ids == frozenset({317, 318, 319})
    assert tok.token_to_id("definitely-not-a-token") is None


def test_matches_transformers_tokenizer(demo_dir, tok):
    import transformers
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(demo_dir))
    for text in TEXTS[:-1] + ["<|im_start|>system\nBe brief.<|im_end|>\n"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    for conv, gen in ((TWO_TURNS, True), (TWO_TURNS[:2], False)):
        assert tok.apply_chat_template(conv, add_generation_prompt=gen) == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=gen
        )


# ----------------------------------------------------------------------- chat templates
def test_chatml_two_turns_exact(tok):
    expected = (
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
    )
    assert tok.apply_chat_template(TWO_TURNS, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(TWO_TURNS) == expected + "<|im_start|>assistant\n"
    with_system = [{"role": "system", "content": "Be brief."}] + TWO_TURNS[:1]
    assert tok.apply_chat_template(with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(TWO_TURNS)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 3
    assert tok.decode(ids, skip_special_tokens=False) == expected + "<|im_start|>assistant\n"


def test_demo_template_content_parts_tools_and_errors(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, False) == "<|im_start|>user\nab<|im_end|>\n"
    tool = [{"role": "tool", "content": "42"}]
    assert tok.apply_chat_template(tool, False) == (
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    )
    # content=None is dropped like transformers does; the template renders it as empty
    assert tok.apply_chat_template([{"role": "assistant", "content": None}], False) == (
        "<|im_start|>assistant\n<|im_end|>\n"
    )
    with pytest.raises(ChatTemplateError, match="unsupported chat role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_qwen3_next_template_with_system(tok):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    out = tok.apply_chat_template(messages, chat_template=QWEN3_NEXT_STYLE_TEMPLATE)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_next_template_tools_match_transformers(tmp_path, demo_dir):
    import transformers
    d = _copy_dir(demo_dir, tmp_path / "qwen")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_NEXT_STYLE_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather — in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]
    messages = [
        {"role": "system", "content": "You are Qwen."},
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "content": "12°C"},
        {"role": "tool", "content": "15°C"},
        {"role": "assistant", "content": "Zürich 12°C, Paris 15°C."},
    ]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)
        theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    assert '"description": "Current weather — in °C"' in ours  # tojson keeps non-ASCII
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in ours
    assert "<|im_start|>user\n<tool_response>\n12°C\n</tool_response>\n<tool_response>\n15°C" in ours


def test_template_globals_and_sandbox(tok):
    t = "{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|{{ tools }}|{{ flag }}"
    assert tok.apply_chat_template([], chat_template=t, flag=7) == "False|<|im_end|>|<|endoftext|>|True|None|7"
    year = tok.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}")
    assert year.isdigit() and len(year) == 4
    with pytest.raises(ChatTemplateError, match="boom"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{% set ns = namespace(a=1) %}{% set ns._x = 2 %}{{ 1 }}")
    with pytest.raises(ChatTemplateError):  # immutable: no list.append
        tok.apply_chat_template([], chat_template="{% set l = [] %}{{ l.append(1) }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([], chat_template="{% if %}")
    gen = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert tok.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=gen) == "x"


# ------------------------------------------------------------------------ loading files
def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_malformed_files(tmp_path, demo_dir):
    d = _copy_dir(demo_dir, tmp_path / "bad")
    (d / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    shutil.copy(demo_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


def test_no_chat_template(tmp_path, demo_dir):
    d = tmp_path / "plain"
    d.mkdir()
    shutil.copy(demo_dir / "tokenizer.json", d / "tokenizer.json")
    tok = Tokenizer.from_dir(d)  # tokenizer_config.json and generation_config.json are optional
    assert tok.chat_template is None and tok.eos_token_ids == frozenset()
    assert tok.decode(tok.encode("ok")) == "ok"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sources_and_eos_sources(tmp_path, demo_dir):
    d = _copy_dir(demo_dir, tmp_path / "named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert tok.apply_chat_template([], tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template([], chat_template="tool_use", tools=[]) == "T0"
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        tok.apply_chat_template([], chat_template="missing")
    assert tok.eos_token_ids == frozenset({IM_END_ID, 5})

    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")  # the file wins
    (d / "generation_config.json").unlink()
    (d / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))  # fallback source
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "y"}]) == "Jy"
    assert tok.eos_token_ids == frozenset({IM_END_ID, 7, 8})


# -------------------------------------------------------------------------- streaming
STREAM_TEXTS = [
    "héllo wörld 你好，世界 🎉👍🏽 👨‍👩‍👧‍👦 𝔸𝔹 done.",
    "Plain ASCII only, with numbers 12345.",
    "日本語🇯🇵",
]


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "offsets"])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder_matches_decode(tok, text, use_stream):
    ids = tok.encode(text)
    # the byte-level tokenizer splits these multi-byte characters over several tokens
    assert len(ids) > len(text.encode("utf-8")) // 3
    dec = IncrementalDecoder(tok, use_decode_stream=use_stream)
    pieces = [dec.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.finish() == tok.decode(ids) == text
    assert sum(1 for p in pieces if p == "") > 0 or text.isascii()


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "offsets"])
def test_incremental_decoder_specials_prompt_and_truncation(tok, use_stream):
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    reply = tok.encode("Sure — ✓") + [IM_END_ID]
    dec = tok.incremental_decoder(prompt_ids=prompt) if use_stream else IncrementalDecoder(
        tok, prompt_ids=prompt, use_decode_stream=False
    )
    text = dec.feed(reply) + dec.finish()
    assert text == tok.decode(reply) == "Sure — ✓"
    assert dec.generated_ids == reply

    dec = IncrementalDecoder(tok, skip_special_tokens=False, use_decode_stream=use_stream)
    assert dec.feed(reply) + dec.finish() == "Sure — ✓<|im_end|>"

    # a stream cut inside a character: finish() returns what decode() gives for the leftovers
    cut = tok.encode("ab🎉")[:-1]
    dec = IncrementalDecoder(tok, use_decode_stream=use_stream)
    streamed = dec.feed(cut)
    assert "\ufffd" not in streamed
    assert streamed + dec.finish() == tok.decode(cut)
    assert dec.finish() == ""


# ------------------------------------------------------------ the engine's output text
def _before(tok, ids, stops):
    """Reference: the per-token text deltas of the former code, which re-decoded everything each
    token (the engine looked for stop strings in decode(output), the server sent the decoded text
    minus an incomplete character and minus max(len(stop)) - 1 held characters). Returns
    (deltas, number of tokens consumed, stop_text)."""
    hold = max((len(s) for s in stops), default=1) - 1
    emitted, deltas = "", []
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        stop_text = text[:cut] if cut >= 0 else None
        if cut >= 0 or n == len(ids):
            final = stop_text if stop_text is not None else text
            deltas.append(final[len(emitted):])
            return deltas, n, stop_text
        full = text.rstrip("\ufffd")
        target = full[: max(0, len(full) - hold)]
        ok = target.startswith(emitted)
        deltas.append(target[len(emitted):] if ok else "")
        emitted = target if ok else emitted
    return deltas, 0, None


def _after(tok, ids, stops, use_stream):
    """The same through OutputText, as the engine drives it."""
    text = OutputText(IncrementalDecoder(tok, use_decode_stream=use_stream), stops)
    deltas, stop_text = [], None
    for n, i in enumerate(ids, 1):
        text.step(i)
        if text.stop_found:
            stop_text = text.cut()
        elif n == len(ids):
            text.finish()
        deltas.append(text.delta)
        if stop_text is not None:
            break
    return deltas, len(deltas), stop_text


def _stop_cases(tok):
    rng = random.Random(0)
    for text in STREAM_TEXTS + TEXTS[:-1]:
        ids = tok.encode(text)
        yield ids, ()
        yield ids, ("definitely absent",)
        yield ids, ("",)
        for _ in range(6):
            a = rng.randrange(len(text))
            stop = text[a : a + rng.randint(1, 5)]
            yield ids, (stop,)
            yield ids, (stop, text[rng.randrange(len(text)):][:3], "zzz")


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "offsets"])
def test_output_text_matches_former_decoding(tok, use_stream):
    cases = list(_stop_cases(tok))
    assert sum(1 for ids, stops in cases if _before(tok, ids, stops)[2]) > 50  # most cases stop
    for ids, stops in cases:
        assert _after(tok, ids, stops, use_stream) == _before(tok, ids, stops), (tok.decode(ids), stops)


def test_stop_string_split_across_tokens(tok):
    text = "héllo wörld 你好，世界 🎉 done"
    ids = tok.encode(text)
    for stop in ("世界", "界 🎉", "🎉", "wör", "o w"):
        # the stop string's bytes span several tokens: the text is cut where a full decode cuts it
        first = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
        assert len(tok.encode(stop)) > 1
        deltas, n, stop_text = _after(tok, ids, (stop,), True)
        assert n == first and stop_text == text[: text.index(stop)] == "".join(deltas)


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "offsets"])
def test_output_text_random_byte_tokens(tok, use_stream):
    """Random ids (invalid UTF-8 included): the released text adds up to decode(ids)."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(0, ENDOFTEXT_ID) for _ in range(rng.randrange(1, 40))]
        out = OutputText(IncrementalDecoder(tok, use_decode_stream=use_stream))
        streamed = "".join(out.step(i) for i in ids)
        assert streamed + out.finish() == out.text == tok.decode(ids)
        assert out.finish() == "" and out.done


def test_long_texts_encode_like_short_ones():
    """Texts over 16K characters take encode_batch (it releases the GIL): the same ids."""
    from ft.engine.text.tokenizer import Tokenizer
    from ft.tools.demo import write_tokenizer_files

    import tempfile
    from pathlib import Path

    tok = Tokenizer.from_dir(write_tokenizer_files(Path(tempfile.mkdtemp()) / "t"))
    text = "Hello, <|im_start|>world! " * 2000
    assert len(text) > 16384 and tok.encode(text) == tok.backend.encode(text).ids
