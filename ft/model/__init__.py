"""The model: `config` (config.json), `checkpoint` (safetensors, NVFP4), `forward_batch` (what one
forward pass computes), `layers/`, `qwen3_next` (the architecture over the pools of `ft.memory`)."""
