"""Serving speed over HTTP, in the manner of `vllm bench serve`: streamed /v1/completions under load. Not a test.

    python3 bench/serve.py --url http://127.0.0.1:30000 [--model ID] [--concurrency 1,8,32,64]
    python3 bench/serve.py --serve-args "--model demo --device cuda" [--serve-log FILE]
    python3 bench/serve.py --serve-args "ARGS" --ab "--some-flag" ...   (two servers, one comparison table)
    python3 bench/serve.py ... --request-rate 2,8,inf [--max-concurrency 32]
        [--input-len 1024 | --input-len-range 512:2048] [--output-len 128] [--num-prompts N]
        [--warmup 2] [--seed 0] [--temperature 0] [--metrics-interval 0.5] [--json FILE]
        [--api-key KEY] [--extra-body JSON] [--vocab-size N] [--timeout S]

A client only (httpx and numpy, no torch): it measures a running server (`--url`), or starts
`python -m ft.cli serve ARGS --port N` itself on a free port (`--serve-args`), waits for /health,
and stops it at the end (SIGINT, killed after --stop-timeout s); when that server does not come up
its log's tail is printed. The model id is the one GET /v1/models lists unless --model names it.
`--ab EXTRA` (with --serve-args): after the first server's levels, a second server started with ARGS
plus EXTRA runs the same levels with the same prompts (same seed), one after the other on one machine,
and a comparison table comes last (each level's output tok/s, TTFT and TPOT p50 of both, B / A), with
each server's "geometry:" startup line: an A/B of a flag in one call.

Every request is a streamed (`stream: true`) POST /v1/completions whose `prompt` is a list of
random token ids (seeded by --seed; the vocabulary's size from the server's 400 answer to an
out-of-range id, or --vocab-size): --input-len of them, or a length drawn per request from
--input-len-range LO:HI (inclusive). The first tokens of each prompt encode a per-run nonce plus
the request's number, so no two prompts of a run (or of two runs) share a prefix-cache page;
the prompt tokens the server still reports as cached are summed per level. `max_tokens` is
--output-len with `ignore_eos: true` (FreeToken has no `min_tokens`, and refuses fields it does
not implement), so every request generates exactly --output-len tokens; the final usage chunk
(`stream_options.include_usage`) says how many it did, and a request that finished with another
count is "short" (no error, but reported).

Load: a concurrency sweep (--concurrency 1,8,32,64: per level, --num-prompts requests with at
most that many in flight), or --request-rate R[,R...] (Poisson arrivals at R requests/s, seeded;
`inf` sends them all at once; --max-concurrency bounds those in flight, and a request's times
start when it is sent, not when it arrived). --num-prompts defaults to max(16, 4 x concurrency)
per concurrency level and 64 per rate. Before each level, --warmup requests (not counted). While
a level runs, a process of its own times GET /metrics every --metrics-interval s (the server's
responsiveness under load, as a monitor or `ft top` polling from elsewhere sees it), and so does a task
in the client's event loop, beside the streams (its figures add the client's own delays: JSON
`metrics_probe_client_loop`, and the level's line).

Per request: TTFT, from sending to the first chunk that carries a choice, whatever its text;
ITL, the gaps between successive chunks (FreeToken's closing chunk, empty text with the
finish_reason, comes right after the last token's and adds no gap); TPOT, (E2E - TTFT) / (output
tokens - 1); E2E, from sending to the end of the stream. FreeToken sends a chunk only for a token
that releases text (not for half a UTF-8 character, and a random model's tokens often release
little): then the first chunk comes after the first token and a chunk carries several tokens,
so ITL is per chunk (as vLLM's is) and TPOT, from the usage's token count, is per token. Per level: completed requests,
errors (a non-200 status, an error event in the stream, a stream cut before [DONE], an exception;
the first one's text is shown), short requests, duration (first send to last end), request
throughput, output tok/s and total tok/s (prompt + output tokens over the duration), TTFT / TPOT /
ITL / E2E mean, p50, p90 and p99 in ms, and the /metrics latency p50 / p99 / max (its own process's); and where the
engine's time went (from the server's `ft_engine_steps_total{kind}` and
`ft_engine_step_seconds_total{kind}` before and after the level): its decode, mixed (a prompt chunk
beside decoding rows) and prefill-only steps, their seconds and the level's time outside steps
(none when the server exports no such series). Prints a line per level as it ends, then a markdown
table last (one row per level). --json FILE writes every figure, each request's, the command line,
the date and the git revisions (this checkout's and the server's /version) to FILE. Exits 1 when a
request failed, 2 with one line on stderr when the server cannot be reached, is not the model asked
for, or does not start (then with the tail of its log).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99)


class BenchError(Exception):
    """A condition that ends the benchmark with one line on stderr (exit 2): unreachable server,
    a server that does not start, arguments the server cannot serve."""


# ---------------------------------------------------------------------------------------------
# statistics


def summarize(values) -> dict:
    """{"n", "mean", "p50", "p90", "p99", "max"} of `values` (numpy's linear-interpolation
    percentiles); the figures are None when there are no values."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    pct = np.percentile(arr, PERCENTILES)
    return {"n": int(arr.size), "mean": float(arr.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)},
            "max": float(arr.max())}


# ---------------------------------------------------------------------------------------------
# one request


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    send_at: float = 0.0  # perf_counter when sent (not written to JSON: relative times are)
    end_at: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried a choice
    output_tokens: int | None = None  # the usage chunk's completion_tokens (None: no usage came)
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens is None or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def send_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                       result: RequestResult) -> RequestResult:
    """POST body to url as a stream; fill `result` with its timings, usage and errors."""
    result.send_at = t0 = time.perf_counter()
    last = None
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {_error_text(text)}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {_error_text(json.dumps(event))}"
                    return result
                choices = event.get("choices") or []
                if choices:
                    choice = choices[0]
                    text, finish = choice.get("text"), choice.get("finish_reason")
                    if finish is not None:
                        result.finish_reason = finish
                    closing = finish is not None and not text and last is not None
                    if not closing:
                        if result.ttft_s is None:
                            result.ttft_s = now - t0
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        result.chunks += 1
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result.end_at = time.perf_counter()
        if not done:
            result.error = "the stream ended before data: [DONE]"
        elif result.ttft_s is None:
            result.error = "the stream carried no choice"
        else:
            result.ok = True
            result.e2e_s = result.end_at - t0
    except Exception as e:  # noqa: BLE001 (one request's failure is a figure of the run, not its end)
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if not result.end_at:
            result.end_at = time.perf_counter()
    return result


def _error_text(text: str) -> str:
    """The message of an error body ({"error": {"message"}}), else the text; one line, at most 300 chars."""
    try:
        msg = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = text
    msg = " ".join(str(msg).split())
    return msg[:300] + ("..." if len(msg) > 300 else "")


# ---------------------------------------------------------------------------------------------
# prompts


class Prompts:
    """Random token-id prompts: lengths and bodies seeded; the first `marker` tokens of each prompt
    encode (nonce + request number) in base vocab, so that every prompt of a run, warm-ups
    included, starts differently (and a run's prompts differ from another run's)."""

    def __init__(self, vocab: int, lo: int, hi: int, seed: int) -> None:
        self.vocab, self.lo, self.hi = vocab, lo, hi
        self.rng = np.random.default_rng(seed)
        self.marker = 2 if vocab >= 1000 else 3
        self.space = vocab ** self.marker
        self.nonce = secrets.randbelow(self.space)
        self.count = 0

    def next(self) -> list[int]:
        n = int(self.rng.integers(self.lo, self.hi + 1))
        ids = self.rng.integers(0, self.vocab, size=n).tolist()
        value = (self.nonce + self.count) % self.space
        self.count += 1
        for i in range(min(self.marker, n)):
            ids[i] = value % self.vocab
            value //= self.vocab
        return ids


# ---------------------------------------------------------------------------------------------
# a level


def note_probe(t0: float, status: int, latencies: list[float], errors: list[str]) -> None:
    """A probe sent at perf_counter() t0 answered `status`: its latency (s) if 200, else its error."""
    if status == 200:
        latencies.append(time.perf_counter() - t0)
    else:
        errors.append(f"HTTP {status}")


async def probe_metrics(client: httpx.AsyncClient, url: str, interval: float, stop: asyncio.Event,
                        latencies: list[float], errors: list[str]) -> None:
    """GET url every `interval` s until `stop` is set: each answer's latency (s), or its error."""
    while True:  # at least one probe, however short the level
        t0 = time.perf_counter()
        try:
            note_probe(t0, (await client.get(url)).status_code, latencies, errors)
        except httpx.HTTPError as e:
            errors.append(f"{type(e).__name__}: {e}")
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, interval - (time.perf_counter() - t0)))
        except asyncio.TimeoutError:
            pass


USED_GAUGE = re.compile(r"^ft_device_memory_used_bytes(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
"""The card's use by the driver's count in a /metrics answer (`DEVICE_SERIES`; CUDA servers only)."""


def used_bytes_in(text: str) -> int | None:
    """`ft_device_memory_used_bytes` in a /metrics answer's text, or None when it has none."""
    m = USED_GAUGE.search(text)
    return int(float(m.group(1))) if m else None


def probe_metrics_process(url: str, interval: float, stop, out) -> None:
    """`probe_metrics` in a process of its own (multiprocessing "spawn"): GET url every `interval` s until the
    `stop` event is set, then (latencies in s, errors, the most `ft_device_memory_used_bytes` any answer
    showed or None) through the pipe end `out`. A monitor or `ft top` polls from its own process; the
    client's event loop, busy with every stream's chunks, would add its own delays to a probe it ran (both
    are reported: `metrics_probe` and `metrics_probe_client_loop`). The device's use at each probe: the
    level's peak, which its end may not show (the expert cache shrinks for a long prompt's reserve and
    grows back after)."""
    latencies: list[float] = []
    errors: list[str] = []
    most: int | None = None
    with httpx.Client(timeout=60.0) as client:
        while True:  # at least one probe, however short the level
            t0 = time.perf_counter()
            try:
                resp = client.get(url)
                note_probe(t0, resp.status_code, latencies, errors)
                used = used_bytes_in(resp.text) if resp.status_code == 200 else None
                if used is not None:
                    most = used if most is None else max(most, used)
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")
            if stop.wait(max(0.0, interval - (time.perf_counter() - t0))):
                break
    out.send((latencies, errors, most))


class MetricsProber:
    """`probe_metrics_process` started and collected: `start()`, then `finish()` -> (latencies, errors, the
    device's most used bytes or None)."""

    def __init__(self, url: str, interval: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # (no fork of a process running an event loop and threads)
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=probe_metrics_process, args=(url, interval, self._stop, send), daemon=True)

    def start(self) -> None:
        self._proc.start()

    async def finish(self, timeout: float = 120.0) -> tuple[list[float], list[str], int | None]:
        """Stop the probes; their figures, or ([], [why], None) when the process sent none within `timeout` s."""
        self._stop.set()
        ready = await asyncio.get_running_loop().run_in_executor(None, self._recv.poll, timeout)
        result = self._recv.recv() if ready else \
            ([], [f"the /metrics probe process sent nothing in {timeout:g} s"], None)
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
        return result


STEP_SERIES = ("ft_engine_steps_total", "ft_engine_step_seconds_total", "ft_engine_slow_steps_total")
"""Steps, their seconds, and the slow ones among them (each a warning in the server's log: `ft.engine.core.slow_steps`),
by kind."""
NGRAM_SERIES = ("ft_ngram_table_rows_read_total", "ft_ngram_table_read_seconds_total")
"""A disk n-gram table's rows the host read for steps, and the engine thread's seconds in them (--ngram-table disk)."""
# `ft.engine.core.step_times.STEP_KINDS`, not imported: this client imports no torch
STEP_KINDS = ("decode", "mixed", "prefill")
DEVICE_SERIES = {"ft_device_memory_card_bytes": "card_bytes", "ft_device_memory_used_bytes": "used_bytes",
                 "ft_device_memory_allocator_peak_bytes": "allocator_peak_bytes",
                 "ft_device_memory_headroom_bytes": "headroom_bytes"}
"""The server's card by the driver's count (`ft.memory.device_memory`; a CUDA device only)."""


async def server_samples(client: httpx.AsyncClient, url: str) -> dict | None:
    """{(series, kind label): value} of the server's step counters (`STEP_SERIES`) and device gauges
    (`DEVICE_SERIES`) from its /metrics at url, or None when it has none (another server, an older
    FreeToken) or the read fails."""
    try:
        resp = await client.get(url)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        got = {(smp.name, smp.labels.get("kind")): smp.value for fam in text_string_to_metric_families(resp.text)
               for smp in fam.samples if smp.name in STEP_SERIES or smp.name in DEVICE_SERIES
               or smp.name in NGRAM_SERIES}
    except ValueError:  # not Prometheus text
        return None
    return got or None


def device_memory(samples: dict | None, used_most: int | None = None) -> dict | None:
    """`DEVICE_SERIES`' values from `server_samples` ({"card_bytes", "used_bytes", ...}) and "used_most_bytes",
    the most any probe of the level saw in use (`probe_metrics_process`; the level's end's when larger or
    when no probe saw one), or None when the server sent none (the CPU, another server)."""
    if not samples or ("ft_device_memory_card_bytes", None) not in samples:
        return None
    d = {key: int(samples.get((name, None), 0)) for name, key in DEVICE_SERIES.items()}
    d["used_most_bytes"] = max(d["used_bytes"], used_most or 0)
    return d


def ngram_split(before: dict | None, after: dict | None) -> dict | None:
    """{"rows", "seconds"} a disk n-gram table's host reads took between two `server_samples` reads (None if either
    is missing or the server read no rows: its table is in host memory, or it has none)."""
    if before is None or after is None:
        return None
    rows = int(after.get((NGRAM_SERIES[0], None), 0) - before.get((NGRAM_SERIES[0], None), 0))
    seconds = after.get((NGRAM_SERIES[1], None), 0.0) - before.get((NGRAM_SERIES[1], None), 0.0)
    return {"rows": rows, "seconds": seconds} if rows else None


def step_split(before: dict | None, after: dict | None) -> dict | None:
    """{kind: {"steps", "seconds", "slow"}} between two `server_samples` reads (None if either is missing; "slow" 0
    from a server that does not count slow steps)."""
    if before is None or after is None:
        return None
    return {kind: {"steps": int(after.get((STEP_SERIES[0], kind), 0) - before.get((STEP_SERIES[0], kind), 0)),
                   "seconds": after.get((STEP_SERIES[1], kind), 0.0) - before.get((STEP_SERIES[1], kind), 0.0),
                   "slow": int(after.get((STEP_SERIES[2], kind), 0) - before.get((STEP_SERIES[2], kind), 0))}
            for kind in STEP_KINDS}


class Target:
    """What every request needs: the server, the model and the request body's fixed fields."""

    def __init__(self, base: str, model: str, api_key: str | None, output_len: int, temperature: float,
                 extra_body: dict, timeout: float) -> None:
        self.base, self.model = base, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.fixed = {"model": model, "max_tokens": output_len, "ignore_eos": True, "temperature": temperature,
                      "stream": True, "stream_options": {"include_usage": True}, **extra_body}
        self.timeout = httpx.Timeout(timeout, connect=10.0)

    def body(self, prompt: list[int]) -> dict:
        return {**self.fixed, "prompt": prompt}


async def run_level(target: Target, prompts: Prompts, *, concurrency: int | None, rate: float | None,
                    num_prompts: int, warmup: int, metrics_interval: float, seed: int) -> dict:
    """One level: warm-up, then num_prompts requests at `concurrency` in flight (concurrency mode)
    or arriving at `rate` per s (rate mode; concurrency None or a bound), /metrics probed meanwhile."""
    limit = concurrency or num_prompts
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    url = target.base + "/v1/completions"
    async with httpx.AsyncClient(timeout=target.timeout, limits=limits) as client, \
            httpx.AsyncClient(timeout=target.timeout) as side:
        if warmup:
            sem = asyncio.Semaphore(limit)

            async def warm(p):
                async with sem:
                    return await send_request(client, url, target.body(p), target.headers, RequestResult(len(p)))

            warm_results = await asyncio.gather(*[warm(prompts.next()) for _ in range(warmup)])
            failed = [r for r in warm_results if not r.ok]
            if len(failed) == len(warm_results):
                raise BenchError(f"every warm-up request failed: {failed[0].error}")

        batch = [prompts.next() for _ in range(num_prompts)]
        results = [RequestResult(len(p)) for p in batch]
        stop = asyncio.Event()
        loop_lat: list[float] = []
        loop_err: list[str] = []
        samples_before = await server_samples(side, target.base + "/metrics")
        outside = MetricsProber(target.base + "/metrics", metrics_interval)
        outside.start()
        prober = asyncio.ensure_future(probe_metrics(side, target.base + "/metrics", metrics_interval, stop,
                                                     loop_lat, loop_err))
        t_start = time.perf_counter()
        try:
            if rate is None:  # concurrency mode: `concurrency` workers take the prompts in order
                queue = list(range(num_prompts))[::-1]

                async def worker():
                    while queue:
                        i = queue.pop()
                        await send_request(client, url, target.body(batch[i]), target.headers, results[i])

                await asyncio.gather(*[worker() for _ in range(min(concurrency, num_prompts))])
            else:  # rate mode: Poisson arrivals, at most `concurrency` in flight when set
                rng = np.random.default_rng(seed)
                gaps = np.zeros(num_prompts) if math.isinf(rate) else rng.exponential(1.0 / rate, num_prompts)
                gaps[0] = 0.0
                arrivals = np.cumsum(gaps)
                sem = asyncio.Semaphore(concurrency) if concurrency else None

                async def arrive(i):
                    delay = t_start + arrivals[i] - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if sem is None:
                        await send_request(client, url, target.body(batch[i]), target.headers, results[i])
                    else:
                        async with sem:
                            await send_request(client, url, target.body(batch[i]), target.headers, results[i])

                await asyncio.gather(*[arrive(i) for i in range(num_prompts)])
        finally:
            stop.set()
            await prober
            probe_lat, probe_err, used_most = await outside.finish()
        samples_after = await server_samples(side, target.base + "/metrics")
    return level_figures(results, concurrency=concurrency, rate=rate, num_prompts=num_prompts,
                         output_len=target.fixed["max_tokens"], probe_lat=probe_lat, probe_err=probe_err,
                         steps=step_split(samples_before, samples_after), loop_lat=loop_lat, loop_err=loop_err,
                         device=device_memory(samples_after, used_most), ngram=ngram_split(samples_before, samples_after))


def probe_figures(latencies: list[float], errors: list[str]) -> dict:
    """/metrics probes' count, errors and latency p50 / p99 / max / mean in ms."""
    stats = summarize(v * 1e3 for v in latencies)
    return {"count": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else None,
            **{k: v for k, v in stats.items() if k in ("p50", "p99", "max", "mean")}}


def level_figures(results: list[RequestResult], *, concurrency: int | None, rate: float | None, num_prompts: int,
                  output_len: int, probe_lat: list[float], probe_err: list[str], steps: dict | None = None,
                  loop_lat: list[float] = (), loop_err: list[str] = (), device: dict | None = None,
                  ngram: dict | None = None) -> dict:
    """A level's figures. probe_lat / probe_err: the /metrics probes from their own process; loop_lat /
    loop_err: those the client's event loop ran beside the streams; device: the server's card during the
    level (`device_memory`: at its end, and the most its probes saw in use); ngram: a disk n-gram table's reads
    during it (`ngram_split`)."""
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    short = [r for r in ok if r.output_tokens != output_len]
    begin = min(r.send_at for r in results) if results else 0.0
    end = max(r.end_at for r in results) if results else 0.0
    duration = max(end - begin, 1e-9)
    out_tokens = sum(r.output_tokens if r.output_tokens is not None else r.chunks for r in ok)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)

    def ms(values):
        return summarize(v * 1e3 for v in values)

    return {
        "mode": "rate" if rate is not None else "concurrency",
        "concurrency": concurrency,
        "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
        "num_prompts": num_prompts,
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "short": len(short),
        "short_counts": sorted({r.output_tokens for r in short}, key=lambda v: (v is None, v or 0)),
        "usage_missing": sum(r.output_tokens is None for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (prompt_tokens + out_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": ms(r.ttft_s for r in ok),
        "tpot_ms": ms(t for r in ok if (t := r.tpot_s) is not None),
        "itl_ms": ms(g for r in ok for g in r.itl_s),
        "e2e_ms": ms(r.e2e_s for r in ok),
        "metrics_probe": probe_figures(probe_lat, probe_err),
        "metrics_probe_client_loop": probe_figures(loop_lat, loop_err),
        "engine_steps": steps,
        "device_memory": device,
        "ngram_table_reads": ngram,
        "requests": [{
            "prompt_len": r.prompt_len, "ok": r.ok, "error": r.error, "status": r.status,
            "output_tokens": r.output_tokens, "chunks": r.chunks, "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason, "start_s": r.send_at - begin,
            "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3,
            "e2e_ms": None if r.e2e_s is None else r.e2e_s * 1e3,
            "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3,
            "itl_max_ms": max(r.itl_s) * 1e3 if r.itl_s else None,
        } for r in results],
    }


# ---------------------------------------------------------------------------------------------
# the server


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def traced_serve_args(serve_args: str) -> tuple[str, str]:
    """(`serve_args` with its `--model synthetic:CONFIG` replaced by a temporary copy of CONFIG that
    carries "routing_trace": true (`ft.engine.worker.routing_override`), that copy's path: the caller
    removes it). SystemExit when the args name no synthetic model (a checkpoint routes by its own router)."""
    args = shlex.split(serve_args)
    at = next((i for i, a in enumerate(args) if a == "--model" or a.startswith("--model=")), None)
    spec = None if at is None else (args[at].split("=", 1)[1] if "=" in args[at] else
                                    args[at + 1] if at + 1 < len(args) else None)
    if spec is None or not spec.startswith("synthetic:"):
        raise SystemExit("--routing-trace needs --serve-args with --model synthetic:CONFIG")
    cfg = json.loads(Path(spec[len("synthetic:"):]).expanduser().read_text())
    cfg["routing_trace"] = True
    fd, path = tempfile.mkstemp(prefix="ft-traced-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    value = f"synthetic:{path}"
    args[at:at + (1 if "=" in args[at] else 2)] = [f"--model={value}"]
    return shlex.join(args), path


class ServerProcess:
    """`python -m ft.cli serve ARGS --port N`, its output in a file; stop() sends SIGINT and kills
    after `stop_timeout` s."""

    def __init__(self, serve_args: str, log_path: str | None) -> None:
        args = shlex.split(serve_args)
        host = _flag(args, "--host") or "127.0.0.1"
        port = _flag(args, "--port")
        if port is None or port == "0":
            args = [a for i, a in enumerate(args) if not (a == "--port" or a.startswith("--port=")
                                                          or (i and args[i - 1] == "--port"))]
            port = str(free_port("127.0.0.1" if host in ("0.0.0.0", "::") else host))
            args += ["--port", port]
        connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://{'[' + connect + ']' if ':' in connect else connect}:{port}"
        self.cmd = [sys.executable, "-m", "ft.cli", "serve", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="ft-serve-", suffix=".log")
            os.close(fd)
            self.keep_log = False
        else:
            self.keep_log = True
        self.log_path = log_path
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.keep_log = True
                raise BenchError(f"ft serve exited {self.proc.returncode} during start-up "
                                 f"({shlex.join(self.cmd)}); the last lines of its log ({self.log_path}):\n"
                                 f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.keep_log = True
                raise BenchError(f"ft serve did not become healthy at {self.url} within {timeout:g} s; the last "
                                 f"lines of its log ({self.log_path}):\n{self.tail()}")
            time.sleep(0.2)

    def startup_line(self, prefix: str, wait_s: float = 5.0) -> str | None:
        """The first line of the log that starts with `prefix` (stripped), waiting up to `wait_s` for it (the
        banner is logged just after /health turns 200); None when none comes (e.g. --log-level warning)."""
        deadline = time.monotonic() + wait_s
        while True:
            for line in Path(self.log_path).read_text(errors="replace").splitlines():
                if line.strip().startswith(prefix):
                    return line.strip()
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return None
            time.sleep(0.1)

    def slow_steps(self) -> list[str]:
        """The server's slow-step lines so far (`slow_step_lines` of its log)."""
        return slow_step_lines(Path(self.log_path).read_text(errors="replace"))

    def tail(self, lines: int = 40) -> str:
        self.log.flush()
        text = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self, timeout: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not self.keep_log:
            os.unlink(self.log_path)
        return self.proc.returncode


def slow_step_lines(log: str) -> list[str]:
    """The warning lines of a server's slow steps in its log text (`ft.engine.core.slow_steps`: "slow KIND step:
    ..."), from "slow" on."""
    out = []
    for line in log.splitlines():
        i = line.find("slow ")
        if i >= 0 and " step: " in line[i:] and line[i:].split(" ", 2)[1] in STEP_KINDS:
            out.append(line[i:])
    return out


def _flag(args: list[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


# ---------------------------------------------------------------------------------------------
# set-up: model, vocabulary, context


VOCAB_RE = re.compile(r"outside the vocabulary \(0\.\.(\d+)\)")


def discover(base: str, model: str | None, api_key: str | None) -> dict:
    """{"model", "max_model_len", "version"}; BenchError with one line when the server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base + "/v1/models", headers=headers, timeout=httpx.Timeout(30.0, connect=10.0))
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {base}: {type(e).__name__}: {str(e) or 'no answer'}") from None
    if resp.status_code != 200:
        raise BenchError(f"GET {base}/v1/models answered HTTP {resp.status_code}: {_error_text(resp.text)}")
    try:
        cards = resp.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"GET {base}/v1/models did not answer a model list: {resp.text[:200]!r}") from None
    card = next((c for c in cards if c.get("id") == model), None) if model else (cards[0] if cards else None)
    if model and card is None:
        served = ", ".join(str(c.get("id")) for c in cards)
        raise BenchError(f"the server does not serve {model!r} (it serves {served})")
    if card is None:
        raise BenchError(f"GET {base}/v1/models lists no model")
    try:
        version = httpx.get(base + "/version", timeout=10.0).json()
    except (httpx.HTTPError, ValueError):
        version = None
    return {"model": card["id"], "max_model_len": card.get("max_model_len"), "version": version}


def probe_vocab(base: str, model: str, api_key: str | None) -> int | None:
    """The vocabulary's size, read from FreeToken's 400 answer to a prompt whose one token id is far
    out of range; None when the answer does not say it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.post(base + "/v1/completions", headers=headers, timeout=httpx.Timeout(60.0, connect=10.0),
                          json={"model": model, "prompt": [2**30], "max_tokens": 1})
    except httpx.HTTPError:
        return None
    m = VOCAB_RE.search(resp.text) if resp.status_code == 400 else None
    return int(m.group(1)) + 1 if m else None


# ---------------------------------------------------------------------------------------------
# output


def _f(v, digits=1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def level_label(lv: dict) -> str:
    if lv["mode"] == "concurrency":
        return str(lv["concurrency"])
    rate = lv["request_rate"]
    return ("inf" if rate == "inf" else f"{rate:g}") + (f" (<= {lv['concurrency']})" if lv["concurrency"] else "")


def level_line(lv: dict) -> str:
    if lv["mode"] == "concurrency":
        what = f"concurrency {lv['concurrency']}"
    else:
        rate = lv["request_rate"]
        what = f"rate {'inf' if rate == 'inf' else f'{rate:g}'} req/s" + (
            f" (at most {lv['concurrency']} in flight)" if lv["concurrency"] else "")
    line = (f"{what}: {lv['completed']}/{lv['num_prompts']} ok, {lv['errors']} errors, {lv['short']} short, "
            f"{lv['duration_s']:.2f} s, {lv['request_throughput']:.2f} req/s, "
            f"{lv['output_throughput']:.1f} output tok/s, "
            f"{lv['total_token_throughput']:.1f} total tok/s; TTFT p50 {_f(lv['ttft_ms']['p50'])} ms, "
            f"TPOT p50 {_f(lv['tpot_ms']['p50'])} ms, ITL p50 {_f(lv['itl_ms']['p50'])} ms, "
            f"E2E p50 {_f(lv['e2e_ms']['p50'])} ms; /metrics p99 {_f(lv['metrics_probe']['p99'])} ms "
            f"({lv['metrics_probe']['count']} probes from their own process; from the client's loop "
            f"{_f(lv.get('metrics_probe_client_loop', {}).get('p99'))} ms); "
            f"{lv['cached_prompt_tokens']} prompt tokens from the prefix cache")
    if lv.get("engine_steps"):
        line += "\n  " + steps_line(lv["engine_steps"], lv["duration_s"])
    if lv.get("ngram_table_reads"):
        nr = lv["ngram_table_reads"]
        busy = sum(v["seconds"] for v in (lv.get("engine_steps") or {}).values())
        line += (f"\n  n-gram table on disk: {nr['rows']:,} rows read for steps in {nr['seconds']:.3f} s"
                 + (f" ({nr['seconds'] / busy:.1%} of the steps' time)" if busy else ""))
    if lv.get("device_memory"):
        line += "\n  " + device_line(lv["device_memory"])
    if lv["first_error"]:
        line += f"\n  first error: {lv['first_error']}"
    if lv["short"]:
        line += f"\n  short requests: completion_tokens {lv['short_counts']} instead of the asked output length"
    if lv["usage_missing"]:
        line += f"\n  {lv['usage_missing']} requests without a usage chunk (their output counted in chunks)"
    return line


def steps_line(steps: dict, duration_s: float) -> str:
    """Where the engine's time went during a level (`step_split`'s figures): each kind's steps, seconds and
    ms a step, and the level's seconds outside steps (the warm-up excluded; the counters are the engine's
    published figures, which trail its last step by at most a few ms)."""
    parts = []
    for kind, v in steps.items():
        text = f"{kind} {v['steps']:,} in {v['seconds']:.2f} s"
        if v["steps"]:
            slow = f"; {v['slow']} slow: see the server's log" if v.get("slow") else ""
            text += f" ({v['seconds'] / v['steps'] * 1e3:.1f} ms each{slow})"
        parts.append(text)
    inside = sum(v["seconds"] for v in steps.values())
    return f"engine steps: {', '.join(parts)}; {max(0.0, duration_s - inside):.2f} s of the level outside them"


def device_line(d: dict) -> str:
    """The server's card during a level (`device_memory`'s figures, GiB): in use at its end and at most (the
    probes' peak) by the driver's count, the caching allocator's peak, what the process never took at the
    level's peak, and the headroom the budget keeps."""
    gib = 2 ** 30
    most = d.get("used_most_bytes", d["used_bytes"])
    return (f"device: {d['used_bytes'] / gib:.2f} of {d['card_bytes'] / gib:.2f} GiB in use at the end, "
            f"{most / gib:.2f} at most (allocator peak {d['allocator_peak_bytes'] / gib:.2f}), "
            f"{max(0, d['card_bytes'] - most) / gib:.2f} GiB never taken; headroom {d['headroom_bytes'] / gib:.2f} GiB")


def table(levels: list[dict]) -> str:
    rate_mode = levels[0]["mode"] == "rate"
    head = ["rate (req/s)" if rate_mode else "concurrency", "requests", "errors", "short", "req/s", "output tok/s",
            "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "E2E p50 ms", "E2E p99 ms", "/metrics p99 ms"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for lv in levels:
        cells = [level_label(lv), str(lv["completed"]), str(lv["errors"]), str(lv["short"]),
                 _f(lv["request_throughput"], 2), _f(lv["output_throughput"]), _f(lv["total_token_throughput"]),
                 _f(lv["ttft_ms"]["p50"]), _f(lv["ttft_ms"]["p99"]), _f(lv["tpot_ms"]["p50"]), _f(lv["tpot_ms"]["p99"]),
                 _f(lv["itl_ms"]["p50"]), _f(lv["itl_ms"]["p99"]), _f(lv["e2e_ms"]["p50"]), _f(lv["e2e_ms"]["p99"]),
                 _f(lv["metrics_probe"]["p99"])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _json_number(v: float) -> float | str:
    """inf as "inf" (JSON has no infinity)."""
    return "inf" if math.isinf(v) else v


def git_revision() -> str | None:
    """This checkout's HEAD, with "-dirty" when it has changes; None outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Serving benchmark: streamed /v1/completions under load "
                                 "(the module's docstring says what it measures).")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument("--serve-args", metavar="ARGS",
                       help="start `python -m ft.cli serve ARGS --port <free port>` and stop it at the end")
    ap.add_argument("--routing-trace", action="store_true",
                    help="with --serve-args naming --model synthetic:CONFIG: serve a copy of CONFIG with "
                         '"routing_trace": true, so that requests route like a trained model\'s (the calibrated '
                         "trace, as bench/ladder.py runs); without it a synthetic router's random weights spread "
                         "tokens evenly over the experts, offload's worst case")
    ap.add_argument("--ab", metavar="EXTRA",
                    help="with --serve-args: then a second server with ARGS plus EXTRA, the same levels, and a "
                         "comparison table (B / A) last")
    ap.add_argument("--serve-log", metavar="FILE",
                    help="keep the started server's output in FILE (default: a temporary file; not the file this "
                         "command's own output goes to)")
    ap.add_argument("--server-timeout", type=float, default=900.0, metavar="S",
                    help="seconds the started server may take to be healthy (default: %(default)g)")
    ap.add_argument("--stop-timeout", type=float, default=60.0, metavar="S",
                    help="seconds after SIGINT before the started server is killed (default: %(default)g)")
    ap.add_argument("--model", help="model id in the requests (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("FT_API_KEY"), metavar="KEY",
                    help="bearer key for /v1 (default: $FT_API_KEY)")
    ap.add_argument("--input-len", type=int, default=1024, metavar="N",
                    help="prompt tokens per request (default: %(default)s)")
    ap.add_argument("--input-len-range", metavar="LO:HI",
                    help="prompt tokens drawn per request in [LO, HI] (overrides --input-len)")
    ap.add_argument("--output-len", type=int, default=128, metavar="N",
                    help="tokens generated per request (max_tokens, ignore_eos) (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, metavar="N",
                    help="requests per level (default: max(16, 4 x concurrency); 64 per rate)")
    ap.add_argument("--concurrency", metavar="C[,C...]",
                    help="concurrency levels to sweep (default: 1,8,32,64 unless --request-rate)")
    ap.add_argument("--request-rate", metavar="R[,R...]",
                    help="requests/s, Poisson arrivals; a list sweeps; inf: all at once")
    ap.add_argument("--max-concurrency", type=int, metavar="N", help="rate mode: at most this many requests in flight")
    ap.add_argument("--warmup", type=int, default=2, metavar="N",
                    help="requests before each level, not counted (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="prompt lengths and tokens, arrival times (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    ap.add_argument("--extra-body", default="{}", metavar="JSON", help="more fields for every request body")
    ap.add_argument("--vocab-size", type=int, metavar="N",
                    help="token ids are drawn from [0, N) (default: asked of the server)")
    ap.add_argument("--metrics-interval", type=float, default=0.5, metavar="S",
                    help="seconds between GET /metrics probes (default: %(default)g)")
    ap.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                    help="seconds a request may wait for its next bytes (default: %(default)g)")
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = ap.parse_args(argv)
    if args.ab is not None and args.serve_args is None:
        ap.error("--ab compares two servers this script starts: give --serve-args")
    if args.input_len_range:
        try:
            lo, hi = (int(x) for x in args.input_len_range.split(":"))
        except ValueError:
            ap.error(f"--input-len-range: expected LO:HI, got {args.input_len_range!r}")
    else:
        lo = hi = args.input_len
    if not 1 <= lo <= hi:
        ap.error(f"prompt lengths must be 1 <= LO <= HI, got {lo}:{hi}")
    args.lengths = (lo, hi)
    if args.output_len < 1:
        ap.error("--output-len must be at least 1")
    if args.request_rate and args.concurrency:
        ap.error("--concurrency and --request-rate are two modes: give one (rate mode bounds with --max-concurrency)")
    try:
        args.rates = [float(r) for r in args.request_rate.split(",")] if args.request_rate else None
        args.concurrency_levels = None if args.rates else [int(c) for c in (args.concurrency or "1,8,32,64").split(",")]
    except ValueError:
        ap.error("--concurrency takes integers and --request-rate numbers or inf, comma-separated")
    if args.rates and any(not r > 0 for r in args.rates):
        ap.error("--request-rate: every rate must be > 0 (or inf)")
    if args.concurrency_levels and any(c < 1 for c in args.concurrency_levels):
        ap.error("--concurrency: every level must be at least 1")
    if args.max_concurrency is not None and (args.max_concurrency < 1 or not args.rates):
        ap.error("--max-concurrency: at least 1, with --request-rate")
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error("--num-prompts must be at least 1")
    try:
        args.extra = json.loads(args.extra_body)
        assert isinstance(args.extra, dict)
    except (ValueError, AssertionError):
        ap.error("--extra-body must be a JSON object")
    return args


async def run_all(args: argparse.Namespace, base: str, info: dict, vocab: int) -> list[dict]:
    target = Target(base, info["model"], args.api_key, args.output_len, args.temperature, args.extra, args.timeout)
    prompts = Prompts(vocab, *args.lengths, seed=args.seed)
    if args.concurrency_levels:
        plan = [(c, None) for c in args.concurrency_levels]
    else:
        plan = [(args.max_concurrency, r) for r in args.rates]
    levels = []
    for i, (conc, rate) in enumerate(plan):
        n = args.num_prompts or (max(16, 4 * conc) if rate is None else 64)
        lv = await run_level(target, prompts, concurrency=conc, rate=rate, num_prompts=n, warmup=args.warmup,
                             metrics_interval=args.metrics_interval, seed=args.seed + 1000 * (i + 1))
        print(level_line(lv), flush=True)
        levels.append(lv)
    return levels


def run_server(args: argparse.Namespace, serve_args: str | None, log_path: str | None) -> dict:
    """Start the server (`serve_args`; None: the running one at --url), run every level against it,
    stop it. Returns {"base", "info", "vocab", "levels", "t0", "geometry", "prefill"} (`geometry`, `prefill`: the
    started server's "geometry:" and "prefill:" startup lines, None otherwise: rows on cards of other sizes
    differ by these). Raises BenchError."""
    server, server_up, traced, geometry, prefill = None, False, None, None, None
    try:
        if serve_args is not None:
            if args.routing_trace:
                serve_args, traced = traced_serve_args(serve_args)
            server = ServerProcess(serve_args, log_path)
            print(f"starting {shlex.join(server.cmd)} (log: {server.log_path})", flush=True)
            t0 = time.perf_counter()
            server.wait_healthy(args.server_timeout)
            server_up = True
            print(f"server healthy at {server.url} after {time.perf_counter() - t0:.1f} s", flush=True)
            # (the banner is an info line: a server told to log warnings only has none to wait for)
            quiet = (_flag(shlex.split(serve_args), "--log-level") or "info") in ("warning", "error", "critical")
            geometry = None if quiet else server.startup_line("geometry:")
            prefill = None if quiet else server.startup_line("prefill:")
            if geometry or prefill:
                print(f"server {'; '.join(line for line in (geometry, prefill) if line)}", flush=True)
            if geometry and "(offload)" in geometry and not args.routing_trace and "synthetic:" in serve_args:
                # (e.g. Flash-Next on the 32 GiB card: ~25% hits so, 83% with the trace)
                print("note: this synthetic model routes by its random router, near-uniformly: an offloaded "
                      "cache's hit rate is about its share of the experts, far below a trained model's; "
                      "--routing-trace routes by the calibrated trace", flush=True)
            base = server.url
        else:
            base = args.url.rstrip("/")
            if "://" not in base:
                base = "http://" + base
        info = discover(base, args.model, args.api_key)
        vocab = args.vocab_size or probe_vocab(base, info["model"], args.api_key)
        if vocab is None:
            raise BenchError("the server did not say its vocabulary's size: pass --vocab-size")
        lo, hi = args.lengths
        if info["max_model_len"] and hi + args.output_len > info["max_model_len"]:
            raise BenchError(f"prompts of up to {hi} tokens plus {args.output_len} new ones exceed the server's "
                             f"max_model_len {info['max_model_len']}")
        print(f"model {info['model']} at {base}: vocabulary {vocab}, max_model_len {info['max_model_len']}; "
              f"prompts {lo if lo == hi else f'{lo}..{hi}'} tokens, {args.output_len} output tokens, "
              f"temperature {args.temperature:g}", flush=True)
        t0 = time.time()
        levels = asyncio.run(run_all(args, base, info, vocab))
        if server is not None:  # (the levels' slow-step counts point here)
            for line in server.slow_steps():
                print(f"server log: {line}", flush=True)
    finally:
        if server is not None:
            if server_up and server.proc.poll() is not None:  # it exited under the load
                server.keep_log = True
                print(f"bench/serve.py: the server exited {server.proc.returncode} before the end; the last lines "
                      f"of its log ({server.log_path}):\n{server.tail()}", file=sys.stderr)
            rc = server.stop(args.stop_timeout)
            print(f"server stopped (exit {rc})", flush=True)
        if traced is not None:
            Path(traced).unlink(missing_ok=True)
    return {"base": base, "info": info, "vocab": vocab, "levels": levels, "t0": t0, "geometry": geometry,
            "prefill": prefill}


def ab_table(a: dict, b: dict, extra: str) -> str:
    """Each level of the two runs side by side: output tok/s, TTFT and TPOT p50, B / A."""
    head = ["level", "output tok/s A", "output tok/s B", "B / A", "TTFT p50 ms A", "TTFT p50 ms B", "TPOT p50 ms A",
            "TPOT p50 ms B"]
    rows = [f"A: the server as started; B: with {extra}",
            f"A geometry: {a['geometry'] or '-'}", f"B geometry: {b['geometry'] or '-'}",
            "| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for la, lb in zip(a["levels"], b["levels"]):
        ratio = lb["output_throughput"] / la["output_throughput"] if la["output_throughput"] else float("nan")
        cells = [level_label(la), _f(la["output_throughput"]), _f(lb["output_throughput"]), f"{ratio:.3f}",
                 _f(la["ttft_ms"]["p50"]), _f(lb["ttft_ms"]["p50"]), _f(la["tpot_ms"]["p50"]), _f(lb["tpot_ms"]["p50"])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def writes_to(path: str, fd: int) -> bool:
    """Whether `path` is the file descriptor `fd`'s file (a shell redirect of this command's output to the file
    named as the server's log: the two would write at their own offsets, over each other)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:  # (no such file yet, or a closed descriptor: not the same file)
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_log is not None and any(writes_to(args.serve_log, fd) for fd in (1, 2)):
        raise SystemExit(f"bench/serve.py: --serve-log {args.serve_log} is where this command's own output goes: the "
                         "two would overwrite each other; give the server's log a file of its own")
    if args.routing_trace and args.serve_args is None:
        raise SystemExit("bench/serve.py: --routing-trace applies to a server it starts (--serve-args); a running "
                         "server routes as it was started")
    try:
        a = run_server(args, args.serve_args, args.serve_log)
        b = None
        if args.ab is not None:
            print(f"\n== B: the same levels with {args.ab}", flush=True)
            print(table(a["levels"]), flush=True)
            log_b = None if args.serve_log is None else args.serve_log + ".b"
            b = run_server(args, f"{args.serve_args} {args.ab}", log_b)
    except BenchError as e:
        print(f"bench/serve.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench/serve.py: interrupted", file=sys.stderr)
        return 130
    if args.json:
        record = {
            "command": shlex.join([sys.executable, *sys.argv] if argv is None else ["bench/serve.py", *argv]),
            "date": datetime.datetime.fromtimestamp(a["t0"], datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_rev": git_revision(),
            "server": {"url": a["base"], "started": args.serve_args is not None, "serve_args": args.serve_args,
                       "model": a["info"]["model"], "max_model_len": a["info"]["max_model_len"],
                       "version": a["info"]["version"], "vocab_size": a["vocab"], "geometry": a["geometry"],
                       "prefill": a["prefill"]},
            "config": {k: [_json_number(r) for r in v] if k == "rates" and v else v
                       for k, v in vars(args).items() if k not in ("api_key", "extra")},
            "levels": a["levels"],
        }
        if b is not None:
            record["ab"] = {"extra": args.ab, "geometry": b["geometry"], "levels": b["levels"]}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(table((b or a)["levels"]), flush=True)
    if b is not None:
        print(ab_table(a, b, args.ab), flush=True)
    failed = any(lv["errors"] for run in (a, b) if run for lv in run["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
