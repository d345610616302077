"""The sampler's filters on hand-made distributions."""

from __future__ import annotations

import torch

from ft.engine.sampler import sample
from ft.engine.sampling_params import SamplingParams


def draws(logits, n=400, **kw):
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(**kw)
    return {sample(logits, params, g) for _ in range(n)}


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert draws(logits, temperature=0.0) == {1}
    assert draws(logits, top_k=1) == {1}


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert draws(logits, top_k=3) == {0, 1, 2}


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert draws(logits, top_p=0.7) == {0, 1}
    assert draws(logits, top_p=0.5) == {0}
    assert draws(logits, top_p=0.81) == {0, 1, 2}
    assert draws(logits, top_p=1.0, n=2000) == {0, 1, 2, 3}


def test_low_temperature_concentrates():
    logits = torch.tensor([1.0, 0.8, 0.0])
    assert draws(logits, temperature=0.01) == {0}
    assert len(draws(logits, temperature=5.0)) == 3
