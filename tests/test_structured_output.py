"""Structured output (response_format) and tool calls (issue 17, item 2): the grammar engine's
bitmask in the sampler, the tool-call parser and stream, and end to end on a real `ft serve` of the
tiny checkpoint (its weights are random: valid JSON comes from the grammar, not from the model)."""

from __future__ import annotations

import json

import pytest
import torch
from server_proc import SERVE_MODEL, ServerProcess

from ft.engine.text.grammar import GrammarCompiler, json_schema_spec, mask_words
from ft.engine.sampling.sampler import GrammarMask, SamplingBatch, sample
from ft.engine.base.sampling_params import SamplingParams
from ft.errors import RequestError
from ft.server.tool_calls import ToolCallStream, parse_tool_calls, tool_call_grammar
from ft.tools.demo import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, build_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


def valid(obj) -> bool:
    """obj satisfies SCHEMA (checked by hand: no jsonschema dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "ok", "n"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 8 and isinstance(obj["ok"], bool) and type(obj["n"]) is int and 0 <= obj["n"] <= 99)


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_tokenizer().to_str(), VOCAB_SIZE, [IM_END_ID, ENDOFTEXT_ID])


# ----------------------------------------------------------------------------- grammar + sampler
def _allowed(row: torch.Tensor) -> list[int]:
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:VOCAB_SIZE]
    return bits.nonzero().flatten().tolist()


def test_matcher_masks_and_completes(compiler):
    m = compiler.matcher(json_schema_spec({"type": "object", "properties": {"a": {"enum": ["x"]}},
                                           "required": ["a"], "additionalProperties": False}))
    tok = build_tokenizer()
    row = torch.zeros(mask_words(VOCAB_SIZE), dtype=torch.int32)
    m.fill(row)
    first = {tok.decode([t]) for t in _allowed(row)}
    assert first and all('{"a":"x"}'.startswith(s) for s in first)  # only prefixes of the one valid text
    assert IM_END_ID not in _allowed(row)  # no EOS before the grammar accepts
    for t in tok.encode('{"a":"x"}').ids:
        assert not m.done
        assert m.accept(t)
    assert m.done and m.accepting
    m.fill(row)
    assert _allowed(row) == sorted([ENDOFTEXT_ID, IM_END_ID])  # only the end now


def test_bad_schema_is_a_request_error(compiler):
    with pytest.raises(RequestError, match="foo"):
        compiler.matcher(json_schema_spec({"type": "foo"}))
    with pytest.raises(RequestError):
        compiler.matcher(("lark", "start: undefined_rule"))


@pytest.mark.parametrize("greedy", [True, False])
def test_grammar_mask_leaves_other_rows_bitwise_unchanged(greedy):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB_SIZE, generator=g)
    allowed = [5, 77, 300]
    bitmask = torch.zeros(1, mask_words(VOCAB_SIZE), dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    p = SamplingParams(temperature=0.0 if greedy else 0.8)
    rows = [(p, 11 + i, 3) for i in range(4)]
    plain = SamplingBatch.build(rows, "cpu")
    masked = SamplingBatch.build(rows, "cpu")
    masked.grammar = GrammarMask(torch.tensor([2]), bitmask)
    before = logits.clone()
    a, b = sample(logits, plain), sample(logits, masked)
    assert torch.equal(logits, before)  # raw logits untouched (logprobs read them)
    assert int(b[2]) in allowed and int(a[2]) not in allowed  # the mask decides row 2
    assert torch.equal(a[[0, 1, 3]], b[[0, 1, 3]])  # the others: the same tokens
    from ft.engine.sampling.sampler import process_logits

    out = process_logits(logits, masked)
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])  # bitwise
    keep = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    keep[allowed] = True
    assert torch.equal(out[2][keep], logits[2][keep]) and torch.isinf(out[2][~keep]).all()


# ----------------------------------------------------------------------------- tool-call parsing
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_parse_one_several_and_malformed():
    content, calls = parse_tool_calls(CALL)
    assert content is None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL2 + "\n")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    for bad in ['<tool_call>\n{"name": "f", "arguments": {\n</tool_call>', '<tool_call>\n[1, 2]\n</tool_call>',
                '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "f"', "no calls at all"]:
        assert parse_tool_calls(bad) == (bad, [])
    # a malformed block beside a good one stays in the content
    bad = '<tool_call>\nnot json\n</tool_call>'
    content, calls = parse_tool_calls(bad + CALL)
    assert content == bad and len(calls) == 1


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_splits_content_and_calls(step):
    text = "Sure <tool_call" + "> no" + " " + CALL + "\n" + CALL2 + "\n"  # a '<tool_call' that is not a block
    s = ToolCallStream()
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i : i + step])
    events += s.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "tool_call"]
    assert content == "Sure <tool_call> no "
    assert [c["index"] for c in calls] == [0, 1] and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    s = ToolCallStream()  # an unfinished block comes back as content at the end
    assert s.feed("a <tool_call>\n{") == [("content", "a ")]
    assert s.finish() == [("content", "<tool_call>\n{")]


def test_tool_call_grammar_accepts_only_calls(compiler):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
        {"type": "function", "function": {"name": "noop"}}]
    tok = build_tokenizer()
    for grammar, text, ok in [(tool_call_grammar(tools), '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>', True),
                              (tool_call_grammar(tools, "noop"), '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>', False),
                              (tool_call_grammar(tools, parallel=False), '<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>', True),
                              (tool_call_grammar(tools), 'hello', False)]:
        m = compiler.matcher(("lark", grammar))
        accepted = all(m.accept(t) for t in tok.encode(text).ids)
        assert accepted == ok and (not ok or m.accepting)
    with pytest.raises(ValueError, match="nope"):
        tool_call_grammar(tools, "nope")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def server(serve_checkpoint):
    srv = ServerProcess("--model", str(serve_checkpoint), "--max-running-requests", "4", "--num-tokens", "4096",
                        "--moe-cache-size", "8", "--allow-client-chat-template")
    yield srv
    srv.stop()


CHAT = {"model": SERVE_MODEL, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 120, "temperature": 0}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def _parses(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def test_json_schema_output_validates_and_plain_does_not(server):
    r = server.post("/v1/chat/completions", json={**CHAT, "response_format": FORMAT})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert valid(json.loads(choice["message"]["content"])), choice
    assert choice["finish_reason"] == "stop"  # the grammar completed, and ended the sequence
    plain = server.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert not valid(_parses(plain))  # the model alone says nothing of the kind
    # sampled, several choices, streamed, on /v1/completions too
    r = server.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": "JSON:", "max_tokens": 120,
                                             "temperature": 1.0, "seed": 3, "n": 3, "response_format": FORMAT})
    assert r.status_code == 200, r.text
    assert all(valid(json.loads(c["text"])) for c in r.json()["choices"])
    r = server.post("/v1/chat/completions", json={**CHAT, "response_format": FORMAT, "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert valid(json.loads("".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])))


def test_json_object(server):
    r = server.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}, "max_tokens": 200,
                                                  "temperature": 0.7, "seed": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "foo"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "extra": 1}}, "extra"),
    ({"type": "yaml"}, "response_format"),
])
def test_bad_response_format_is_a_400(server, fmt, needle):
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": SERVE_MODEL, "prompt": "x"})):
        r = server.post(path, json={**base, "response_format": fmt})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


def test_tool_choice_required_returns_tool_calls(server):
    history = [{"role": "user", "content": "add 1 and 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"},
               {"role": "user", "content": "again"}]
    body = {**CHAT, "messages": history, "tools": TOOLS, "max_tokens": 200}
    for choice_ in ("required", {"type": "function", "function": {"name": "add"}}):
        r = server.post("/v1/chat/completions", json={**body, "tool_choice": choice_, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        fn = calls[0]["function"]
        args = json.loads(fn["arguments"])
        if isinstance(choice_, dict):
            assert fn["name"] == "add"
        assert fn["name"] in ("add", "now") and (set(args) == {"a", "b"} if fn["name"] == "add" else args == {})
    # streamed: the call arrives as a delta.tool_calls chunk
    r = server.post("/v1/chat/completions", json={**body, "tool_choice": "required", "parallel_tool_calls": False,
                                                  "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] in ("add", "now")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # auto: the tiny model's random text holds no call: plain content, finish "stop" or "length"
    r = server.post("/v1/chat/completions", json={**body, "tool_choice": "auto", "max_tokens": 8})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"


def test_tools_reach_the_chat_template(server):
    template = ("{% if not tools or tools[0].function.name != 'add' %}{{ raise_exception('no tools') }}{% endif %}"
                "{{ tools[0].function.description }}")
    body = {**CHAT, "max_tokens": 1, "chat_template_kwargs": {"chat_template": template}}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "no tools" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", json={**body, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(build_tokenizer().encode("Add two numbers").ids)


@pytest.mark.parametrize("extra,needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(server, extra, needle):
    r = server.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_tool_calls_in_the_response_from_a_stubbed_generation():
    """The response building of /v1/chat/completions on a generation whose text is a tool call."""
    from ft.server.generation import Generation
    from ft.server.openai_routes import _ChatShape, _Choice

    shape = _ChatShape("chatcmpl-x", SERVE_MODEL, None, None, parse_tools=True)
    gen = Generation(prompt_tokens=3, text="ok " + CALL, finish_reason="stop")
    body = shape.full([_Choice(0, None, gen)], {"prompt_tokens": 3})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    c = _Choice(0, None, Generation(prompt_tokens=3, finish_reason="stop"))
    chunks = []
    for piece in ("ok ", CALL[:20], CALL[20:]):
        out = shape.delta(c, piece, [])
        chunks += out if isinstance(out, list) else [out]
    final = shape.final(c)
    chunks += final if isinstance(final, list) else [final]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"content": "ok "} and deltas[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    shape = _ChatShape("chatcmpl-x", SERVE_MODEL, None, None, parse_tools=False)  # tool_choice "none"
    body = shape.full([_Choice(0, None, Generation(prompt_tokens=3, text=CALL, finish_reason="stop"))], {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL}


def test_a_tokenizer_the_grammar_engine_refuses_is_a_request_error_for_every_grammar_request(monkeypatch):
    """A tokenizer with more tokens than the model's vocabulary (a tiny model served with a real tokenizer): the
    grammar engine refuses it, and a request with a grammar gets a RequestError that says structured output is not
    available here (a 400, not an internal error: session 60 saw a 500); the refusal is kept, not retried at each
    request; a request without a grammar is served as ever."""
    from types import SimpleNamespace

    import ft.engine.text.grammar as grammar
    from ft.engine.core.request_builder import RequestBuilder
    from ft.engine.text.tokenizer import Tokenizer

    built = []
    real = grammar.GrammarCompiler
    monkeypatch.setattr(grammar, "GrammarCompiler", lambda *a: built.append(1) or real(*a))
    model = SimpleNamespace(vocab_size=VOCAB_SIZE // 2, eos_token_ids=[IM_END_ID % (VOCAB_SIZE // 2)])
    builder = RequestBuilder(model, Tokenizer(build_tokenizer()))
    params = SamplingParams(max_new_tokens=4, grammar=json_schema_spec(SCHEMA))
    for _ in range(2):
        with pytest.raises(RequestError, match="structured output is not available on this server"):
            builder.build([1, 2, 3], params, None, 64, str)
    assert built == [1]
    seq = builder.build([1, 2, 3], SamplingParams(max_new_tokens=4), None, 64, str)
    assert seq.grammar is None
