"""Runs in the reference's own environment (torch + nemo-automodel 0.7.0, see .ci/run): for each case
of a JSON file, builds a tiny Qwen3.8-Flash-Next with the reference's code and random weights, and
writes into the case's folder its weights (the reference's native names), a prompt and the
reference's fp32 logits at every position. Used by tests/test_flash_next_oracle.py through a
subprocess: the reference pins its own transformers and installs import hooks, so it never runs in
our test process.

argv: cases.json, a list of {"dir", "config" (text-config overrides), "length", "eos_at" (positions
set to the EOS id), "greedy" (tokens to generate greedily after the prompt)}."""

import json
import sys

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.qwen3_8_flash_next.config import (
    Qwen3_8_FlashNextConfig,
    Qwen3_8_FlashNextTextConfig,
)
from nemo_automodel.components.models.qwen3_8_flash_next.engram import Qwen3_8_FlashNextEngramTableConfig
from nemo_automodel.components.models.qwen3_8_flash_next.model import Qwen3_8_FlashNextForConditionalGeneration
from safetensors.torch import save_file

BASE = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    full_attention_interval=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
    num_experts_per_tok=2, hc_count=2, hc_lowrank=4, ple_layer_ids=[], ple_embed_dim=32, ngram_size=3,
    heads_per_ngram=8, indexer_budget=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
    max_position_embeddings=256,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
    partial_rotary_factor=0.5, dtype="float32", pad_token_id=0, bos_token_id=1, eos_token_id=1, rms_norm_eps=1e-6,
)
# the reference's PLE addresses the released table's full row space (320,001,536 rows)
FULL_ROWS = 320001536


def dump(case: dict) -> None:
    cfg_dict = {**BASE, **case["config"]}
    text = Qwen3_8_FlashNextTextConfig(**cfg_dict)
    # the wrapper validates a copy of the text config's RoPE, which for YaRN reads a
    # max_position_embeddings it does not have: give it plain RoPE (the text model reads the text config's)
    rope = cfg_dict["rope_parameters"]
    wrapper_rope = (None if rope["rope_type"] == "default"
                    else {"rope_type": "default", "rope_theta": rope["rope_theta"]})
    cfg = Qwen3_8_FlashNextConfig(text_config=text, language_model_only=True, rope_parameters=wrapper_rope)
    backend = BackendConfig(linear="torch", attn="sdpa", rms_norm="torch", experts="torch", dispatcher="torch",
                            enable_hf_state_dict_adapter=False)
    table = (Qwen3_8_FlashNextEngramTableConfig(num_embeddings=FULL_ROWS, embedding_dim=cfg_dict["ple_embed_dim"] // 16)
             if cfg_dict["ple_layer_ids"] else Qwen3_8_FlashNextEngramTableConfig(num_embeddings=36, embedding_dim=2))
    torch.manual_seed(0)
    model = Qwen3_8_FlashNextForConditionalGeneration.from_config(cfg, backend=backend, engram_table_config=table)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the initialisation leaves norms at zero and gates neutral: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    model.eval()
    ids = torch.randint(2, cfg_dict["vocab_size"], (1, case["length"]), generator=g)
    for pos in case.get("eos_at", []):
        ids[0, pos] = cfg_dict["eos_token_id"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        # greedy continuation: the reference has no cache, so every step re-runs the whole prefix
        seq = ids
        for _ in range(case.get("greedy", 0)):
            nxt = model(input_ids=seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        greedy = seq[0, ids.shape[1]:]
    out = case["dir"]
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/weights.safetensors")
    save_file({"ids": ids[0].contiguous(), "logits": logits.contiguous(), "greedy": greedy.contiguous()},
              f"{out}/io.safetensors")
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg_dict, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        for case in json.load(f):
            dump(case)
            print("dumped", case["dir"], flush=True)
