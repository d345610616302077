"""Qwen3.8-Flash-Next's language model over the engine's pools: HyperConnections around Gated DeltaNet
and QSA attention layers, a sparse MoE in every layer, the Engram PLE layer.

What runs where (issue 38; docs/qwen3.8-flash-next/README.md is the plan):
- Gated DeltaNet: the Qwen3-Next layer (`GatedDeltaNet`) over the mamba pool, its split projections
  stacked into the fused ones and the gated norm's activation a sigmoid.
- QSA attention (`QSAAttention`): the gated attention layer over the paged KV cache, each token's raw
  indexer key stored beside its K and V (`KVPool.index_keys`). Up to 2,051 tokens of context the
  indexer selects every token and a prefill runs the dense kernels; a decode step, and a prefill past
  the span, select and attend sparsely (`ft.kernels.qsa`, `sparse_decode_attention`).
- MoE: `SparseMoE` over the expert cache (softmax, top-k, renormalised), the routed experts read from
  the checkpoint's grouped tensors into the host store.
- HyperConnections: `ft.model.layers.hyper_connection` over `ft.kernels.hyper_connection` (each
  write and the next read's norm in one launch; a read of up to 64 tokens fused in Triton, longer ones
  cuBLAS GEMMs: `HyperConnectionOptions`).
- The PLE layer: `ft.model.layers.engram` (the math, in torch: a prefill's packed batch) and
  `ft.kernels.engram` (a decode step in five launches). The n-gram table stays in host memory
  (pinned beside a GPU) in the checkpoint's dtype; a step gathers the rows its tokens hash to. Each
  sequence's n-gram context and PLE conv history are states of its mamba slot (`MambaPool.extra`),
  so chunked prefill, the prefix cache and rebuilds carry them; the hashing, the gather
  (`ft.kernels.host_gather`) and the conv run on the device, with no host read.

Not yet (said at load, not hidden): prefill CUDA graphs (decode steps are captured), tensor
parallelism, NVFP4 experts stored grouped (per-expert NVFP4 tensors load), NVFP4 split GDN
projections of different global scales. Checked token for token against the
whole-sequence reference (`ft.model.qwen3_8_flash_next_reference`, itself checked against the public
implementation): tests/test_flash_next_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.errors import UnsupportedModelError
from ft.model.checkpoint import GroupedExperts, LoadedWeights, TensorSpec
from ft.model.config import ModelConfig
from ft.model.forward_batch import ForwardBatch
from ft.model.layers.attention import Rope
from ft.model.layers.qsa_attention import QSAAttention
from ft.kernels.engram import ngram_rows_decode, ple_decode, ple_prefill, ple_prefill_on_triton
from ft.kernels.host_gather import gather_rows
from ft.kernels.options import model_defaults, use_kernel_options
from ft.kernels.slot_write import write_slots
from ft.model.layers.embedding import embed_tokens
from ft.model.layers.engram import EngramHashing, PLEWeights, ple_delta_batched
from ft.model.ngram_reader import HostNgramReader
from ft.model.paged_table import PagedTable
from ft.model.layers.gated_deltanet import GatedDeltaNet
from ft.model.layers.hyper_connection import HyperConnection, expand_streams
from ft.model.layers.linear import Linear
from ft.model.layers.moe import MLP, SparseMoE
from ft.model.layers.rotary import rope_frequencies
from ft.model.qwen3_next import gated_attention_specs, gated_deltanet_specs
from ft.memory.cache_pools import CachePools
from ft.memory.mamba_pool import SlotState

ROOT = "model.language_model."
TABLE_SUFFIX = "ple.ple_embedding.ngram_embedding.weight"
ENGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
"""The PLE embedding's int64 buffers a checkpoint may store: checked against `EngramHashing`."""


def hashing_of(cfg: ModelConfig) -> EngramHashing:
    t = cfg.flash_next
    return EngramHashing(ngram_size=t.ngram_size, heads_per_ngram=t.heads_per_ngram,
                         vocab_size_base=t.ngram_vocab_size_base, divisible_by=t.make_ngram_vocab_size_divisible_by,
                         eos_token_id=t.eos_token_id)


def _hc_specs(s: dict, prefix: str, width: int, streams: int, rank: int, write: bool = True) -> None:
    s[prefix + "hc_norm.weight"] = TensorSpec((width,))
    s[prefix + "input_mix_weight_down.weight"] = TensorSpec((rank, width))
    s[prefix + "input_mix_weight_up.weight"] = TensorSpec((width, rank))
    if write:
        s[prefix + "block_inject_weight.weight"] = TensorSpec((streams, width))


def tensor_specs(cfg: ModelConfig) -> tuple[dict[str, TensorSpec], list[GroupedExperts]]:
    """Every checkpoint tensor of `cfg` (Hugging Face names -> spec) and each MoE layer's grouped
    experts. The n-gram table is kind "host" (kept in host memory); the Engram's hash buffers are
    "optional" (checked where present)."""
    t = cfg.flash_next
    h, v, c, hc_rank = cfg.hidden_size, cfg.vocab_size, t.hc_count, t.hc_lowrank
    width = c * h
    s: dict[str, TensorSpec] = {ROOT + "embed_tokens.weight": TensorSpec((v, h)), "lm_head.weight": TensorSpec((v, h), "linear")}
    experts = []
    for i in range(cfg.num_hidden_layers):
        p = f"{ROOT}layers.{i}."
        _hc_specs(s, p + "attn_hyper_connection.", width, c, hc_rank)
        _hc_specs(s, p + "mlp_hyper_connection.", width, c, hc_rank)
        if i in t.ple_layers:
            hashing = hashing_of(cfg)
            e = p + "ple."
            embed = t.ple_embed_dim or h  # a token's rows concatenated
            if embed % hashing.num_heads:
                raise UnsupportedModelError(f"config.json: ple_embed_dim {embed} is not a multiple of the "
                                            f"{hashing.num_heads} n-gram heads")
            s[p + TABLE_SUFFIX] = TensorSpec((hashing.padded_rows, embed // hashing.num_heads),
                                                                      "host")
            for name, n in zip(ENGRAM_BUFFERS, (t.ngram_size, hashing.num_heads, hashing.num_heads)):
                s[e + "ple_embedding." + name] = TensorSpec((n,), "optional")
            s[e + "key_proj.weight"] = TensorSpec((width, embed))
            s[e + "value_proj.weight"] = TensorSpec((h, embed))
            for name in ("norm_key", "norm_query", "norm_conv"):
                s[e + name + ".weight"] = TensorSpec((width,))
            s[e + "conv1d.weight"] = TensorSpec((width, 1, t.ple_conv_kernel_size))
        if cfg.layer_types[i] == "linear_attention":
            a = p + "linear_attn."
            hv = cfg.linear_num_value_heads
            s[a + "in_proj_qkv.weight"] = TensorSpec((2 * cfg.linear_key_dim + cfg.linear_value_dim, h), "linear")
            s[a + "in_proj_z.weight"] = TensorSpec((cfg.linear_value_dim, h), "linear")
            s[a + "in_proj_b.weight"] = TensorSpec((hv, h), "linear")
            s[a + "in_proj_a.weight"] = TensorSpec((hv, h), "linear")
            gated_deltanet_specs(s, a, cfg)
        else:
            a = p + "self_attn."
            gated_attention_specs(s, a, cfg)
            hi, di = t.indexer_n_heads, t.indexer_head_dim
            s[a + "indexer.index_qk_proj.weight"] = TensorSpec(((hi + 1) * di, h), "linear")
            s[a + "indexer.q_layernorm.weight"] = TensorSpec((di,))
            s[a + "indexer.k_layernorm.weight"] = TensorSpec((di,))
        m = p + "mlp."
        e_i, sh, n_e = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts
        s[m + "gate.weight"] = TensorSpec((n_e, h), "linear")
        s[m + "shared_expert_gate.weight"] = TensorSpec((1, h), "linear")
        for name, shape in (("gate_proj", (sh, h)), ("up_proj", (sh, h)), ("down_proj", (h, sh))):
            s[f"{m}shared_expert.{name}.weight"] = TensorSpec(shape, "linear")
        group = GroupedExperts(m + "experts.gate_up_proj", m + "experts.down_proj")
        s[group.gate_up] = TensorSpec((n_e, 2 * e_i, h), "expert")
        s[group.down] = TensorSpec((n_e, h, e_i), "expert")
        experts.append(group)
    _hc_specs(s, ROOT + "hyper_connection_mixer.", width, c, hc_rank, write=False)
    return s, experts


def expert_layout(specs: dict[str, TensorSpec], groups: list[GroupedExperts], reader) -> tuple[dict, list]:
    """The experts as `reader`'s checkpoint stores them: grouped per layer (the released bf16 layout:
    `specs` and `groups` unchanged), or one tensor per expert and projection
    (`...experts.{e}.{gate,up,down}_proj.weight`, dense or NVFP4 as ModelOpt writes MoE experts): then
    the specs of those and, per layer, each expert's (gate, up, down) names."""
    if not groups or groups[0].gate_up in reader:
        return specs, groups
    out = {n: s for n, s in specs.items() if n not in {x for g in groups for x in (g.gate_up, g.down)}}
    per_layer = []
    for g in groups:
        n_e, two_i, h = specs[g.gate_up].shape
        prefix = g.gate_up.removesuffix("gate_up_proj")
        layer = []
        for e in range(n_e):
            names = tuple(f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down"))
            out[names[0]] = out[names[1]] = TensorSpec((two_i // 2, h), "expert")
            out[names[2]] = TensorSpec((h, two_i // 2), "expert")
            layer.append(names)
        per_layer.append(layer)
    return out, per_layer


@dataclass
class _PLE:
    table: torch.Tensor | PagedTable  # [rows, width] in host memory, the checkpoint's dtype (or mapped from disk)
    weights: PLEWeights
    key_value: torch.Tensor  # [C*D + D, E]: key_proj's rows then value_proj's (the weights' two are views of it)


@dataclass
class _Layer:
    ple: _PLE | None
    attn_hc: HyperConnection
    mixer: QSAAttention | GatedDeltaNet
    mlp_hc: HyperConnection
    moe: SparseMoE


class FlashNextModel:
    """forward(batch, pools) -> logits [B, vocab] (float32) at each sequence's last new token."""

    graph_safe = True
    """A decode step may be captured in a CUDA graph: QSA decodes in fixed shapes at every length (block
    scores over the context limit's blocks, a top-k, one sparse attention launch), the PLE's and the indexer
    keys' writes skip rows without a slot (`write_slots`: a graph's padding rows carry slot -1),
    HyperConnections and the MoE are device ops. tests/gpu/test_flash_next_cuda.py checks graph
    replays against eager steps."""
    decode_graph_pdl = True
    """Its decode graphs capture with programmatic dependent launch (`ft.kernels.pdl`; every kernel of the
    step takes it): +9% tok/s at batch 1, +3% at 8 against plain launches (H100, 40 layers, session 41)."""
    kernel_defaults = (("nvfp4.dot_f16_x_max_m", 64),)
    """Its choices among the kernel options whose default is "the model's" (`ft.kernels.options.model_defaults`,
    in force around `forward`): bf16 activations of at most 64 rows as fp16 rows on the NVFP4 tile (H100, 40
    layers: +3.3% tok/s at batch 8 for the 16-row tile, session 49; +2.1% at batch 32 for the mid-M tiles,
    session 50; `Nvfp4Options.dot_f16_x_max_m`)."""
    prefill_graph_safe = False
    """Prefill graphs (`ft.engine.worker.prefill_graphs`) stay off: QSA past its dense span selects per
    sequence on the host, and its attention does not hand its cores to a capture (`batch.pieces`)."""

    def __init__(self, cfg: ModelConfig, weights: LoadedWeights, dtype: torch.dtype, device: torch.device,
                 tp=None) -> None:
        if tp is not None:
            raise UnsupportedModelError("Qwen3.8-Flash-Next does not run under tensor parallelism yet "
                                        "(--tensor-parallel-size 1)")
        self.cfg, self.text, self.dtype, self.device, self.tp = cfg, cfg.flash_next, dtype, device, None
        t, w = self.text, weights.tensors
        tables = frozenset(n for n in w if n.endswith(TABLE_SUFFIX))  # (kind "host": host memory on every device)
        # (and the embedding in host memory when the loader moved it, `load_model`)
        self.resident_bytes, self.host_tables = weights.placed_bytes(ROOT + "embed_tokens.weight", tables)
        self.embed = w[ROOT + "embed_tokens.weight"]
        self.embed_on_host = ROOT + "embed_tokens.weight" in weights.on_host
        self.host_bytes = sum(self.host_tables.values())
        # an n-gram table mapped from the checkpoint's files (`ft.model.paged_table`): the host reads each
        # step's rows (`ngram_reader`), so its tokens must be on the host before its forward runs
        paged = [w[n] for n in tables if isinstance(w[n], PagedTable)]
        if len(paged) > 1:  # (`ForwardBatch.ngram_rows` carries one table's rows)
            raise UnsupportedModelError(f"{len(paged)} n-gram tables read from disk: one is supported "
                                        "(--ngram-table host keeps them in host memory)")
        self.paged_table: PagedTable | None = paged[0] if paged else None
        self.disk_tables = {"n-gram table": self.paged_table.nbytes} if paged else {}
        self.ngram_reader: HostNgramReader | None = None  # (made with the hashing, below)
        self.vocab_lo = None
        self.streams, self.eps = t.hc_count, cfg.rms_norm_eps
        self.lm_head = Linear(w["lm_head.weight"])
        self.final_read = self._hc(w, ROOT + "hyper_connection_mixer.", write=False)
        inv_freq, scale = rope_frequencies(t, cfg.rotary_dim)
        self.rope = Rope(cfg.rotary_dim, inv_freq.to(device), scale)
        self.index_key_dim = t.indexer_head_dim  # QSA's raw indexer key per token and attention layer
        self.hashing = hashing_of(cfg) if t.ple_layers else None
        if self.hashing is not None:
            self._check_hash_buffers(w)
        if self.paged_table is not None:  # the host reads each step's rows (`ForwardBatch.ngram_rows`)
            self.ngram_reader = HostNgramReader(self.hashing, self.paged_table)
        self.layers = [self._build_layer(i, w) for i in range(cfg.num_hidden_layers)]
        self.top_k = cfg.num_experts_per_tok
        self.moe_pairs_per_token = self.top_k * cfg.num_hidden_layers
        self.kind_index = {i: n for kinds in (cfg.full_attention_layers, cfg.linear_attention_layers)
                           for n, i in enumerate(kinds)}
        width = self.streams * cfg.hidden_size
        # each sequence's n-gram context (the ids + 1 of its last ngram_size - 1 tokens, 0: none, read as
        # the EOS id: a zeroed slot is a sequence's start) and the PLE conv's input history
        self.slot_states = () if self.hashing is None else (
            SlotState("ngram_context", (self.hashing.context_len,), torch.int64),
            SlotState("ple_conv", (self.layers[t.ple_layers[0]].ple.weights.history, width), dtype),
        )

    def _hc(self, w: dict, prefix: str, write: bool = True) -> HyperConnection:
        # (down and inject are popped: the module stacks them into one tensor, and the originals are
        # freed as it goes instead of all at the end of the load)
        return HyperConnection(norm=w[prefix + "hc_norm.weight"], down=w.pop(prefix + "input_mix_weight_down.weight"),
                               up=w[prefix + "input_mix_weight_up.weight"],
                               inject=w.pop(prefix + "block_inject_weight.weight") if write else None,
                               streams=self.streams, eps=self.eps)

    def _check_hash_buffers(self, w: dict) -> None:
        """The Engram's stored hash constants, where the checkpoint has them, are the ones we hash with."""
        from ft.errors import CheckpointError

        hs = self.hashing
        want = {"layer_multipliers": list(hs.multipliers[: hs.ngram_size]), "ngram_heads_vocab_sizes": list(hs.sizes),
                "ngram_heads_offsets": list(hs.offsets)}
        for name, value in w.items():
            buf = name.rsplit(".", 1)[-1]
            if buf in want and value.tolist() != want[buf]:
                raise CheckpointError(f"{name}: {value.tolist()[:4]}... differs from the n-gram hash this config "
                                      f"gives ({want[buf][:4]}...): its ngram_* fields do not match the table")

    def _build_layer(self, i: int, w: dict) -> _Layer:
        cfg, t, p = self.cfg, self.text, f"{ROOT}layers.{i}."
        L = lambda name: Linear(w[p + name])  # noqa: E731
        ple = None
        if i in t.ple_layers:
            e = p + "ple."
            # (key and value projections stacked: a decode step's one GEMM; popped so the originals go)
            key_value = torch.cat([w.pop(e + "key_proj.weight"), w.pop(e + "value_proj.weight")])
            width = self.streams * cfg.hidden_size
            ple = _PLE(w[p + TABLE_SUFFIX], PLEWeights(
                key_proj=key_value[:width], value_proj=key_value[width:],
                norm_key=w[e + "norm_key.weight"], norm_query=w[e + "norm_query.weight"],
                norm_conv=w[e + "norm_conv.weight"], conv=w[e + "conv1d.weight"][:, 0], streams=self.streams,
                dilation=t.ngram_size, eps=self.eps), key_value)
        if cfg.layer_types[i] == "linear_attention":
            a = p + "linear_attn."
            def stacked(*names: str) -> Linear:  # the split projections as the fused layer reads them
                try:
                    return Linear.stacked([w[a + n + ".weight"] for n in names])
                except ValueError as e:
                    raise UnsupportedModelError(f"{a}{{{','.join(names)}}}: {e}") from None

            mixer = GatedDeltaNet(
                stacked("in_proj_qkv", "in_proj_z"), stacked("in_proj_b", "in_proj_a"), w[a + "conv1d.weight"],
                Linear(w[a + "out_proj.weight"]), w[a + "norm.weight"], w[a + "A_log"], w[a + "dt_bias"],
                cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.rms_norm_eps, rows_per_head=False, output_gate="sigmoid",
            )
        else:
            a = "self_attn."
            mixer = QSAAttention(
                L(a + "q_proj.weight"), L(a + "k_proj.weight"), L(a + "v_proj.weight"), L(a + "o_proj.weight"),
                w[p + a + "q_norm.weight"], w[p + a + "k_norm.weight"], cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, L(a + "indexer.index_qk_proj.weight"),
                w[p + a + "indexer.q_layernorm.weight"], w[p + a + "indexer.k_layernorm.weight"], t.indexer_n_heads,
                t.indexer_head_dim, t.indexer_budget, t.indexer_compress_ratio,
            )
        m = "mlp."
        shared = MLP(L(m + "shared_expert.gate_proj.weight"), L(m + "shared_expert.up_proj.weight"),
                     L(m + "shared_expert.down_proj.weight"))
        moe = SparseMoE(L(m + "gate.weight"), shared, L(m + "shared_expert_gate.weight"), cfg.num_experts_per_tok,
                        cfg.norm_topk_prob, cfg.moe_layers.index(i))
        return _Layer(ple, self._hc(w, p + "attn_hyper_connection."), mixer, self._hc(w, p + "mlp_hyper_connection."), moe)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        """Logits [B, V] float32 of each sequence's last new token (with `kernel_defaults` in force)."""
        with use_kernel_options(model_defaults(self.kernel_defaults)):
            return self._forward(batch, pools)

    def _forward(self, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        x = expand_streams(embed_tokens(self.embed, batch.input_ids, self.embed_on_host, self.dtype), self.streams)
        u = gates = None  # the next block's input and gate logits, when the write before it also read
        live = batch.decode.slot_mapping if batch.decode is not None else None  # padding rows: -1 (the MoE skips them)
        for i, layer in enumerate(self.layers):
            if layer.ple is not None:
                x = self._ple(layer.ple, x, batch, pools)
                u = None
            if u is None:
                u, gates = layer.attn_hc.read(x)
            j = self.kind_index[i]
            if isinstance(layer.mixer, QSAAttention):
                y = layer.mixer(u, self.rope, batch, pools.kv.layer(j), pools.kv.index_layer(j))
            else:
                y = layer.mixer(u, batch, pools.mamba.conv[:, j], pools.mamba.ssm[:, j])
            # each write with the read after it (its norm in the write's launch, or at one token the write in
            # the read's first launch: `HyperConnection.write_read`)
            x, u, gates = layer.attn_hc.write_read(y, x, gates, layer.mlp_hc)
            forced = None if batch.forced_experts is None else batch.forced_experts[:, layer.moe.moe_index]
            y = layer.moe(u, pools.experts, forced=forced, live=live)
            after = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if after is not None and after.ple is None:
                x, u, gates = layer.mlp_hc.write_read(y, x, gates, after.attn_hc)
            else:  # (the PLE delta comes before the next read; the final read takes the last rows only)
                x, u = layer.mlp_hc.write(y, x, gates), None
        u, _ = self.final_read.read(x[batch.last_token_index])  # (no final norm: the read is the model's end)
        return self.lm_head(u).float()

    def _ple(self, ple: _PLE, x: torch.Tensor, batch: ForwardBatch, pools: CachePools) -> torch.Tensor:
        """x [T, C*D] plus the PLE delta of every new token, from its ids' table rows, its sequence's
        n-gram context and conv history (read from its mamba slot and written back). Device ops only, no
        host read: the table rows are read from host memory by the device (`gather_rows`). A decode
        step in five launches (`ft.kernels.engram`: the hashing, the gather, one GEMM, the gate, the
        conv); a prefill hashes the packed batch in torch and adds the delta in torch in chunks
        (`ple_delta_batched`), or with `EngramOptions.prefill_triton` in two Triton launches (`ple_prefill`)."""
        hs, eos, w = self.hashing, self.text.eos_token_id, ple.weights
        slots = batch.mamba_slots
        contexts, histories = pools.mamba.extra["ngram_context"], pools.mamba.extra["ple_conv"]
        if batch.decode is not None:  # (a graph's padding rows, slot -1, read empty states and write none)
            sizes, offsets = hs.head_tensors(x.device)  # (with a paged table too: the kernel moves the contexts on)
            rows = ngram_rows_decode(batch.input_ids, contexts, slots, hs.multipliers, sizes, offsets,
                                     hs.heads_per_ngram, eos)
            if batch.ngram_rows is None:
                emb = gather_rows(ple.table, rows, x.dtype)
            else:  # read by the host (a paged table)
                if batch.ngram_gate is not None:  # filled while this step runs: the stream waits for them here
                    batch.ngram_gate()
                emb = batch.ngram_rows.to(x.dtype)
            key_value = F.linear(emb, ple.key_value)
            return ple_decode(x, key_value, histories, slots, w.norm_key, w.norm_query, w.norm_conv, w.conv,
                              self.streams, w.dilation, w.eps)
        cu = batch.cu_seqlens
        stored = contexts[slots]  # ids + 1, 0: none (the EOS id)
        windows, after = hs.windows(batch.input_ids, torch.where(stored == 0, eos, stored - 1), cu)
        emb = gather_rows(ple.table, hs.rows_of_windows(windows), x.dtype) if batch.ngram_rows is None \
            else batch.ngram_rows.to(x.dtype)
        if ple_prefill_on_triton(x, self.streams):  # (two launches, no fp32 temporaries; off until run on a GPU)
            out, history = ple_prefill(x, F.linear(emb, ple.key_value), histories[slots], cu, w.norm_key, w.norm_query,
                                       w.norm_conv, w.conv, self.streams, w.dilation, w.eps)
        else:  # (the batched torch form, in chunks: run on an H100)
            delta, history = ple_delta_batched(emb, x.reshape(x.shape[0], self.streams, -1), w, histories[slots], cu)
            out = x + delta
        write_slots(contexts, slots, after + 1)
        write_slots(histories, slots, history)
        return out
