"""Qwen3.8-Flash-Next's Engram n-gram embedding (ft/model/layers/engram.py): the table geometry and the
hashed rows against the released checkpoint's fixture (docs/qwen3.8-flash-next/qsa-engram.md, 7.2),
the context's reset after EOS, chunked = whole, and the PLE delta's causality and carried conv state."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ft.model.layers.engram import (PLE_CHUNK_BYTES, EngramHashing, PLEWeights, next_primes, ple_chunk_tokens, ple_delta,
                                    ple_delta_batched)
from ft.model.layers.hyper_connection import grouped_rms_norm

EOS = 248044

# The reference's hash fixture: ids [10, 11, EOS, 12, 13], the 16 rows of positions 0 and 3.
FIXTURE_IDS = [10, 11, EOS, 12, 13]
FIXTURE_ROWS = {
    0: [6826666, 27775725, 51991156, 74082527, 82622748, 119600976, 135816374, 152166807, 174244281, 190221032,
        211723794, 232787707, 243645790, 275729718, 280030017, 303574322],
    3: [10272144, 38375960, 56169038, 77269436, 82103390, 104512879, 128875317, 156088582, 166704986, 181067027,
        214019790, 236371812, 246423428, 277700973, 295065937, 303933063],
}


def test_table_geometry_of_the_released_checkpoint():
    h = EngramHashing()
    assert h.sizes[:3] == (20000003, 20000023, 20000033) and len(h.sizes) == 16
    assert h.offsets[1] == 20000003 and h.offsets[-1] == 300001275
    assert sum(h.sizes) == 320001446 and h.padded_rows == 320001536
    assert h.padded_rows * 160 == 51_200_245_760  # the "51.2B parameters"


def test_next_primes_are_primes_in_order():
    ps = next_primes(100, 5)
    assert ps == [101, 103, 107, 109, 113]


def test_rows_equal_the_checkpoint_fixture():
    rows, context = EngramHashing().rows(torch.tensor(FIXTURE_IDS))
    for pos, want in FIXTURE_ROWS.items():
        assert rows[pos].tolist() == want
    assert context == [12, 13]


def test_rows_stay_in_each_heads_range():
    h = EngramHashing()
    rows, _ = h.rows(torch.randint(0, 248320, (300,), generator=torch.Generator().manual_seed(0)))
    lo, size = torch.tensor(h.offsets), torch.tensor(h.sizes)
    assert bool(((rows >= lo) & (rows < lo + size)).all())


def test_context_resets_after_eos_and_at_the_start():
    h = EngramHashing()
    # token 12 after EOS hashes as if the sequence started at the EOS: same rows as [EOS, 12] from scratch
    after_eos, _ = h.rows(torch.tensor([5, 6, EOS, 12]))
    fresh, _ = h.rows(torch.tensor([EOS, 12]))
    assert torch.equal(after_eos[3], fresh[1])
    # the first token of a sequence sees EOS as its whole context: equal to a token right after an EOS
    first, _ = h.rows(torch.tensor([12]))
    assert torch.equal(first[0], fresh[1])
    # a bigram ignores the token two back, a trigram does not
    a, _ = h.rows(torch.tensor([1, 2, 3]))
    b, _ = h.rows(torch.tensor([7, 2, 3]))
    assert torch.equal(a[2, :8], b[2, :8]) and not torch.equal(a[2, 8:], b[2, 8:])


@pytest.mark.parametrize("cut", [1, 2, 5, 9])
def test_chunks_with_carried_context_equal_the_whole(cut):
    h = EngramHashing()
    ids = torch.tensor([3, 4, EOS, 5, 6, 7, EOS, EOS, 8, 9, 10])
    whole, ctx_whole = h.rows(ids)
    first, ctx = h.rows(ids[:cut])
    parts = [first]
    for i in range(cut, len(ids)):  # then token by token, as decode
        r, ctx = h.rows(ids[i:i + 1], ctx)
        parts.append(r)
    assert torch.equal(torch.cat(parts), whole) and ctx == ctx_whole


def _weights(c=2, d=8, e=12, k=4, dilation=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(dtype)  # noqa: E731
    return PLEWeights(key_proj=r(c * d, e), value_proj=r(d, e), norm_key=r(c * d), norm_query=r(c * d),
                      norm_conv=r(c * d), conv=r(c * d, k), streams=c, dilation=dilation)


def _naive_delta(emb, streams, w):
    """Token by token, straight from the specification's formulas."""
    t, c, d = streams.shape
    u_hats, out = [], []
    for i in range(t):
        key = grouped_rms_norm(w.key_proj @ emb[i], w.norm_key, c, w.eps).reshape(c, d)
        query = grouped_rms_norm(streams[i].reshape(-1), w.norm_query, c, w.eps).reshape(c, d)
        v = w.value_proj @ emb[i]
        u = []
        for h in range(c):
            g = float((key[h] * query[h]).sum()) / math.sqrt(d)
            g = math.copysign(math.sqrt(max(abs(g), 1e-6)), g) if g != 0 else 0.0
            u.append(v / (1 + math.exp(-g)))
        u = torch.cat(u)
        u_hats.append(grouped_rms_norm(u, w.norm_conv, c, w.eps))
        conv = torch.zeros(c * d)
        for j in range(w.conv.shape[1]):
            back = (w.conv.shape[1] - 1 - j) * w.dilation
            if i - back >= 0:
                conv += w.conv[:, j] * u_hats[i - back]
        out.append(u + torch.nn.functional.silu(conv))
    return torch.stack(out)


def test_ple_delta_equals_the_formulas_token_by_token():
    w = _weights()
    g = torch.Generator().manual_seed(1)
    emb, streams = torch.randn(14, 12, generator=g), torch.randn(14, 2, 8, generator=g)
    delta, history = ple_delta(emb, streams, w)
    torch.testing.assert_close(delta, _naive_delta(emb, streams, w), rtol=1e-5, atol=1e-5)
    assert history.shape == (9, 16)


@pytest.mark.parametrize("cut", [1, 4, 9, 11])
def test_ple_delta_in_chunks_with_the_carried_history_equals_the_whole(cut):
    w = _weights()
    g = torch.Generator().manual_seed(2)
    emb, streams = torch.randn(13, 12, generator=g), torch.randn(13, 2, 8, generator=g)
    whole, hist_whole = ple_delta(emb, streams, w)
    first, hist = ple_delta(emb[:cut], streams[:cut], w)
    parts = [first]
    for i in range(cut, 13):  # decode: one token at a time
        d, hist = ple_delta(emb[i:i + 1], streams[i:i + 1], w, hist)
        parts.append(d)
    # equal up to the summation order of a matmul over T rows against one row
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hist, hist_whole, rtol=1e-5, atol=1e-6)


def test_ple_delta_is_causal():
    w = _weights()
    g = torch.Generator().manual_seed(3)
    emb, streams = torch.randn(10, 12, generator=g), torch.randn(10, 2, 8, generator=g)
    base, _ = ple_delta(emb, streams, w)
    emb2 = emb.clone()
    emb2[-1] += 1.0
    changed, _ = ple_delta(emb2, streams, w)
    assert torch.equal(changed[:-1], base[:-1]) and not torch.equal(changed[-1], base[-1])


def test_ple_delta_refuses_a_stream_count_it_was_not_built_for():
    with pytest.raises(ValueError, match="streams"):
        ple_delta(torch.zeros(2, 12), torch.zeros(2, 3, 8), _weights())


LENGTHS = [1, 5, 2, 12, 1]
"""A batch's sequence lengths: shorter and longer than the n-gram context and the conv history."""


def test_batched_windows_equal_each_sequence_hashed_alone():
    """EngramHashing.windows + rows_of_windows over a packed batch (carried contexts, EOS ids inside
    and in the contexts, sequences shorter than the context) = `rows` per sequence."""
    h = EngramHashing()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (sum(LENGTHS),), generator=g)
    ids[[2, 9, 14]] = EOS
    contexts = torch.tensor([[EOS, EOS], [7, EOS], [EOS, 8], [11, 12], [13, 14]])
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    windows, after = h.windows(ids, contexts, cu)
    got = h.rows_of_windows(windows)
    for b in range(len(LENGTHS)):
        want, ctx = h.rows(ids[cu[b]:cu[b + 1]], contexts[b].tolist())
        assert torch.equal(got[cu[b]:cu[b + 1]], want), b
        assert after[b].tolist() == ctx, b


def _packed(seed: int) -> tuple:
    """(weights, emb [T, 12], streams [T, 2, 8], histories [B, 9, 16], cu_seqlens) of the LENGTHS sequences."""
    w = _weights()
    c, d, e = 2, 8, 12
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    emb, streams = torch.randn(t, e, generator=g), torch.randn(t, c, d, generator=g)
    histories = torch.randn(len(LENGTHS), w.history, c * d, generator=g)
    return w, emb, streams, histories, torch.tensor([0] + LENGTHS).cumsum(0)


def test_batched_ple_delta_equals_each_sequence_alone():
    """ple_delta_batched over a packed batch with carried histories = ple_delta per sequence (deltas and
    new histories), sequences shorter and longer than the 9-token history."""
    w, emb, streams, histories, cu = _packed(seed=4)
    delta, new = ple_delta_batched(emb, streams, w, histories, cu)
    for b in range(len(LENGTHS)):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        want, hist = ple_delta(emb[sl], streams[sl], w, histories[b])
        torch.testing.assert_close(delta[sl], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(new[b], hist, rtol=1e-6, atol=1e-6)  # (batched GEMMs: last-bit differences)


def test_batched_ple_delta_in_chunks_gives_the_same_bits():
    """ple_delta_batched's chunks (gate, conv inputs, conv) change no bit of the delta or the histories on the
    CPU, at chunk lengths shorter than a sequence, than the history, and longer than the batch."""
    w, emb, streams, histories, cu = _packed(seed=5)
    t = emb.shape[0]
    whole, whole_new = ple_delta_batched(emb, streams, w, histories, cu, chunk_tokens=t)
    for step in (1, 3, 7, 10, t + 5):
        delta, new = ple_delta_batched(emb, streams, w, histories, cu, chunk_tokens=step)
        assert torch.equal(delta, whole), step
        assert torch.equal(new, whole_new), step


def test_the_ple_chunk_bounds_its_temporaries():
    """Chunks of about PLE_CHUNK_BYTES of fp32 temporaries at Flash-Next's width (4 streams of 2,560), never
    under 16 tokens."""
    n = ple_chunk_tokens(4, 2560)
    assert 6 * 4 * 4 * 2560 * n <= PLE_CHUNK_BYTES < 6 * 4 * 4 * 2560 * (n + 1)
    assert ple_chunk_tokens(4, 1 << 30) == 16


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _PeakBytes(TorchFunctionMode):
    """The most bytes of tensor storage that torch calls made inside the mode held at once (storages first seen
    as an argument, the inputs, not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.seen_inputs: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in _tensors((args, kwargs or {})):
            if a.untyped_storage().data_ptr() not in self.live:
                self.seen_inputs.add(a.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            s = t.untyped_storage()
            key = s.data_ptr()
            if key in self.live or key in self.seen_inputs or not s.nbytes():
                continue
            self.live[key] = s.nbytes()
            self.now += s.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(s, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def test_batched_ple_delta_holds_its_temporaries_to_a_chunk():
    """Beside its inputs, a chunked ple_delta_batched holds the gated values, the conv's input rows and the
    value projection for the whole batch plus about one chunk's temporaries (`ple_chunk_tokens`' six fp32 rows
    of C x D a token, with slack for the index tensors); unchunked, the temporaries scale with the batch."""
    c, d, e, t, chunk = 4, 64, 48, 2048, 64
    g = torch.Generator().manual_seed(6)
    w = PLEWeights(key_proj=torch.randn(c * d, e, generator=g) * 0.02, value_proj=torch.randn(d, e, generator=g) * 0.02,
                   norm_key=torch.zeros(c * d), norm_query=torch.zeros(c * d), norm_conv=torch.zeros(c * d),
                   conv=torch.randn(c * d, 4, generator=g) * 0.1, streams=c)
    emb, streams = torch.randn(t, e, generator=g), torch.randn(t, c, d, generator=g)
    histories = torch.randn(3, w.history, c * d, generator=g)
    cu = torch.tensor([0, 100, 1500, t])
    whole = (t * (2 * c * d + d) + 3 * w.history * c * d) * 4
    bound = whole + chunk * 10 * 4 * c * d
    peaks = {}
    for step in (chunk, t):
        with _PeakBytes() as meter:
            ple_delta_batched(emb, streams, w, histories, cu, chunk_tokens=step)
        peaks[step] = meter.peak
    assert whole < peaks[chunk] <= bound, peaks
    assert peaks[t] > bound + t * 3 * 4 * c * d, peaks  # (what the chunks save: several fp32 rows a token)


def test_the_activation_reserve_holds_the_prefill_ple():
    """Flash-Next's reserve (`activation_reserve`) per prefill token holds the Triton PLE's key/value projection,
    u and u_hat (3 C x hidden + hidden) where the widest projection's two are fewer; where the torch form runs
    (the default, and the CPU always) one chunk of its temporaries too, beyond the MoE's workspace. The seeds' geometry: C x hidden = 10,240 > 2 x 16,384 / 3."""
    from ft.engine.ranks.loader import activation_reserve
    from ft.kernels.moe import moe_workspace_bytes
    from ft.kernels.options import use_kernel_options, variant
    from ft.model.config import ModelConfig

    path = "bench/configs/qwen3.8-flash-next-small-table.json"
    cfg = ModelConfig.from_file(path)
    plain = ModelConfig.from_file(path, {"text_config": {"ple_layer_ids": []}})
    assert cfg.flash_next.ple_layers and not plain.flash_next.ple_layers
    bf16, cuda, cpu = torch.bfloat16, torch.device("cuda"), torch.device("cpu")
    tokens, hidden, streams = 4096, cfg.hidden_size, cfg.flash_next.hc_count
    extra = (3 * streams * hidden + hidden - 2 * 16384) * 2
    assert extra > 0
    chunk = ple_chunk_tokens(streams, hidden) * 6 * 4 * streams * hidden
    with use_kernel_options(variant("ple-prefill-triton")):
        assert activation_reserve(cfg, bf16, cuda, tokens, 8) - activation_reserve(plain, bf16, cuda, tokens, 8) == \
            tokens * extra
        assert activation_reserve(cfg, bf16, cpu, tokens, 8) - activation_reserve(plain, bf16, cpu, tokens, 8) == \
            tokens * extra + chunk
    for device in (cuda, cpu):  # the torch form by default
        assert activation_reserve(cfg, bf16, device, tokens, 8) - activation_reserve(plain, bf16, device, tokens, 8) \
            == tokens * extra + max(0, chunk - (moe_workspace_bytes(tokens, 10, hidden, 640) if device == cuda else 0))
