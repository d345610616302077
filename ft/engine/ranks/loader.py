"""Loading: a model's weights on the device, the activation reserve.

`load_model` returns the model (resident weights on the device) and the routed experts' host
store, from a `ModelSource` (`ft.engine.ranks.model_source`: where the model comes from);
`activation_reserve` estimates the bytes a forward pass needs beside the pools.
"""

from __future__ import annotations

import torch

from ft.errors import UnsupportedModelError
from ft.kernels import attention
from ft.kernels.backend import uses_triton
from ft.kernels.options import kernel_options
from ft.kernels.moe import SlotWeights, moe_workspace_bytes
from ft.kernels.nvfp4 import DEQUANT_MM_MIN_M
from ft.model.checkpoint import CheckpointReader, host_bytes, load_weights
from ft.model.config import ModelConfig
from ft.model.layers.engram import ple_chunk_tokens
from ft.model.layers.linear import NVFP4Weight
from ft.model import qwen3_8_flash_next, qwen3_next
from ft.model.qwen3_next import Qwen3NextModel
from ft.model.tp_shard import shard_tensors
from ft.model.tp_split import local_config
from ft.engine.ranks.model_source import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    source: ModelSource, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int,
    progress: bool, tp=None, embedding_on_host: bool = False, tables_on_disk: bool = False,
) -> tuple[Qwen3NextModel | qwen3_8_flash_next.FlashNextModel, SlotWeights | None]:
    """The model with its resident weights on `device`, and the routed experts' host store: read
    from the checkpoint, or made (a synthetic source). With tensor parallelism (`tp`, a
    `ft.parallel.TPGroup`) this rank's shard of both (`ft.model.tp_shard`): the whole checkpoint is
    read, each tensor cut as it arrives. `embedding_on_host`: the token embedding moves to host memory
    (pinned on CUDA) once loaded, the same values; the model gathers its rows (`EngineConfig.embedding_host`).
    `tables_on_disk`: an n-gram table is mapped from the checkpoint's files (`ft.model.paged_table`), not read."""
    arch = qwen3_8_flash_next if cfg.is_flash_next else qwen3_next
    if cfg.is_flash_next and tp is not None:
        raise UnsupportedModelError("Qwen3.8-Flash-Next does not run under tensor parallelism yet "
                                    "(--tensor-parallel-size 1)")
    specs, expert_names = arch.tensor_specs(cfg)
    rank, world = (tp.rank, tp.world) if tp is not None else (0, 1)
    weights = source.made_weights(specs, expert_names, dtype, device, seed, (rank, world), tables_on_disk)
    if weights is None:
        reader = CheckpointReader(source.path)
        if cfg.is_flash_next:  # its experts grouped per layer, or one tensor per expert (as ModelOpt writes them)
            specs, expert_names = qwen3_8_flash_next.expert_layout(specs, expert_names, reader)
        weights = load_weights(reader, specs, expert_names, dtype, device, torch.device("cpu"), progress,
                               tables_on_disk, (rank, world))
    if not uses_triton(device):
        # NOTE: the CPU path computes resident projections dense (the exact dequantized values);
        # routed experts stay NVFP4 in the host store and the slots. (Interpreter tests keep
        # them NVFP4 to run the Triton kernels on the CPU.)
        weights.tensors = {k: (v.dequantize(dtype) if isinstance(v, NVFP4Weight) else v)
                           for k, v in weights.tensors.items()}
    if embedding_on_host:  # (one GPU only: `EngineConfig` refuses it with tensor parallelism, RankState asks without)
        weights = _embedding_to_host(weights, embedding_name(cfg), device)
    if world > 1:  # NOTE: after the CPU path's dequantization: dense columns cut anywhere, NVFP4 per block
        weights.tensors = shard_tensors(weights.tensors, cfg, rank, world)
        cfg = local_config(cfg, rank, world)
    m = (qwen3_8_flash_next.FlashNextModel if cfg.is_flash_next else Qwen3NextModel)(cfg, weights, dtype, device, tp)
    m.kv_scales = weights.kv_scales  # NOTE: the KV pool takes them (ft.engine.core.engine), the model does not
    m.kv_cache_quant_algo = weights.kv_algo  # what the scales describe: "FP8" | "NVFP4" (None: no KV algo named)
    return m, weights.experts


def planned_host_bytes(source: ModelSource, cfg: ModelConfig, dtype: torch.dtype, host_embedding: bool) -> dict[str, int]:
    """What `load_model` on one GPU keeps in host memory, {what: bytes}, known before anything loads: from
    the checkpoint's headers (`ft.model.checkpoint.host_bytes`) or a synthetic model's specs."""
    arch = qwen3_8_flash_next if cfg.is_flash_next else qwen3_next
    specs, expert_names = arch.tensor_specs(cfg)
    embedding = embedding_name(cfg) if host_embedding else None
    if source.synthetic:
        from ft.tools.synthetic import synthetic_host_bytes

        return synthetic_host_bytes(specs, expert_names, dtype, embedding)
    reader = CheckpointReader(source.path)
    if cfg.is_flash_next:
        specs, expert_names = qwen3_8_flash_next.expert_layout(specs, expert_names, reader)
    return host_bytes(reader, specs, expert_names, dtype, embedding)


def tables_fit_on_disk(source: ModelSource, cfg: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether an n-gram table can be read from disk: a checkpoint's always (it is its files); a synthetic
    model's where the temporary directory has room to write it (`ft.tools.synthetic.disk_table_fits`)."""
    if not source.synthetic:
        return True
    from ft.tools.synthetic import disk_table_fits

    specs, _ = (qwen3_8_flash_next if cfg.is_flash_next else qwen3_next).tensor_specs(cfg)
    return disk_table_fits(specs, dtype)


def embedding_name(cfg: ModelConfig) -> str:
    """The checkpoint name of the token embedding."""
    return (qwen3_8_flash_next.ROOT if cfg.is_flash_next else "model.") + "embed_tokens.weight"


def _embedding_to_host(weights, name: str, device: torch.device):
    """`weights` with the tensor `name` moved to host memory (pinned when `device` is CUDA; the device
    copy freed before the budget is measured) and named in `on_host`."""
    resident = weights.tensors[name]
    if device.type == "cuda":  # straight into pinned memory (a pageable copy, then pinning it, held two)
        table = torch.empty(resident.shape, dtype=resident.dtype, pin_memory=True).copy_(resident)
    else:
        table = resident.to("cpu")
    weights.tensors = {**weights.tensors, name: table}
    weights.on_host = weights.on_host | {name}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return weights


def activation_reserve(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, prefill_tokens: int,
                       max_running: int, kv_dtype: torch.dtype | None = None, context_limit: int = 0) -> int:
    """Bytes of activations alive at the peak of the largest forward pass (a full prefill chunk):
    the residual stream and a normalised copy, plus the widest projection output twice (its input
    split and its product), plus the Triton MoE's workspace where Triton runs, plus the
    logits, plus one NVFP4 projection decoded to `dtype` for a prefill chunk's cuBLAS GEMM
    (`ft.kernels.nvfp4.DEQUANT_MM_MIN_M`), plus the library prefill attention's transients on CUDA
    where a context of `context_limit` positions on a `kv_dtype` (None: `dtype`) cache can reach it
    (`ft.kernels.attention.use_library_prefill`). Qwen3.8-Flash-Next's PLE layer: its whole-batch tensors (on
    Triton the key/value projection, u and u_hat: three C x hidden rows and one hidden row a token) where they
    exceed the widest projection's two; where its torch form runs (`EngramOptions.prefill_triton` off, or no
    Triton), one chunk of that form's temporaries (`ft.model.layers.engram.PLE_CHUNK_BYTES` at most) in place of
    the MoE's workspace if larger (the PLE runs between two MoE layers: the two are never alive at once).
    Estimated from the config, not profiled: a serving run's
    caching-allocator peak is checked against it by hand (bench/RESULTS.md session 54: 16K-token prompts on the
    80B peaked within 0.2 GiB of the weights plus this reserve), and `ft.memory.device_memory` shows the card's
    use beside the budget on every server."""
    widest = max(
        2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim,  # in_proj_qkvz
        2 * cfg.num_attention_heads * cfg.head_dim,  # q with its gate
        2 * cfg.num_experts_per_tok * cfg.moe_intermediate_size,  # routed gate/up of every pair
        2 * max(cfg.shared_expert_intermediate_size, cfg.intermediate_size),
        cfg.num_experts,
    )
    streams = cfg.flash_next.hc_count if cfg.is_flash_next else 1  # HyperConnections: a residual of C streams,
    # its normalised copy, the read's gate and the write's result (4 tensors of C x hidden)
    pair = 2 * widest
    if cfg.is_flash_next and cfg.flash_next.ple_layers:  # (`ft.kernels.engram.ple_prefill`'s key/value, u, u_hat)
        pair = max(pair, 3 * streams * cfg.hidden_size + cfg.hidden_size)
    per_token = (3 * cfg.hidden_size + 4 * (streams - 1) * cfg.hidden_size + pair) * torch.finfo(dtype).bits // 8
    moe = decoded = 0
    if uses_triton(device):  # the Triton MoE's workspace (the CPU reference allocates per group)
        moe = moe_workspace_bytes(prefill_tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                  torch.finfo(dtype).bits // 8)
        if prefill_tokens >= DEQUANT_MM_MIN_M:  # an NVFP4 projection decoded for cuBLAS (the largest one; a
            # bf16 checkpoint never allocates it: counted anyway, tens of MB)
            dense_out = max(2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, 2 * cfg.num_attention_heads * cfg.head_dim,
                            2 * cfg.shared_expert_intermediate_size)
            dense_in = max(cfg.linear_value_dim, cfg.num_attention_heads * cfg.head_dim, cfg.shared_expert_intermediate_size)
            decoded = max(dense_out, dense_in) * cfg.hidden_size * torch.finfo(dtype).bits // 8
    library = 0
    if device.type == "cuda" and (kv_dtype or dtype) == dtype and dtype != torch.float32 \
            and context_limit > attention.LIBRARY_GRANULE_KEYS and kernel_options().prefill_attention.library_on_cuda:
        library = attention.library_prefill_reserve(prefill_tokens, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                    cfg.head_dim, torch.finfo(dtype).bits // 8)
    triton_ple = uses_triton(device) and kernel_options().engram.prefill_triton
    if cfg.is_flash_next and cfg.flash_next.ple_layers and not triton_ple:  # (the torch form's chunk: 6 fp32 C x
        # hidden rows a token, `engram.ple_chunk_tokens`' count)
        chunk = min(prefill_tokens, ple_chunk_tokens(streams, cfg.hidden_size))
        moe = max(moe, chunk * 6 * 4 * streams * cfg.hidden_size)
    return prefill_tokens * per_token + moe + decoded + library + max_running * cfg.vocab_size * 4
