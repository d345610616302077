"""The OpenAI fields of issue 17 end to end on a real `ft serve` (the small checkpoint of
server_proc.py: the demo's layout and tokenizer): logprobs in both formats, streamed and not, parsed
by the official client; echo with prompt logprobs (lm-eval's loglikelihood request); n choices;
logit_bias and stop_token_ids; every unimplemented field refused with a 400 that names it."""

from __future__ import annotations

import json

import openai
import pytest
from server_proc import SERVE_MODEL, ServerProcess

from ft.tools.demo import ENDOFTEXT_ID, IM_END_ID, IM_START_ID

MODEL = SERVE_MODEL
NO_SPECIALS = {str(i): -100 for i in (ENDOFTEXT_ID, IM_START_ID, IM_END_ID)}  # their text is not in `content`


@pytest.fixture(scope="module")
def server(serve_checkpoint):
    srv = ServerProcess("--model", str(serve_checkpoint), "--max-running-requests", "8", "--num-tokens", "4096",
                        "--moe-cache-size", "8")
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def events(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer ([DONE] last, checked)."""
    r = server.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [x[len("data: "):] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_completion_logprobs(server, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value <= 0  # (part-character tokens have keys of their own)
        assert value == max(top.values())  # greedy: the best token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[-1] <= len(r.choices[0].text)
    # the stream carries the same tokens and values, chunk by chunk
    chunks = events(server, "/v1/completions", {**{k: v for k, v in kw.items() if k != "extra_body"},
                                                 "ignore_eos": True})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert all(len(p["tokens"]) == 1 for p in parts)  # a chunk per token, with or without text yet
    assert sum((p["tokens"] for p in parts), []) == lp.tokens
    assert sum((p["token_logprobs"] for p in parts), []) == lp.token_logprobs
    assert sum((p["text_offset"] for p in parts), []) == lp.text_offset
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == r.choices[0].text
    # sampled: the drawn token is in its top_logprobs even when it is not among the best
    drawn = client.completions.create(**{**kw, "temperature": 1.5, "seed": 3, "logprobs": 1, "max_tokens": 12})
    lp = drawn.choices[0].logprobs
    assert all(top[token] == value for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)
    # no logprobs asked: none sent
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs(server, client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2, logit_bias=NO_SPECIALS, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        try:
            assert bytes(item.bytes).decode("utf-8") == item.token
        except UnicodeDecodeError:  # part of a character
            assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob <= 0
        assert item.top_logprobs[0].token == item.token
    assert b"".join(bytes(i.bytes) for i in content).decode("utf-8", errors="replace") == r.choices[0].message.content
    stream = client.chat.completions.create(**kw, stream=True)
    items = [i for c in stream if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob, i.bytes) for i in items] == [(i.token, i.logprob, i.bytes) for i in content]
    # logprobs without top_logprobs: each token's own only
    bare = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert [i.top_logprobs for i in bare.choices[0].logprobs.content] == [[]] * 8
    assert [i.logprob for i in bare.choices[0].logprobs.content] == [i.logprob for i in content]


def test_echo_prompt_logprobs_as_lm_eval_asks(server, client):
    """echo + logprobs + max_tokens 0 returns the prompt alone with its logprobs (the first token's
    null); they agree with the logprob the sampling path reports for the same token."""
    prompt = "The quick brown fox jumps"
    ids = server.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    # lm-eval sends token ids as a list of one list: same answer
    raw = server.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 0, "echo": True,
                                               "logprobs": 1}).json()
    assert raw["choices"][0]["logprobs"]["token_logprobs"] == lp.token_logprobs
    # the last prompt token, drawn instead by the sampling path (forced by a bias, which raw logprobs ignore)
    forced = client.completions.create(model=MODEL, prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(ids[-1]): 100})
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[-1], abs=1e-4)
    # with generated tokens too: the prompt's part is the same, then the completion's
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert more.text.startswith(prompt) and len(more.logprobs.tokens) == len(ids) + 3
    assert more.logprobs.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # streamed: the prompt (with its logprobs) first, then the end
    chunks = events(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                                "logprobs": 1})
    texts = [ch["choices"][0]["text"] for ch in chunks]
    assert texts == [prompt, ""] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp.token_logprobs
    # max_tokens 0 without echo is still refused
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_n_choices(server, client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    # choice i draws with seed + i
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text
    assert r.choices[1].text == client.completions.create(**{**kw, "seed": 8}).choices[0].text
    assert r.choices[0].text != r.choices[1].text
    # streamed: both indices interleaved, each adding up to its text
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True}}
    chunks = events(server, "/v1/completions", body)
    texts, finished = {0: "", 1: ""}, {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finished[c["index"]] = c["finish_reason"]
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text} and finished == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=2)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert client.completions.create(**kw, n=2, best_of=2).choices[1].text == r.choices[1].text


def test_a_list_of_prompts(server, client):
    """Several prompts in one /v1/completions request (the legacy API's batch; lm-eval sends token-id
    lists this way): choice index = prompt index * n + j, each choice equal to that prompt alone;
    usage counts each prompt once; echo and prompt logprobs follow each choice's own prompt."""
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["Once upon a time", "The quick brown fox", "Hi"]
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 12
    # n per prompt: index p * n + j; sampled with a seed, choice j of each prompt draws with seed + j
    sk = dict(model=MODEL, max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    r2 = client.completions.create(prompt=prompts[:2], n=2, **sk)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    for i, c in enumerate(r2.choices):
        one = client.completions.create(prompt=prompts[i // 2], **{**sk, "seed": 3 + i % 2}).choices[0]
        assert c.text == one.text, i
    # token-id prompts with echo + logprobs: each choice echoes its own prompt
    ids = [server.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts[:2]]
    raw = server.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True,
                                               "logprobs": 1})
    assert raw.status_code == 200, raw.text
    got = raw.json()["choices"]
    assert [c["text"] for c in got] == prompts[:2]
    for c, p in zip(got, ids):
        assert len(c["logprobs"]["tokens"]) == len(p) and c["logprobs"]["token_logprobs"][0] is None
    # streamed: the chunks carry each prompt's index
    chunks = events(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True})
    texts = {0: "", 1: "", 2: ""}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}
    # an empty prompt in the list is named; too many choices refused
    bad = server.post("/v1/completions", json={"model": MODEL, "prompt": ["a", ""], "max_tokens": 1})
    assert bad.status_code == 400 and "prompt 1" in bad.json()["error"]["message"]
    many = server.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 65, "n": 2, "max_tokens": 1})
    assert many.status_code == 400 and "choices" in many.json()["error"]["message"]


def test_logit_bias_and_stop_token_ids(server, client):
    forced = server.post("/detokenize", json={"tokens": [42]}).json()["prompt"]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [forced] * 4
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.9, seed=1,
                                  logit_bias={"42": 100}, extra_body={"stop_token_ids": [42]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    # penalties are accepted and used (the repeated token gets pushed away)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=0,
                                  logit_bias={"42": 3}, frequency_penalty=2.0, presence_penalty=2.0,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.1})
    assert r.choices[0].logprobs.tokens != [forced] * 4


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
FN = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("route,extra,needle", [
    ("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("completion", {"response_format": {"type": "grammar"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "x": 1}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": FN, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "image_url"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input_audio"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"best_of": 2}, "best_of"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("completion", {"suffix": "tail"}, "suffix"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"best_of": 3, "n": 2}, "best_of"),
    ("completion", {"top_logprobs": 2}, "top_logprobs"),
    ("completion", {"logit_bias": {"320": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completion", {"stop_token_ids": [99999]}, "stop_token_ids"),
    ("completion", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completion", {"min_p": 1.5}, "min_p"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"n": 129}, "n"),
])
def test_unimplemented_fields_are_refused_by_name(server, route, extra, needle):
    path, base = ("/v1/chat/completions", CHAT) if route == "chat" else ("/v1/completions", COMPLETION)
    r = server.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400


@pytest.mark.parametrize("extra", [
    {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
    {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "modalities": ["text"]},
    {"stream_options": {"include_usage": True}, "stream": False, "presence_penalty": None},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
], ids=["harmless-extras", "neutral-values", "nulls", "text-parts"])
def test_harmless_fields_are_accepted(server, extra):
    r = server.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text


def test_an_empty_stop_string_is_a_400_in_either_form(server):
    """`stop: ""` ended every generation at its first token, and `stop: ["", "a"]` dropped the empty one unsaid:
    both are refused now, by name, and the request loses nothing else (a next one with a real stop string runs)."""
    for stop in ("", ["", "a"]):
        for route, body in (("/v1/completions", {"prompt": "Hello"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
            r = server.post(route, json={"model": MODEL, "max_tokens": 3, "stop": stop, **body})
            assert r.status_code == 400, (route, stop, r.text)
            assert "stop: an empty string" in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stop": ["a"]})
    assert r.status_code == 200, r.text


def test_chat_max_completion_tokens_and_max_tokens_name_themselves(server):
    """Chat's max_completion_tokens (and max_tokens, its older name): a refusal names the field the request gave
    (not completions' echo note), and the two given apart must agree."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    r = server.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_completion_tokens must be at least 1, got 0"
    r = server.post("/v1/chat/completions", json={**chat, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be at least 1, got 0"
    r = server.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "max_completion_tokens": 3})
    assert r.status_code == 400 and "max_completion_tokens (3) and max_tokens (2) differ" in r.text
    r = server.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "max_completion_tokens": 2,
                                                  "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_message_without_content_is_a_400_unless_an_assistant_calls_tools(server):
    """A user (system, developer, tool) message with content null or left out was served as an empty message: a
    400 names the message now; an assistant message may leave it out (its tool calls carry it)."""
    for message in ({"role": "user", "content": None}, {"role": "system"}, {"role": "tool", "tool_call_id": "a"}):
        r = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            message, {"role": "user", "content": "Hello"}]})
        assert r.status_code == 400 and f"a {message['role']} message needs content" in r.text, r.text
    r = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]})
    assert r.status_code == 200, r.text
