"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet + gated attention layers, sparse MoE.

The model is plain tensors and small layer objects; its caches live in the pools it is given
(`CachePools`): the paged KV pool, the mamba state pool and the expert cache. Checked token for
token against transformers' implementation (tests/test_oracle.py).
"""

from __future__ import annotations

import torch

from ft.model.checkpoint import LoadedWeights, TensorSpec
from ft.model.config import ModelConfig
from ft.errors import UnsupportedModelError
from ft.kernels.norm import add_rms_norm, rms_norm
from ft.model.forward_batch import ForwardBatch
from ft.model.layers.attention import GatedAttention
from ft.model.layers.embedding import embed_tokens
from ft.model.layers.gated_deltanet import GatedDeltaNet
from ft.model.layers.linear import Linear
from ft.model.layers.moe import MLP, SparseMoE
from ft.model.layers.attention import Rope
from ft.model.layers.rotary import rope_inv_freq
from ft.memory.cache_pools import CachePools


def tensor_specs(cfg: ModelConfig) -> tuple[dict[str, TensorSpec], list[list[tuple[str, str, str]]]]:
    """Every checkpoint tensor of `cfg` (name -> spec), and the routed experts' names per MoE layer."""
    if cfg.attention_bias:
        raise UnsupportedModelError("attention_bias=true is not supported")
    h, v = cfg.hidden_size, cfg.vocab_size
    s: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((v, h))}
    experts: list[list[tuple[str, str, str]]] = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = TensorSpec((h,))
        s[p + "post_attention_layernorm.weight"] = TensorSpec((h,))
        if kind == "linear_attention":
            a = p + "linear_attn."
            hv = cfg.linear_num_value_heads
            s[a + "in_proj_qkvz.weight"] = TensorSpec((2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, h), "linear")
            s[a + "in_proj_ba.weight"] = TensorSpec((2 * hv, h), "linear")
            gated_deltanet_specs(s, a, cfg)
        else:
            gated_attention_specs(s, p + "self_attn.", cfg)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            e_i, sh = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            s[m + "gate.weight"] = TensorSpec((cfg.num_experts, h), "linear")
            s[m + "shared_expert_gate.weight"] = TensorSpec((1, h), "linear")
            _mlp_specs(s, m + "shared_expert.", h, sh, "linear")
            layer = []
            for e in range(cfg.num_experts):
                names = _mlp_specs(s, f"{m}experts.{e}.", h, e_i, "expert")
                layer.append(names)
            experts.append(layer)
        else:
            _mlp_specs(s, m, h, cfg.intermediate_size, "linear")
    s["model.norm.weight"] = TensorSpec((h,))
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = TensorSpec((v, h), "linear")
    return s, experts


def gated_deltanet_specs(s: dict[str, TensorSpec], a: str, cfg: ModelConfig) -> None:
    """A Gated DeltaNet layer's tensors under prefix `a` beside its input projections (which the
    models lay out differently): the conv, the output projection, the gated norm, the decay."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    s[a + "conv1d.weight"] = TensorSpec((cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim))
    s[a + "out_proj.weight"] = TensorSpec((h, cfg.linear_value_dim), "linear")
    s[a + "norm.weight"] = TensorSpec((cfg.linear_value_head_dim,))
    s[a + "dt_bias"] = TensorSpec((hv,))
    s[a + "A_log"] = TensorSpec((hv,))


def gated_attention_specs(s: dict[str, TensorSpec], a: str, cfg: ModelConfig) -> None:
    """A gated attention layer's tensors under prefix `a`: q with its gate, k, v, o, the q/k norms."""
    h, hq, hk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    s[a + "q_proj.weight"] = TensorSpec((2 * hq * d, h), "linear")
    s[a + "k_proj.weight"] = TensorSpec((hk * d, h), "linear")
    s[a + "v_proj.weight"] = TensorSpec((hk * d, h), "linear")
    s[a + "o_proj.weight"] = TensorSpec((h, hq * d), "linear")
    s[a + "q_norm.weight"] = TensorSpec((d,))
    s[a + "k_norm.weight"] = TensorSpec((d,))


def _mlp_specs(s: dict, prefix: str, h: int, inter: int, kind: str) -> tuple[str, str, str]:
    names = (prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight")
    s[names[0]] = TensorSpec((inter, h), kind)
    s[names[1]] = TensorSpec((inter, h), kind)
    s[names[2]] = TensorSpec((h, inter), kind)
    return names


class Qwen3NextModel:
    """forward(batch, pools) -> logits [B, vocab] (float32) at each sequence's last new token."""

    graph_safe = True  # a decode step may be captured in a CUDA graph
    # its decode graphs launch plainly: with PDL (`ft.kernels.pdl`) -6% tok/s at batch 1, a tie at 8, -2% at 32
    # (H100, session 41)
    decode_graph_pdl = False
    prefill_graph_safe = True  # its attention hands its cores to a prefill graph's capture (`batch.pieces`)
    paged_table = None  # no table the host reads rows from for each step (Flash-Next's, `ft.model.paged_table`)
    slot_states = ()  # no per-sequence state beside the GDN layers' (`MambaPool.extra`)
    index_key_dim = 0  # no QSA indexer keys in the KV pool

    def __init__(self, cfg: ModelConfig, weights: LoadedWeights, dtype: torch.dtype, device: torch.device,
                 tp=None) -> None:
        # with tensor parallelism (`tp`, a `ft.parallel.TPGroup`): cfg is this rank's shard's config
        # (`ft.model.tp_shard.local_config`), the weights its shard; partial sums are all-reduced
        self.cfg, self.dtype, self.device, self.tp = cfg, dtype, device, tp
        w = weights.tensors
        # Bytes of every weight kept on the device (not the routed experts, not the tensors the loader kept in
        # host memory: the embedding with --embedding-on-host, `load_model`), and those in host memory by what
        # they are
        self.resident_bytes, self.host_tables = weights.placed_bytes("model.embed_tokens.weight")
        self.embed = w["model.embed_tokens.weight"]
        self.embed_on_host = "model.embed_tokens.weight" in weights.on_host
        self.host_bytes = sum(self.host_tables.values())
        # tensor parallelism with the vocabulary split (`ft.model.tp_shard`): this rank's first token id
        self.vocab_lo = tp.rank * self.embed.shape[0] if tp is not None and self.embed.shape[0] != cfg.vocab_size \
            else None
        self.norm = w["model.norm.weight"]
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w.get("lm_head.weight")
        self.lm_head = Linear(head) if head is not None else None  # None: a worker rank (rank 0 has the logits)
        inv_freq, scale = rope_inv_freq(cfg.rope_type, dict(cfg.rope_scaling), cfg.rope_theta,
                                        cfg.max_position_embeddings, cfg.rotary_dim)
        self.rope = Rope(cfg.rotary_dim, inv_freq.to(device), scale)
        self.layers = [self._build_layer(i, w) for i in range(cfg.num_hidden_layers)]
        self.moe_pairs_per_token = cfg.num_experts_per_tok * len(cfg.moe_layers)  # routed (token, expert) pairs
        self.top_k = cfg.num_experts_per_tok
        # pool index of each layer within its kind (KV layer / mamba layer / MoE layer)
        self.kind_index = {i: n for kinds in (cfg.full_attention_layers, cfg.linear_attention_layers) for n, i in enumerate(kinds)}

    def _build_layer(self, i: int, w: dict):
        cfg, p = self.cfg, f"model.layers.{i}."
        L = lambda name: Linear(w[p + name])  # noqa: E731
        if cfg.layer_types[i] == "linear_attention":
            a = "linear_attn."
            mixer = GatedDeltaNet(
                L(a + "in_proj_qkvz.weight"), L(a + "in_proj_ba.weight"), w[p + a + "conv1d.weight"],
                L(a + "out_proj.weight"), w[p + a + "norm.weight"], w[p + a + "A_log"], w[p + a + "dt_bias"],
                cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.rms_norm_eps,
            )
        else:
            a = "self_attn."
            mixer = GatedAttention(
                L(a + "q_proj.weight"), L(a + "k_proj.weight"), L(a + "v_proj.weight"), L(a + "o_proj.weight"),
                w[p + a + "q_norm.weight"], w[p + a + "k_norm.weight"], cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
            )
        if cfg.is_moe_layer(i):
            m = "mlp."
            shared = MLP(L(m + "shared_expert.gate_proj.weight"), L(m + "shared_expert.up_proj.weight"),
                         L(m + "shared_expert.down_proj.weight"))
            mlp = SparseMoE(L(m + "gate.weight"), shared, L(m + "shared_expert_gate.weight"),
                            cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.moe_layers.index(i))
        else:
            mlp = MLP(L("mlp.gate_proj.weight"), L("mlp.up_proj.weight"), L("mlp.down_proj.weight"))
        return mixer, mlp, w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: CachePools) -> torch.Tensor | None:
        """Logits [B, V] float32; None on a tensor-parallel worker rank (no lm_head)."""
        eps = self.cfg.rms_norm_eps
        tp = self.tp
        h = self._embed(batch.input_ids)
        x = rms_norm(h, self.layers[0][2], eps)
        y = None  # the previous layer's MLP output, added to h with the next norm
        n = len(self.layers)
        live = batch.decode.slot_mapping if batch.decode is not None else None  # padding rows: -1 (the MoE skips them)
        for i, (mixer, mlp, norm_in, norm_post) in enumerate(self.layers):
            if y is not None:
                x, h = add_rms_norm(y, h, norm_in, eps)  # NOTE: h = h + y, then the norm: one launch
            j = self.kind_index[i]
            if isinstance(mixer, GatedAttention):
                x = mixer(x, self.rope, batch, pools.kv.layer(j))
            else:
                x = mixer(x, batch, pools.mamba.conv[:, j], pools.mamba.ssm[:, j])
            if tp is not None:
                tp.all_reduce(x)  # the row-parallel output projection's partial sums
            x, h = add_rms_norm(x, h, norm_post, eps)
            if isinstance(mlp, SparseMoE):
                # the decode MoE may apply the next layer's input norm itself (with its sum)
                # (not under tensor parallelism: the sum must be all-reduced before the residual add)
                nxt = self.layers[i + 1][2] if i + 1 < n and tp is None else None
                forced = None if batch.forced_experts is None else batch.forced_experts[:, mlp.moe_index]
                y = mlp(x, pools.experts, h, nxt, eps, forced, live)
                if isinstance(y, tuple):
                    (x, h), y = y, None
            else:
                y = mlp(x)
            if tp is not None:
                tp.all_reduce(y)
        if self.lm_head is None:
            return None
        h = rms_norm((h + y)[batch.last_token_index], self.norm, eps)  # (the last layer's MoE never fuses: y is set)
        logits = self.lm_head(h).float()
        if self.vocab_lo is not None:  # every rank's slice of the vocabulary, on rank 0
            logits = tp.gather_columns(logits)
            return logits if tp.is_leader else None
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] embeddings; with the vocabulary split, each rank looks up its
        slice (zeros for the other ids) and an all-reduce sums them: exactly the whole table's rows."""
        if self.vocab_lo is None:
            return embed_tokens(self.embed, ids, self.embed_on_host, self.dtype)
        n = self.embed.shape[0]
        local = ids - self.vocab_lo
        inside = (local >= 0) & (local < n)
        h = self.embed[local.clamp(0, n - 1)]
        h = torch.where(inside[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
        return self.tp.all_reduce(h)
