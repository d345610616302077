"""A real client end to end: EleutherAI's lm-evaluation-harness (`lm-eval run`, in a subprocess)
against a real `ft serve` of the small checkpoint (server_proc.py). Two tasks written here, on data
files written here (nothing is downloaded: HF_*_OFFLINE, the tokenizer is the served checkpoint's
folder): a multiple-choice loglikelihood task through `local-completions` (echo + logprobs on
/v1/completions) and a generate-until task, through `local-completions` and through
`local-chat-completions` with the chat template. The numbers lm-eval reports are checked against
what the server answers for the same token ids, so wrong or missing logprobs fail here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import SERVE_MODEL, ServerProcess
from tokenizers import Tokenizer

LM_EVAL_TIMEOUT_S = 300  # one run takes ~10 s here; generous for a loaded machine
MAX_GEN_TOKS = 6

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which one is a colour?", "choices": ["table", "seven", "green"], "answer": 2},
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Say hello.", "answer": "hello"},
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "Name a fruit.", "answer": "apple"},
]
MC_PROMPT = "Question: {{question}}\nAnswer:"
GEN_PROMPT = "Q: {{question}}\nA:"


def task_yaml(name: str, data_file: Path, body: str) -> str:
    # JSON strings are valid YAML scalars: the paths and prompts need no YAML escaping
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data_file))}\n"
            f"test_split: test\n{body}")


def write_tasks(root: Path) -> Path:
    """`root/tasks`: the two task YAMLs, their JSONL data beside them."""
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "ft_mc.yaml").write_text(task_yaml("ft_mc", tasks / "mc.jsonl", f"""\
output_type: multiple_choice
doc_to_text: {json.dumps(MC_PROMPT)}
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""))
    (tasks / "ft_gen.yaml").write_text(task_yaml("ft_gen", tasks / "gen.jsonl", f"""\
output_type: generate_until
doc_to_text: {json.dumps(GEN_PROMPT)}
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""))
    return tasks


@pytest.fixture(scope="module")
def server(serve_checkpoint):
    # info: uvicorn's access log shows each request and its status
    srv = ServerProcess("--model", str(serve_checkpoint), "--max-running-requests", "4", "--num-tokens", "4096",
                        "--log-level", "info")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(serve_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(serve_checkpoint / "tokenizer.json"))


class LmEvalFailed(AssertionError):
    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


class LmEvalRun:
    """`lm-eval run` offline in a subprocess, started at once (the three runs of this module overlap:
    most of each run is its interpreter's start-up); `result()` waits for it."""

    def __init__(self, tmp: Path, model: str, model_args: dict, tasks: list[str], *extra: str) -> None:
        self.out, self.tasks = tmp / "out", tasks
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "OPENAI_API_KEY": "none"}
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model,
               "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
               "--tasks", ",".join(tasks), "--include_path", str(write_tasks(tmp)), "--batch_size", "1",
               "--output_path", str(self.out), "--log_samples", *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> tuple[dict, dict]:
        """(its results JSON, {task: its logged samples}), or a failure with its output."""
        try:
            stdout, stderr = self.proc.communicate(timeout=LM_EVAL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            raise LmEvalFailed(f"lm-eval ran past {LM_EVAL_TIMEOUT_S} s:\n{stdout[-4000:]}\n{stderr[-8000:]}", stderr)
        if self.proc.returncode != 0:
            raise LmEvalFailed(f"lm-eval exited {self.proc.returncode}:\n{stdout[-4000:]}\n{stderr[-8000:]}", stderr)
        out = self.out
        results = [json.loads(f.read_text()) for f in out.rglob("results_*.json")]
        assert len(results) == 1, f"{sorted(out.rglob('*'))}\n{stderr[-4000:]}"
        samples = {}
        for task in self.tasks:
            files = list(out.rglob(f"samples_{task}_*.jsonl"))
            assert len(files) == 1, sorted(out.rglob("*"))
            samples[task] = sorted((json.loads(line) for line in files[0].read_text().splitlines()),
                                   key=lambda s: s["doc_id"])
        return results[0], samples

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def run_tag(run: str) -> str:
    """The query string that tells one run's requests from another's in the access log (the server
    routes on the path; uvicorn logs the query too)."""
    return f"?lm_eval={run}"


@pytest.fixture(scope="module")
def lm_eval_runs(server, serve_checkpoint, tmp_path_factory):
    """The module's three lm-eval runs against one server, started together."""
    tok = {"tokenizer": serve_checkpoint, "tokenizer_backend": "huggingface"}
    runs = {
        "completions": LmEvalRun(tmp_path_factory.mktemp("lm-eval-completions"), "local-completions", {
            "model": SERVE_MODEL, "base_url": server.url + "/v1/completions" + run_tag("completions"), **tok,
            "max_gen_toks": MAX_GEN_TOKS, "max_retries": 1, "timeout": 300}, ["ft_mc", "ft_gen"]),
        "chat": LmEvalRun(tmp_path_factory.mktemp("lm-eval-chat"), "local-chat-completions", {
            "model": SERVE_MODEL, "base_url": server.url + "/v1/chat/completions" + run_tag("chat"),
            "max_gen_toks": MAX_GEN_TOKS, "max_retries": 1, "timeout": 300}, ["ft_gen"], "--apply_chat_template"),
        "batched": LmEvalRun(tmp_path_factory.mktemp("lm-eval-batched"), "local-completions", {
            "model": SERVE_MODEL, "base_url": server.url + "/v1/completions" + run_tag("batched"), **tok,
            "max_retries": 1, "timeout": 300}, ["ft_mc"], "--batch_size", "2", "--limit", "1"),
    }
    yield runs
    for run in runs.values():
        run.stop()


def access_log(server: ServerProcess, route: str) -> list[int]:
    """Statuses of the requests to `route` in the server's access log."""
    return [int(m) for m in re.findall(rf'"POST {re.escape(route)} HTTP/1\.1" (\d{{3}})', server.output())]


def echo_logprobs(server: ServerProcess, ids: list[int]) -> tuple[list[float | None], list[dict | None]]:
    """The prompt's token logprobs for `ids` and its top-1 alternatives, asked as a plain client asks."""
    r = server.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["top_logprobs"]) and lp["token_logprobs"][0] is None
    return lp["token_logprobs"], lp["top_logprobs"]


def render(template: str, doc: dict) -> str:
    return template.replace("{{question}}", doc["question"])


def test_lm_eval_completions(server, tokenizer, lm_eval_runs):
    """Loglikelihood (multiple choice) and generate-until through local-completions, in one run."""
    results, samples = lm_eval_runs["completions"].result()
    statuses = access_log(server, "/v1/completions" + run_tag("completions"))
    n_choices = sum(len(d["choices"]) for d in MC_DOCS)
    # every request lm-eval sent got a 200 (it would have retried, or failed, otherwise)
    assert statuses == [200] * (n_choices + len(GEN_DOCS)), statuses

    acc = results["results"]["ft_mc"]["acc,none"]
    em = results["results"]["ft_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0
    assert results["n-samples"]["ft_mc"]["effective"] == len(MC_DOCS)
    assert results["n-samples"]["ft_gen"]["effective"] == len(GEN_DOCS)

    # loglikelihood: each choice's summed logprob is the server's own for the same tokens (lm-eval
    # splits the context from the continuation by tokenizing the context alone), and the accuracy
    # is the argmax over those
    assert [s["doc_id"] for s in samples["ft_mc"]] == list(range(len(MC_DOCS)))
    correct = []
    for s, doc in zip(samples["ft_mc"], MC_DOCS):
        context = render(MC_PROMPT, doc)
        assert len(s["resps"]) == len(doc["choices"])
        ctxlen = len(tokenizer.encode(context, add_special_tokens=False).ids)
        ours = []
        for (choice, resp), args in zip(zip(doc["choices"], s["resps"]), s["arguments"].values()):
            assert (args["arg_0"], args["arg_1"]) == (context, " " + choice)
            ids = tokenizer.encode(context + " " + choice, add_special_tokens=False).ids
            assert ctxlen < len(ids)
            token_lps, tops = echo_logprobs(server, ids)
            expected = sum(token_lps[ctxlen:])
            greedy = all(lp == max(top.values()) for lp, top in zip(token_lps[ctxlen:], tops[ctxlen:]))
            (got, is_greedy), = resp  # logged as strings
            assert math.isfinite(float(got)) and float(got) < 0
            assert float(got) == pytest.approx(expected, abs=1e-4), (doc, choice)
            assert is_greedy == str(greedy)
            ours.append(expected)
        # the prompt logprobs are the model's, at the right positions: the top-1 after the context in the
        # (last choice's) echo is what decoding from that context alone picks and reports (another path
        # through the engine)
        r = server.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": ids[:ctxlen], "max_tokens": 1,
                                                 "temperature": 0, "logprobs": 1, "ignore_eos": True})
        assert r.status_code == 200, r.text
        decoded = r.json()["choices"][0]["logprobs"]
        (text, lp), = decoded["top_logprobs"][0].items()
        assert decoded["token_logprobs"][0] == pytest.approx(lp, abs=1e-6)
        # (the echo's entries hold the prompt's own token beside the best one)
        echo_text, echo_lp = max(tops[ctxlen].items(), key=lambda kv: kv[1])
        assert text == echo_text and lp == pytest.approx(echo_lp, abs=1e-4), (doc, decoded, tops[ctxlen])
        correct.append(max(range(len(ours)), key=ours.__getitem__) == doc["answer"])
        assert s["acc"] == float(correct[-1])
    assert acc == pytest.approx(sum(correct) / len(correct))

    # generate-until: what lm-eval got is the server's greedy answer for the same prompt, cut at
    # the first newline (lm-eval's stop; it adds the tokenizer's eos text)
    for s, doc in zip(samples["ft_gen"], GEN_DOCS):
        assert s["arguments"]["gen_args_0"]["arg_0"] == render(GEN_PROMPT, doc)
        ids = tokenizer.encode(render(GEN_PROMPT, doc), add_special_tokens=False).ids
        r = server.post("/v1/completions", json={"model": SERVE_MODEL, "prompt": ids, "max_tokens": MAX_GEN_TOKS,
                                                 "temperature": 0, "stop": ["\n", "<|im_end|>"]})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert s["resps"] == [[text]] and "\n" not in text
        assert s["exact_match"] == float(text == doc["answer"])
    assert any(s["resps"] != [[""]] for s in samples["ft_gen"])  # the text came through (a fixed model)


def test_lm_eval_chat_completions(server, lm_eval_runs):
    """generate-until through local-chat-completions, the prompts rendered by the served chat template."""
    results, samples = lm_eval_runs["chat"].result()
    assert access_log(server, "/v1/chat/completions" + run_tag("chat")) == [200] * len(GEN_DOCS)
    assert 0.0 <= results["results"]["ft_gen"]["exact_match,none"] <= 1.0
    for s, doc in zip(samples["ft_gen"], GEN_DOCS):
        r = server.post("/v1/chat/completions", json={
            "model": SERVE_MODEL, "messages": [{"role": "user", "content": render(GEN_PROMPT, doc)}],
            "max_tokens": MAX_GEN_TOKS, "temperature": 0, "stop": ["\n"]})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert s["resps"] == [[text]], (s["arguments"], text)
    assert any(s["resps"] != [[""]] for s in samples["ft_gen"])


def test_lm_eval_batched_completions(server, tokenizer, lm_eval_runs):
    """lm-eval's batch_size 2: a list of two token-id prompts in one /v1/completions request (the
    legacy OpenAI API takes a batch of prompts; vLLM does)."""
    results, samples = lm_eval_runs["batched"].result()
    assert access_log(server, "/v1/completions" + run_tag("batched")) == [200] * 2  # 3 choices, 2 a request
    assert 0.0 <= results["results"]["ft_mc"]["acc,none"] <= 1.0
    # each choice's summed logprob, sent two prompts per request, is the server's own for that prompt alone
    (s,), doc = samples["ft_mc"], MC_DOCS[0]
    context = render(MC_PROMPT, doc)
    ctxlen = len(tokenizer.encode(context, add_special_tokens=False).ids)
    for choice, resp in zip(doc["choices"], s["resps"]):
        ids = tokenizer.encode(context + " " + choice, add_special_tokens=False).ids
        (got, _), = resp
        assert float(got) == pytest.approx(sum(echo_logprobs(server, ids)[0][ctxlen:]), abs=1e-4), choice
