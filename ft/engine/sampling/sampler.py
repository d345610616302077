"""Token sampling on the logits' device: logit bias, repetition/presence/frequency penalties,
greedy, temperature, min-p, top-k, top-p and per-request seeds, for the whole batch in a few
batched ops (no Python loop over rows or over the vocabulary); and the logprobs of what was
sampled.

Order of operations (vLLM's V1 sampler): the logit bias, then the penalties (repetition, then
frequency, then presence), on the raw logits; greedy rows take the argmax of that; sampled rows
then divide by the temperature, drop what min-p drops, then what top-k and top-p drop, and draw.
Every stage is skipped for the whole batch when no row uses it (flags known on the host), and a
row that does not use a stage is bitwise unchanged by it: a greedy row without bias or penalties
is exactly `argmax` of the model's logits.

Logprobs are of the model's raw distribution (log_softmax of the logits, before bias, penalties
and temperature): what vLLM reports by default (its `raw_logprobs` mode), and what scoring tools
(lm-eval) expect, whatever the request's sampling parameters.

Seeds: each sampled row draws by inverse CDF with one uniform u in (0, 1) that is a counter-based
hash of (seed, step), step being the index of the token being sampled (0 for the first). u is
computed on the host (a few integer operations per row) and travels with the other parameters,
so a request's draws depend only on its seed, its step and its own logits row: never on the
other rows of the batch, nor on any generator's state (an unseeded request gets a random seed
when it is added). The hash is lowbias32 (Chris Wellons).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.engine.base.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """lowbias32: a bijection of [0, 2**32) with good avalanche."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_uniform(seed: int, step: int) -> float:
    """The uniform in (0, 1) of a row's draw at `step`: 24 bits of a hash of (seed mod 2**64, step),
    so exact in float32."""
    seed &= (1 << 64) - 1
    key = _mix32((step & _M32) ^ 0x9E3779B9)
    key = _mix32(key ^ (seed >> 32))
    key = _mix32(key ^ (seed & _M32))
    return ((key >> 8) + 0.5) / (1 << 24)


@dataclass
class Penalties:
    """The penalised rows of a batch (R of its B rows) and what they need, on the device.

    rows [R] int64: their rows in the batch. counts [R, V] int32: how many times each token is among
    the row's generated tokens. in_prompt [R, V] bool: the tokens of its prompt (None when no row
    has a repetition penalty: only that penalty reads the prompt). repetition, presence,
    frequency [R] float32 (1, 0, 0 when a row does not use one)."""

    rows: torch.Tensor
    counts: torch.Tensor
    in_prompt: torch.Tensor | None
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


@dataclass
class LogitBias:
    """(row, token, bias) triples [N] of the batch's logit biases, on the device."""

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor


@dataclass
class GrammarMask:
    """The rows of a batch that follow a grammar and their token bitmasks, on the device: rows [G]
    int64, bitmask [G, ceil(V / 32)] int32 (bit t % 32 of word t // 32 set: token t allowed)."""

    rows: torch.Tensor
    bitmask: torch.Tensor


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the logits' device.

    temperature [B] float32 (0: greedy), top_k [B] int64 (0: no limit), top_p [B] float32 in
    (0, 1], uniform [B] float32 (`row_uniform(seed, step)`; ignored on greedy rows). all_greedy
    and any_filter are known on the host: they pick the path without reading the device; so do
    the optional parts: min_p [B] float32 (None: no sampled row uses it), penalties and bias
    (None: no row has any).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor
    all_greedy: bool
    any_filter: bool
    min_p: torch.Tensor | None = None
    penalties: Penalties | None = None
    bias: LogitBias | None = None
    grammar: GrammarMask | None = None

    @staticmethod
    def row(params: SamplingParams, seed: int, step: int) -> tuple[float, int, float, float, float]:
        """(temperature, top_k, top_p, min_p, uniform) of one row; greedy rows get temperature 0."""
        if params.greedy:
            return 0.0, 0, 1.0, 0.0, 0.5
        # NOTE: clamped into float32 / int64 here (an infinite temperature samples like a huge one;
        # a top_p below float32's range keeps only the best token, as the sampler treats 0)
        return (min(params.temperature, 3e38), min(params.top_k, 2**62), params.top_p, params.min_p,
                row_uniform(seed, step))

    @staticmethod
    def flags(params: list[SamplingParams]) -> tuple[bool, bool, bool]:
        """(all_greedy, any_filter, any_min_p) of a batch."""
        sampled = [p for p in params if not p.greedy]
        return (not sampled, any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
                any(p.min_p > 0 for p in sampled))

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, int]], device: torch.device | str,
              history: list[tuple[list[int], list[int]]] | None = None, vocab: int | None = None) -> "SamplingBatch":
        """From (params, seed, step) per row, as fresh tensors (tests; the runner uses its buffers).
        history: each row's (prompt ids, generated ids), which the penalties read; vocab: V."""
        temp, top_k, top_p, min_p, u = zip(*(cls.row(*r) for r in rows))
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        params = [r[0] for r in rows]
        all_greedy, any_filter, any_min_p = cls.flags(params)
        batch = cls(torch.tensor(temp, **f32), torch.tensor(top_k, **i64), torch.tensor(top_p, **f32),
                    torch.tensor(u, **f32), all_greedy, any_filter, torch.tensor(min_p, **f32) if any_min_p else None)
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        if pen:
            counts = torch.zeros(len(pen), vocab, dtype=torch.int32, device=device)
            in_prompt = torch.zeros(len(pen), vocab, dtype=torch.bool, device=device)
            for j, i in enumerate(pen):
                prompt, out = history[i]
                counts[j].index_put_((torch.tensor(out, **i64),), torch.ones(len(out), dtype=torch.int32, device=device),
                                     accumulate=True)
                in_prompt[j, torch.tensor(prompt, **i64)] = True
            any_rep = any(params[i].repetition_penalty != 1.0 for i in pen)
            batch.penalties = Penalties(
                torch.tensor(pen, **i64), counts, in_prompt if any_rep else None,
                torch.tensor([params[i].repetition_penalty for i in pen], **f32),
                torch.tensor([params[i].presence_penalty for i in pen], **f32),
                torch.tensor([params[i].frequency_penalty for i in pen], **f32))
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias]
        if bias:
            r, t, v = zip(*bias)
            batch.bias = LogitBias(torch.tensor(r, **i64), torch.tensor(t, **i64), torch.tensor(v, **f32))
        return batch


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64 token ids, on the logits' device, with no host sync.
    `logits` is not modified (its raw values are what logprobs report).

    First the bias and the penalties (on a copy, only when some row has them). Greedy rows are
    then exactly `argmax` (the first maximum). Sampled rows: (logits - max) / T, then min-p (drop
    tokens whose probability is below min_p times the best one's: exp(scaled) < min_p), top-k
    (the k best by rank), top-p (the smallest prefix of the renormalised distribution whose mass
    reaches p: the best token always stays), then the inverse CDF at the row's uniform, over the
    vocabulary in its own order (so a row's result does not depend on the path). Subtracting the
    max first keeps tiny temperatures finite: they act like greedy.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    logits = process_logits(logits, batch)
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    is_greedy = batch.temperature <= 0
    # NOTE: an infinite temperature is clamped to a finite one so that -inf stays -inf, not NaN
    temp = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature).clamp(max=3e38)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]  # [B, V], max 0
    if batch.min_p is not None:
        # NOTE: p_i / p_max = exp(scaled_i); min_p 0 gives log 0 = -inf, which drops nothing
        scaled = scaled.masked_fill(scaled < batch.min_p.log()[:, None], float("-inf"))
    if batch.any_filter:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (batch.uniform * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target).clamp_(max=logits.shape[-1] - 1)  # [B, 1]
    # NOTE: a parallel scan may round a flat step of the CDF unevenly: never pick a 0-probability token
    picked = torch.where(probs.gather(-1, picked) > 0, picked, probs.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(is_greedy, greedy_ids, picked)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after the bias, the penalties and the grammar masks: a copy when some row has
    them, else `logits` itself. Rows without them are bitwise unchanged. The grammar comes last,
    so that no bias can bring back a token the grammar forbids."""
    if batch.bias is None and batch.penalties is None and batch.grammar is None:
        return logits
    logits = logits.clone()
    if batch.bias is not None:
        b = batch.bias
        logits.index_put_((b.rows, b.tokens), b.values, accumulate=True)
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    if batch.grammar is not None:
        apply_grammar(logits, batch.grammar)
    return logits


_BITS = {}


def apply_grammar(logits: torch.Tensor, g: GrammarMask) -> None:
    """In place on logits [B, V], rows g.rows only: -inf where the row's bitmask has a 0 bit (and
    beyond the bitmask's 32 x words tokens). Other rows are not touched."""
    v = logits.shape[-1]
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((g.bitmask[:, :, None] >> bits) & 1).bool().reshape(g.bitmask.shape[0], -1)  # [G, 32 * words]
    if allowed.shape[1] < v:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]), value=False)
    sub = logits.index_select(0, g.rows).masked_fill(~allowed[:, :v], float("-inf"))
    logits.index_copy_(0, g.rows, sub)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place on logits [B, V], rows p.rows only: the repetition penalty over prompt and generated
    tokens (a positive logit divided by it, a negative one multiplied), then frequency x count and
    presence x (count > 0) subtracted over the generated tokens. A row whose penalties are
    (1, 0, 0) comes back bitwise unchanged (x / 1, x * 1 and x - 0 are exact)."""
    sub = logits.index_select(0, p.rows)
    generated = p.counts > 0
    if p.in_prompt is not None:
        rep = p.repetition[:, None]
        sub = torch.where(generated | p.in_prompt, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - p.frequency[:, None] * p.counts - p.presence[:, None] * generated
    logits.index_copy_(0, p.rows, sub)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw logprobs of rows [R, V]: (logprob of tokens[r] [R], the k best logprobs [R, k] and
    their ids [R, k], best first). k may be 0 (empty [R, 0] tensors)."""
    lp = torch.log_softmax(logits, dim=-1)
    own = lp.gather(1, tokens[:, None])[:, 0]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])
    return own, top_v, top_i


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf what top-k and top-p drop; scaled [B, V] with a 0 maximum per row. Rows with
    neither filter come back bitwise unchanged."""
    v = scaled.shape[-1]
    sorted_vals, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=scaled.device)
    k = torch.where(top_k > 0, top_k, v)
    sorted_vals = sorted_vals.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_vals, dim=-1)
    # NOTE: a token stays when the mass before it is < p: rank 0 always stays; p = 1 drops nothing
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_vals)


# ----------------------------------------------------------------------------------- references
def processed_logits_ref(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int] = (),
                         output_ids: list[int] = ()) -> torch.Tensor:
    """Reference: one row's logits [V] after the bias and the penalties (float64), token by token.
    Written plainly for tests."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    counts: dict[int, int] = {}
    for t in output_ids:
        counts[t] = counts.get(t, 0) + 1
    if params.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            x = float(out[t])
            out[t] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for t, c in counts.items():
        out[t] -= params.frequency_penalty * c + params.presence_penalty
    return out


def sample_probs_ref(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int] = (),
                     output_ids: list[int] = ()) -> torch.Tensor:
    """Reference: the distribution `sample` draws one row from, logits [V] -> probs [V] (float64;
    one-hot at the argmax when greedy). Written plainly, one row at a time, for tests."""
    logits = processed_logits_ref(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    scaled = (logits - logits.max()) / params.temperature
    full = torch.softmax(scaled, dim=-1)
    keep = full >= params.min_p * full.max()  # min-p, on the whole distribution
    order = [t for t in torch.argsort(scaled, descending=True, stable=True).tolist() if keep[t]]
    keep[:] = False
    keep[order[: params.top_k or scaled.numel()]] = True
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    mass = 0.0
    for i, t in enumerate(order[: params.top_k or scaled.numel()]):
        if i > 0 and params.top_p < 1.0 and mass >= params.top_p:
            keep[t] = False
        mass += float(probs[t])
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum()


def logprobs_ref(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Reference: one row's raw logprob of `token` and its k best (id, logprob), float64."""
    lp = logits.double() - torch.logsumexp(logits.double(), dim=0)
    best = sorted(range(lp.numel()), key=lambda t: -float(lp[t]))[:k]
    return float(lp[token]), [(t, float(lp[t])) for t in best]
