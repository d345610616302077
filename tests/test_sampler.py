"""The device sampler against its plain reference: greedy bitwise, the filters' allowed sets and
distributions, seeds reproducible whatever else is in the batch, extreme parameters finite."""

from __future__ import annotations

import pytest
import torch

from ft.engine.sampling.sampler import SamplingBatch, row_uniform, sample, sample_probs_ref
from ft.engine.base.sampling_params import SamplingParams

TV_TOL = 0.05  # total variation between empirical and reference distributions (n = 4000 draws)


def draws(logits: torch.Tensor, n: int = 400, **kw) -> torch.Tensor:
    """n draws from one row of logits [V]: n rows with seeds 0..n-1 in one batch."""
    params = SamplingParams(**kw)
    batch = SamplingBatch.build([(params, seed, 0) for seed in range(n)], logits.device)
    return sample(logits.expand(n, -1).contiguous(), batch)


def test_greedy_is_argmax_bitwise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first maximum wins
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(sample(logits, SamplingBatch.build([(greedy, None, 0)] * 16, "cpu")), logits.argmax(-1))
    # greedy rows inside a batch that samples the others
    rows = [(greedy if i % 2 else SamplingParams(top_k=1 if i % 4 == 0 else 5, top_p=0.9), i, 0) for i in range(16)]
    out = sample(logits, SamplingBatch.build(rows, "cpu"))
    mask = torch.tensor([p.greedy for p, _, _ in rows])
    assert torch.equal(out[mask], logits.argmax(-1)[mask]) and out[3] == 10


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert set(draws(logits, top_k=3).tolist()) == {0, 1, 2}
    assert set(draws(logits, top_k=1).tolist()) == {0}


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draws(logits, top_p=0.7).tolist()) == {0, 1}
    assert set(draws(logits, top_p=0.5).tolist()) == {0}
    assert set(draws(logits, top_p=0.81).tolist()) == {0, 1, 2}
    assert set(draws(logits, top_p=1.0, n=2000).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(top_p=0.6), dict(temperature=1.5, top_k=8, top_p=0.8),
], ids=["T1", "T0.7-k5", "p0.6", "T1.5-k8-p0.8"])
def test_distribution_matches_reference(kw):
    logits = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 1.5
    ref = sample_probs_ref(logits, SamplingParams(**kw))
    got = draws(logits, n=4000, **kw)
    assert (ref[got] > 0).all()  # never outside the allowed set
    emp = torch.bincount(got, minlength=32).double() / got.numel()
    assert 0.5 * float((emp - ref).abs().sum()) < TV_TOL


def test_seeds_reproducible_and_independent_of_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 500, generator=g)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9), SamplingParams(temperature=1.3)]
    rows = [(params[i % 2], 1000 + i, i) for i in range(8)]
    full = sample(logits, SamplingBatch.build(rows, "cpu"))
    for i in range(8):  # alone
        assert sample(logits[i : i + 1], SamplingBatch.build([rows[i]], "cpu")).item() == full[i]
    perm = torch.randperm(8, generator=g)
    shuffled = sample(logits[perm], SamplingBatch.build([rows[i] for i in perm.tolist()], "cpu"))
    assert torch.equal(shuffled, full[perm])
    # with greedy rows and no filter elsewhere in the batch (the other path through sample)
    mixed = [rows[1], (SamplingParams(temperature=0.0), None, 0)]
    assert sample(logits[1:3], SamplingBatch.build(mixed, "cpu"))[0] == full[1]
    # another step or another seed draws anew
    other = sample(logits[1:2].expand(64, -1), SamplingBatch.build([(params[1], 5, s) for s in range(64)], "cpu"))
    assert len(set(other.tolist())) > 10


def test_extreme_parameters_stay_finite():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 30
    top = logits.argmax(-1)
    for kw in (dict(temperature=1e-30), dict(temperature=1e-45), dict(top_p=1e-9), dict(temperature=1e-6, top_k=3)):
        out = sample(logits, SamplingBatch.build([(SamplingParams(**kw), s, 0) for s in range(4)], "cpu"))
        assert torch.equal(out, top), kw
    for kw in (dict(temperature=1e30), dict(temperature=float("inf"), top_p=0.5)):
        out = sample(logits, SamplingBatch.build([(SamplingParams(**kw), s, 0) for s in range(4)], "cpu"))
        assert ((out >= 0) & (out < 300)).all(), kw
    with_inf = logits.clone()
    with_inf[:, :10] = float("-inf")
    out = sample(with_inf, SamplingBatch.build([(SamplingParams(temperature=float("inf")), s, 0) for s in range(4)], "cpu"))
    assert (out >= 10).all()


def test_row_uniforms():
    u = torch.tensor([row_uniform(seed, step) for seed in range(100) for step in range(100)], dtype=torch.float64)
    assert (u > 0).all() and (u < 1).all() and len(set(u.tolist())) > 9990
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.003
    assert row_uniform(-1, 3) == row_uniform(2**64 - 1, 3) != row_uniform(2**64 - 1, 4)
    assert torch.tensor(row_uniform(7, 0), dtype=torch.float32).item() == row_uniform(7, 0)  # exact in float32
