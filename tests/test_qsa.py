"""Qwen3.8-Flash-Next's QSA selection and sparse attention (ft/model/layers/qsa.py) against the
specification's worked examples (docs/qwen3.8-flash-next/qsa-engram.md, 2.6): dense causal attention
while every block fits the budget, the budget's blocks plus the query's own incomplete block after,
the query's own block competing like any other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.model.layers.qsa import compress_keys, select_tokens, sparse_attention


def _sets(tokens: torch.Tensor) -> list[set[int]]:
    return [set(int(x) for x in row if x >= 0) for row in tokens]


def test_the_specifications_hand_example():
    # ratio 2, budget 2 tokens (1 block); compressed keys -1, 2, 1; queries +1 except position 5: -1
    keys = torch.tensor([[-1.0], [2.0], [1.0]])
    q = torch.ones(6, 1, 1)
    q[5] = -1.0
    tokens = select_tokens(q, keys, torch.arange(6), budget_blocks=1, ratio=2)
    assert tokens.shape == (6, 3)
    assert _sets(tokens) == [{0}, {0, 1}, {0, 1, 2}, {2, 3}, {2, 3, 4}, {0, 1}]


def test_positions_up_to_the_budget_are_dense_and_then_exactly_the_budget():
    ratio, budget = 4, 512
    p = 2052 // ratio
    keys = torch.arange(1, p + 1, dtype=torch.float32)[:, None]  # scores rise with the block index
    pos = torch.tensor([0, 3, 2049, 2050, 2051, 2052])
    q = torch.ones(len(pos), 4, 1)
    sets = _sets(select_tokens(q, keys, pos, budget, ratio))
    for s, t in zip(sets[:4], pos[:4].tolist()):
        assert s == set(range(t + 1))  # dense: every token up to the query
    assert sets[4] == set(range(4, 2052))  # 2,048 tokens: block 0 dropped, the own block (complete) kept
    assert sets[5] == set(range(4, 2053))  # blocks 1..512 and the incomplete block's token 2052


def test_the_own_complete_block_competes_and_can_lose():
    ratio, budget = 4, 2
    keys = torch.tensor([[5.0], [4.0], [-3.0]])  # the third block (tokens 8..11) scores 0
    tokens = select_tokens(torch.ones(1, 1, 1), keys, torch.tensor([11]), budget, ratio)
    assert _sets(tokens) == [set(range(8))]  # position 11 does not see itself


def test_ties_go_to_the_lower_block():
    keys = -torch.ones(6, 1)  # every score is ReLU(-1) = 0
    tokens = select_tokens(torch.ones(1, 2, 1), keys, torch.tensor([23]), budget_blocks=3, ratio=4)
    assert _sets(tokens) == [set(range(12))]


def test_compressed_keys_are_block_means_of_complete_blocks():
    raw = torch.arange(22, dtype=torch.float32)[:, None].repeat(1, 3)
    kc = compress_keys(raw, 4)
    assert kc.shape == (5, 3)
    torch.testing.assert_close(kc[:, 0], torch.tensor([1.5, 5.5, 9.5, 13.5, 17.5]))


def test_dense_selection_equals_causal_attention():
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 37, 6, 2, 16
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    iq, ik = torch.randn(t, 4, 8, generator=g), compress_keys(torch.randn(t, 8, generator=g), 4)
    tokens = select_tokens(iq, ik, torch.arange(t), budget_blocks=16, ratio=4)  # 64 >= 37: dense
    out = sparse_attention(q, k, v, tokens, scale=d ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                          v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out, want.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_sparse_attention_reads_only_the_selected_tokens():
    g = torch.Generator().manual_seed(1)
    t, d = 40, 8
    q, k, v = torch.randn(t, 2, d, generator=g), torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)
    iq, ik = torch.randn(t, 4, d, generator=g), compress_keys(torch.randn(t, d, generator=g), 4)
    tokens = select_tokens(iq, ik, torch.arange(t), budget_blocks=3, ratio=4)
    out = sparse_attention(q, k, v, tokens, scale=0.3)
    row = 39
    keep = sorted(_sets(tokens[row:row + 1])[0])
    assert len(keep) == 12
    w = torch.softmax(q[row, :, :] @ k[keep, 0].T * 0.3, dim=-1)
    torch.testing.assert_close(out[row], w @ v[keep, 0], rtol=1e-5, atol=1e-5)
    v2 = v.clone()
    v2[[i for i in range(t) if i not in keep]] = 100.0  # what was not selected cannot matter
    torch.testing.assert_close(sparse_attention(q, k, v2, tokens, 0.3)[row], out[row])
