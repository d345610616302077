"""Token sampling on the logits' device: greedy, temperature, top-k, top-p and per-request seeds,
for the whole batch in a few batched ops.

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

from ft.engine.sampling_params import SamplingParams

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
class SamplingBatch:
    """Per-row sampling parameters on the logits' device.

    temperature [B] float32 (0: greedy), top_k [B] int64 (0: no limit), top_p [B] float32 in
    (0, 1], uniform [B] float32 (`row_uniform(seed, step)`; ignored on greedy rows). all_greedy
    and any_filter are known on the host: they pick the path without reading the device.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor
    all_greedy: bool
    any_filter: bool

    @staticmethod
    def row(params: SamplingParams, seed: int, step: int) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, uniform) of one row; greedy rows get temperature 0."""
        if params.greedy:
            return 0.0, 0, 1.0, 0.5
        # NOTE: clamped into float32 / int64 here (an infinite temperature samples like a huge one;
        # a top_p below float32's range keeps only the best token, as the sampler treats 0)
        return min(params.temperature, 3e38), min(params.top_k, 2**62), params.top_p, row_uniform(seed, step)

    @staticmethod
    def flags(params: list[SamplingParams]) -> tuple[bool, bool]:
        """(all_greedy, any_filter) of a batch."""
        sampled = [p for p in params if not p.greedy]
        return not sampled, any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, int]], device: torch.device | str) -> "SamplingBatch":
        """From (params, seed, step) per row, as fresh tensors (tests; the runner uses its buffers)."""
        temp, top_k, top_p, u = zip(*(cls.row(*r) for r in rows))
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.tensor(temp, **f32), torch.tensor(top_k, dtype=torch.int64, device=device),
                   torch.tensor(top_p, **f32), torch.tensor(u, **f32), *cls.flags([r[0] for r in rows]))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64 token ids, on the logits' device, with no host sync.

    Greedy rows are exactly `argmax` (the first maximum). Sampled rows: (logits - max) / T, then
    top-k (the k best by rank), then top-p (the smallest prefix of the renormalised distribution
    whose mass reaches p: the best token always stays), then the inverse CDF at the row's uniform,
    over the vocabulary in its own order (so a row's result does not depend on the path).
    Subtracting the max first keeps tiny temperatures finite: they act like greedy.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    is_greedy = batch.temperature <= 0
    # NOTE: an infinite temperature is clamped to a finite one so that -inf stays -inf, not NaN
    temp = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature).clamp(max=3e38)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]  # [B, V], max 0
    if batch.any_filter:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (batch.uniform * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target).clamp_(max=logits.shape[-1] - 1)  # [B, 1]
    # NOTE: a parallel scan may round a flat step of the CDF unevenly: never pick a 0-probability token
    picked = torch.where(probs.gather(-1, picked) > 0, picked, probs.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(is_greedy, greedy_ids, picked)


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


def sample_probs_ref(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: the distribution `sample` draws one row from, logits [V] -> probs [V] (float64;
    one-hot at the argmax when greedy). Written plainly, one row at a time, for tests."""
    logits = logits.double()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    scaled = (logits - logits.max()) / params.temperature
    order = torch.argsort(scaled, descending=True, stable=True)
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    keep[order[: params.top_k or scaled.numel()]] = True
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    mass = 0.0
    for i, t in enumerate(order.tolist()):
        if i > 0 and params.top_p < 1.0 and mass >= params.top_p:
            keep[t] = False
        mass += float(probs[t])
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum()
