"""The utility routes on the demo model, in process: /tokenize, /detokenize, /version,
/v1/models/{id}; their auth, their 4xx answers, and /tokenize agreeing with what the generation
routes count."""

from __future__ import annotations

import threading

import pytest
from inproc_server import API_KEY, AUTH, DEMO, complete, demo_app
from server_proc import WAIT_S

import ft
from ft.server.util_routes import git_rev


@pytest.fixture(scope="module")
def app():
    with demo_app() as (client, state):
        yield client, state


def error_of(r, status: int) -> str:
    """The message of an error answer in the server's shape, after checking its status."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == status
    return err["message"]


# --------------------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_prompt_counts_what_a_completion_counts(app):
    client, state = app
    r = client.post("/tokenize", json={"model": DEMO, "prompt": "Hello there, tokenizer"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and all(isinstance(t, int) for t in body["tokens"])
    assert body["max_model_len"] == state.loop.engine.context_limit == 8192
    assert body["tokens"] == state.tokenizer.encode("Hello there, tokenizer")
    usage = complete(client, "Hello there, tokenizer", 1).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    assert "token_strs" not in body


def test_tokenize_messages_counts_what_a_chat_counts(app):
    client, _ = app
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with_prompt = client.post("/tokenize", json={"messages": messages, "return_token_strs": True}, headers=AUTH).json()
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False},
                          headers=AUTH).json()
    assert without["count"] < with_prompt["count"]
    assert with_prompt["tokens"][: without["count"]] == without["tokens"]
    assert len(with_prompt["token_strs"]) == with_prompt["count"] and "<|im_start|>" in with_prompt["token_strs"]
    chat = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": DEMO, "messages": messages, "max_tokens": 1, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == with_prompt["count"]


def test_detokenize_round_trips_tokenize(app):
    client, _ = app
    text = "<|im_start|>user\nHello, wörld!<|im_end|>"
    ids = client.post("/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]
    r = client.post("/detokenize", json={"model": DEMO, "tokens": ids}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}, headers=AUTH).json() == {"prompt": ""}


def test_detokenize_names_ids_outside_the_vocabulary(app):
    client, state = app
    vocab = state.tokenizer.vocab_size
    msg = error_of(client.post("/detokenize", json={"tokens": [5, vocab, -3, vocab + 7, vocab]}, headers=AUTH), 400)
    assert f"(0..{vocab - 1})" in msg and msg.endswith(f": -3, {vocab}, {vocab + 7}")  # each once, 5 not named
    many = error_of(client.post("/detokenize", json={"tokens": list(range(vocab, vocab + 25))}, headers=AUTH), 400)
    assert "and 15 more" in many


@pytest.mark.parametrize("path,body,status,needle", [
    ("/tokenize", {}, 400, "either `prompt`"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "not both"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": 12}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": "yes"}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, 400, "role"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "gpt-4"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                   "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "client chat templates are off"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                   "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs.messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                   "chat_template_kwargs": {"self": 1}}, 400, "chat_template_kwargs.self"),
    ("/v1/chat/completions", {"model": DEMO, "messages": [{"role": "user", "content": "b"}],
                              "chat_template_kwargs": {"self": 1}}, 400, "chat_template_kwargs.self"),
    ("/v1/chat/completions", {"model": DEMO, "messages": [{"role": "user", "content": "b"}],
                              "chat_template_kwargs": {"messages": [{"role": "user", "content": "x"}]}}, 400,
     "request's `messages`"),
    ("/v1/completions", {"model": DEMO, "prompt": ""}, 400, "prompt: Value error, the prompt is empty"),
    ("/v1/completions", {"model": DEMO, "prompt": ["a", ""]}, 400, "prompt 1 is empty"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": 5}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "gpt-4"),
])
def test_bad_bodies_are_4xx(app, path, body, status, needle):
    client, _ = app
    assert needle in error_of(client.post(path, json=body, headers=AUTH), status)


def test_the_openapi_schema_refuses_empty_prompts_as_validation_does(app):
    """Issue 41, item 8: the schema allowed what validation refuses (an empty prompt)."""
    client, _ = app
    prompt = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    alternatives = prompt["anyOf"]
    assert all(a.get("minLength") == 1 or a.get("minItems") == 1 for a in alternatives), alternatives


def test_the_openapi_document_lists_the_errors_the_routes_answer(app):
    """Issue 41, item 8: each error the server answers below is documented for its operation with the
    error shape; FastAPI's 422 validation shape appears nowhere; /metrics is Prometheus text and the
    event stream text/event-stream."""
    client, _ = app
    doc = client.get("/openapi.json").json()
    answered = [
        ("post", "/v1/completions", client.post("/v1/completions", json={"model": DEMO, "prompt": ""}, headers=AUTH)),
        ("post", "/v1/completions", client.post("/v1/completions", json={"model": "x", "prompt": "a"}, headers=AUTH)),
        ("post", "/v1/completions", client.post("/v1/completions", json={"model": DEMO, "prompt": "a"})),
        ("post", "/tokenize", client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}, headers=AUTH)),
        ("get", "/v1/models/{model_id}", client.get("/v1/models/nope", headers=AUTH)),
        ("post", "/admin/cache", client.post("/admin/cache", json={"kv": -1})),
        ("post", "/admin/cache", client.post("/admin/cache", json={"kv": 10**12})),
        ("get", "/admin/requests", client.get("/admin/requests?limit=0")),
        ("get", "/admin/events", client.get("/admin/events?interval=x")),
    ]
    for method, path, r in answered:
        assert r.status_code >= 400, (path, r.status_code)
        documented = doc["paths"][path][method]["responses"]
        assert str(r.status_code) in documented, (method, path, r.status_code, sorted(documented))
        assert documented[str(r.status_code)]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"}
    assert {r.status_code for _, _, r in answered} >= {400, 401, 404, 422}
    assert "422" not in doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert {"401", "503"} <= set(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        "text/plain; version=0.0.4; charset=utf-8"}
    assert "text/event-stream" in doc["paths"]["/admin/events"]["get"]["responses"]["200"]["content"]
    assert "503" in doc["paths"]["/health"]["get"]["responses"]


def test_malformed_json_is_400(app):
    client, _ = app
    r = client.post("/tokenize", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
    error_of(r, 400)


def test_a_template_error_is_400(app):
    client, state = app
    state.allow_client_chat_template = True
    try:
        r = client.post("/tokenize", headers=AUTH, json={
            "messages": [{"role": "user", "content": "b"}],
            "chat_template_kwargs": {"chat_template": "{{ raise_exception('no thanks') }}"}})
    finally:
        state.allow_client_chat_template = False
    assert "no thanks" in error_of(r, 400)


@pytest.mark.parametrize("method,path,body", [
    ("post", "/tokenize", {"prompt": "a"}),
    ("post", "/detokenize", {"tokens": [1]}),
    ("get", "/v1/models/" + DEMO, None),
])
def test_routes_need_the_api_key(app, method, path, body):
    client, _ = app
    kw = {"json": body} if body is not None else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = getattr(client, method)(path, headers=headers, **kw)
        assert r.json()["error"]["type"] == "authentication_error"
        error_of(r, 401)
    assert getattr(client, method)(path, headers=AUTH, **kw).status_code == 200


def test_the_key_is_checked_before_the_body(app):
    """An unauthenticated client learns nothing about its body: 401, not 400."""
    client, _ = app
    r = client.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    error_of(r, 401)


# --------------------------------------------------------------------------- /version, /v1/models/{id}
def test_version_answers_without_the_key(app):
    client, _ = app
    r = client.get("/version")
    assert r.status_code == 200
    body = r.json()
    assert body["version"] == ft.__version__
    assert set(body) >= {"version", "git_rev", "python", "torch"}
    assert body["git_rev"] is None or len(body["git_rev"]) == 40


def test_model_by_id_is_the_listed_model(app):
    client, _ = app
    listed = client.get("/v1/models", headers=AUTH).json()["data"]
    r = client.get(f"/v1/models/{DEMO}", headers=AUTH)
    assert r.status_code == 200 and [r.json()] == listed
    assert r.json()["object"] == "model"


@pytest.mark.parametrize("model_id", ["gpt-4", "org/ft-demo", "ft-demo-2"])
def test_unknown_model_id_is_404(app, model_id):
    client, _ = app
    r = client.get(f"/v1/models/{model_id}", headers=AUTH)
    assert model_id in error_of(r, 404) and r.json()["error"]["type"] == "model_not_found"


# --------------------------------------------------------------------------- while the engine starts
def test_tokenizer_routes_are_503_until_the_engine_is_up():
    from fastapi.testclient import TestClient

    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    release = threading.Event()

    def build():  # the engine never comes up: "starting" until released, then "failed"
        release.wait()
        raise RuntimeError("the test is over")

    loop = EngineLoop(build)
    client = TestClient(create_app(ServerState(loop, "m", api_key=API_KEY), start_loop=False))  # no lifespan
    loop.start()
    try:
        r = client.post("/tokenize", json={"prompt": "a"}, headers=AUTH)
        assert r.json()["error"]["type"] == "server_unavailable"
        error_of(r, 503)
        error_of(client.post("/detokenize", json={"tokens": [1]}, headers=AUTH), 503)
        error_of(client.post("/tokenize", json={"prompt": "a"}), 401)  # the key first, as on /v1
        assert client.get("/version").json()["version"] == ft.__version__
    finally:
        release.set()
        assert loop.ready.wait(WAIT_S) and loop.state == "failed"


# --------------------------------------------------------------------------- git_rev
def _git(root, head: str, refs: dict[str, str] | None = None, packed: str | None = None):
    git = root / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text(head + "\n")
    for ref, sha in (refs or {}).items():
        (git / ref).parent.mkdir(parents=True, exist_ok=True)
        (git / ref).write_text(sha + "\n")
    if packed is not None:
        (git / "packed-refs").write_text(packed)
    return git


SHA_A, SHA_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"


def test_git_rev_reads_loose_packed_and_detached_heads(tmp_path):
    _git(tmp_path / "loose", "ref: refs/heads/main", {"refs/heads/main": SHA_A})
    assert git_rev(tmp_path / "loose") == SHA_A
    _git(tmp_path / "packed", "ref: refs/heads/dev", packed=f"# pack-refs with: peeled\n{SHA_A} refs/heads/main\n"
                                                           f"{SHA_B} refs/heads/dev\n")
    assert git_rev(tmp_path / "packed") == SHA_B
    _git(tmp_path / "detached", SHA_B)
    assert git_rev(tmp_path / "detached") == SHA_B


def test_git_rev_follows_a_worktree_and_is_none_without_a_checkout(tmp_path):
    main = _git(tmp_path / "main", "ref: refs/heads/main", {"refs/heads/feature": SHA_B})
    wt_git = main / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/feature\n")
    (wt_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt_git}\n")
    assert git_rev(tmp_path / "wt") == SHA_B
    assert git_rev(tmp_path / "nothing") is None
    _git(tmp_path / "garbage", "not a sha")
    assert git_rev(tmp_path / "garbage") is None
    _git(tmp_path / "dangling", "ref: refs/heads/gone")
    assert git_rev(tmp_path / "dangling") is None


def test_a_wrong_method_names_every_method_of_the_path(app):
    """Issue 41, item 8: 405's Allow lists what every route of the path takes (GET and POST /admin/cache),
    not the first route's alone."""
    client, _ = app
    r = client.request("OPTIONS", "/admin/cache", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST" and r.json()["error"]["code"] == 405
    r = client.request("DELETE", "/v1/models", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_the_ladder_schema_names_the_steps_validation_takes(app):
    """Issue 41, item 8: `{"rung": ""}` was allowed by the schema (any string) and refused by validation."""
    client, _ = app
    rung = client.get("/openapi.json").json()["components"]["schemas"]["LadderRequest"]["properties"]["rung"]
    assert {"type": "string", "enum": ["up", "down"]} in rung["anyOf"], rung
    assert "'up' or 'down'" in error_of(client.post("/admin/ladder", json={"rung": ""}, headers=AUTH), 400)
