"""argparse flags of the engine, read from `EngineConfig`'s fields so each default lives there.

No torch import: `ft --help` and `ft ctl` stay instant.
"""

from __future__ import annotations

import argparse
import dataclasses

from ft.engine.base.engine_config import EXPERT_POLICIES, KV_CACHE_DTYPES, EngineConfig

HELP = {
    "model": "checkpoint directory (Hugging Face layout), 'demo' (the built-in demo model, generated on first use) "
             "or synthetic:CONFIG.json (random weights from a config alone) (default: demo)",
    "tokenizer": ("directory to load tokenizer.json and tokenizer_config.json from instead of the checkpoint "
                  "(the EOS ids still come from the checkpoint's generation_config.json) (default: the checkpoint)"),
    "chat_template": ("a Jinja chat template: a file's path, or the template text itself; replaces the tokenizer's "
                      "templates (default: the tokenizer's own)"),
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "compute dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16",
    "moe_backend": "offload: experts in host memory, an LRU cache of device slots; resident: every expert on the device",
    "moe_cache_size": ("expert slots on the device (offload backend) "
                       "(default: what the budget leaves after KV and mamba)"),
    "moe_cache_auto": ("size the expert slots from what the budget leaves after KV and mamba (what happens anyway "
                       "without --moe-cache-size)"),
    "expert_policy": ("offload: which resident experts make room for misses: lru (least recently used), lfu "
                      "(least frequently used, with aging) or auto: lfu when decode reads misses through (up to 7 "
                      "points more hits on a 16 GiB card), else lru"),
    "expert_read_through": ("offload: decode reads a missing expert from host memory inside the step (CUDA graph, no "
                            "sync) and caches it in a reserved slot; --no-expert-read-through loads misses before each "
                            "MoE layer instead (host bookkeeping, no graphs)"),
    "expert_mapped_victims": ("offload, read-through: a resident chosen to make room stays mapped (a hit) until a "
                              "miss overwrites its slot, instead of leaving the cache a step early (H200, LFU: +1.6%% / +4.6%% "
                              "tokens/s on a 16 GiB card, +2-4%% on a 32 GiB card). Default: on wherever decode "
                              "reads misses through"),
    "prefill_stream_experts": ("offload: prefill chunks of more than 128 tokens stream the experts the cache lacks, "
                               "layer by layer on a copy stream, through this many staging slots (a ring of 3 pages) "
                               "instead of loading them into the cache: the copies overlap the compute, and nothing "
                               "decode uses is evicted; 0 loads them into the cache instead (counted in the budget) "
                               "(default: 3 x min(64, experts per layer) on CUDA, 0 on the CPU)"),
    "disable_moe_prefill_overlap": ("offload: stream a long chunk's missing experts through one staging page "
                                    "instead of a ring of 3, each page's copies waiting for the pass that read it "
                                    "(no copy overlaps the compute: slower prefill, and two pages' bytes, e.g. "
                                    "~340 MiB on Qwen3.8-Flash-Next, go to expert slots instead)"),
    "num_tokens": "KV cache capacity in tokens (default: the whole context when it fits; on a GPU that holds every expert, all the budget the experts leave, up to --max-running-requests whole contexts)",
    "kv_cache_dtype": ("KV cache dtype: auto (the checkpoint's KV format when it carries KV scales, FP8 or NVFP4, "
                       "else the compute dtype), bf16, fp8 (e4m3 with a per-layer K and V scale: half of bf16's bytes "
                       "per token) or nvfp4 (E2M1 values with an e4m3 scale per 16 and the per-layer scales: "
                       "9/32 of bf16's bytes, e.g. 6,912 instead of 24,576 per token for 12 layers x 2 kv heads "
                       "x D 256)"),
    "kv_scale_calibration": ("fp8 / nvfp4 KV without the checkpoint's KV scales: set each full-attention layer's K "
                             "and V scales from the first prefill's largest |K| and |V| (2x headroom) instead of "
                             "1.0; for models whose K or V leave e4m3's range at 1.0 (|x| > 448 or < 2**-6); larger "
                             "values in later requests are clamped (bench/RESULTS.md)"),
    "max_seq_len_override": ("context limit in tokens (vLLM's --max-model-len, SGLang's --context-length) "
                             "(default: the checkpoint's max_position_embeddings; with a YaRN or linear rope, its "
                             "context times the rope's factor, as vLLM derives it)"),
    "model_overrides": ("a JSON object merged over the checkpoint's config.json (vLLM's --hf-overrides, SGLang's "
                        "--json-model-override-args), e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 262144}}' as Qwen3-Next's card extends the context to 1M "
                        "tokens; objects merge into the config's of that name, other values replace (default: none)"),
    "memory_ratio": ("fraction of the device memory still FREE once the weights are loaded that the cache pools and "
                     "the activation reserve may use (budget = free x ratio - reserve; the rest is the headroom, for "
                     "what no plan counts: library workspaces, allocator fragments). --gpu-memory-utilization "
                     "(vLLM) and --mem-fraction-static (SGLang) set this same value, but there it is a fraction of the "
                     "card's TOTAL memory, weights included: 0.9 here leaves a tenth of what is free, not a tenth of "
                     "the card (default: a headroom of a tenth of the free memory, at most 1 GiB where the "
                     "experts are offloaded on one GPU)"),
    "gpu_memory_limit": ("act as if the card had this much memory (e.g. 16GiB) "
                         "(default: the real card; on CPU an emulated 96MiB card)"),
    "cache_budget": ("cap the cache pools' budget at this size (e.g. 4.8GiB), below what the card leaves "
                     "(default: no cap)"),
    "page_size": "tokens per KV page",
    "max_running_requests": ("requests decoded together at most (vLLM's --max-num-seqs) (default: 64 with "
                             "--moe-backend resident on a GPU, else 8; ft generate: 1)"),
    "max_prefill_length": ("tokens per prefill chunk (default: by the card the budget sees, --gpu-memory-limit "
                           "included: 16384 from 72 GiB (80 GB cards), 8192 from 36 GiB, else 4096; offloaded with "
                           "streamed prefill, the largest of 16384, 8192, 4096 whose activations fit a tenth of the "
                           "card)"),
    "mamba_cache_size": ("linear-attention state slots on the device (default: one per running request, plus as "
                         "many for the prefix cache's entries, at least 4 in all; with --prefix-states-on-host the "
                         "running requests' alone)"),
    "prefix_states_on_host": ("keep the prefix cache's linear-attention states (one per cached prefix, e.g. 113 MB "
                              "for Qwen3.8-Flash-Next, 75 MB for Qwen3-Next-80B) in pinned host memory, copied to "
                              "the device on a hit (~2 ms), so the card's bytes go to expert slots; as many "
                              "entries as running requests (at least 4). Default: on when experts are offloaded "
                              "on one CUDA GPU, off otherwise"),
    "lend_prefill_reserve": ("lend the part of the prefill chunk's activation reserve that prompts of up to 2,048 "
                             "tokens never use to the expert slots (offloaded, one GPU): a longer chunk recalls it "
                             "first (a live rebuild: the slots shrink, their experts are read again when next used) "
                             "and it is lent again --loan-hold-s after the last one, with no long prompt waiting. "
                             "Default: on when experts are offloaded on one CUDA GPU without --moe-cache-size "
                             "(+2-3%% decode measured), off otherwise"),
    "loan_hold_s": ("--lend-prefill-reserve: seconds with no chunk over 2,048 tokens and no long prompt waiting "
                    "before the loan goes out again (0: at the first step after the long one; a longer hold keeps a "
                    "stream of long prompts arriving apart from bouncing it, while the decode right after a long "
                    "prompt runs on the smaller expert pool until then) (default: %(default)s)"),
    "mamba_on_demand": ("keep device linear-attention state slots (e.g. 110 MiB each on Qwen3.8-Flash-Next, ~40 "
                        "expert slots) for the requests running now only: a request that finds no free slot grows "
                        "the pool first (a live rebuild that shrinks the expert slots, which get the bytes back "
                        "once slots sit unused for 10 s); offloaded on one GPU with the prefix cache's states in "
                        "host memory. Off by default: not yet measured on a GPU"),
    "enable_prefix_cache": ("reuse KV and linear-attention state of earlier requests (--no-enable-prefix-cache or "
                            "vLLM's --no-enable-prefix-caching to turn off)"),
    "enable_kv_ladder": "grow KV rung by rung when a request needs the context, trading expert slots; shrink back later",
    "ladder_step_size": "tokens between ladder rungs (KV starts at twice this)",
    "ladder_min_reuse": "a request that reuses less than this fraction of its prompt from the prefix cache may shrink the ladder",
    "ladder_dwell_s": "least seconds on a rung before the ladder shrinks",
    "ladder_grow_hold_s": "no shrink for this many seconds after a grow",
    "tensor_parallel_size": "GPUs that share the model, one process each (attention and linear-attention heads, "
                            "expert and MLP channels split; every rank caches its part of every expert, so the "
                            "expert cache covers N times the fraction of the model); GPU r is rank r",
    "cuda_graph_max_bs": ("decode batches up to this many requests replay one CUDA graph per batch-size bucket (1, 2, "
                          "4, 8, 12, 16, every 8 to 64, then every 16); the graphs' memory is counted in the budget (default: "
                          "--max-running-requests, every batch the engine runs)"),
    "cuda_graph_bs": ("the decode graphs' batch sizes, e.g. 1,2,4,6,8,10,12,14,16,24,32 (SGLang's --cuda-graph-bs): "
                      "a batch runs padded to the smallest size that holds it (a padding row costs what a request "
                      "does), one above the largest runs eagerly; a size costs a capture at warm-up, not memory "
                      "(default: the ladder above, up to --cuda-graph-max-bs)"),
    "mix_prefill_decode": ("while a prompt is prefilled (in chunks of --max-prefill-length tokens), each step also "
                           "computes the next token of every request that is decoding, so a long prompt never "
                           "freezes the running streams for more than one chunk; a whole prompt of at most "
                           "--prefill-graph-max-tokens still runs alone (its CUDA graphs)"),
    "max_mixed_prefill_length": ("prompt tokens at most in a step that also decodes (--mix-prefill-decode): a smaller "
                                 "share bounds the running streams' gap between tokens while prompts arrive, at the "
                                 "cost of more steps per prompt (default: --max-prefill-length, no separate bound)"),
    "disable_cuda_graph": "run every decode step and prefill eagerly, without CUDA graphs (debugging)",
    "prefill_graph_max_tokens": ("one-request prefill chunks of up to this many tokens replay CUDA graphs, padded to "
                                 "a token bucket, with the attention cores run between them (short prompts' time to "
                                 "first token is otherwise the host's launch time), while every expert is resident (an offloaded "
                                 "cache that can never hold them all reserves nothing for them); 0 turns them off"),
    "overlap_decode": ("queue each decode step before the host reads the last one's tokens, so that the host's "
                       "work per step (reading tokens, text, the next step's inputs) runs while the device computes; "
                       "plain decode batches only (no grammar, logprobs, penalties or stop strings; one GPU; experts resident "
                       "or offloaded in read-through mode; a KV ladder move lands the step in flight first), the others "
                       "step as before. Default: on for a CUDA "
                       "device (H200, flagship resident: +6-10%% tokens/s at batch 1, +6%% at batch 8; offloaded on a 32 GiB "
                       "card: +4%%), off on the CPU (nothing runs asynchronously there)"),
    "embedding_on_host": ("keep the token embedding (vocabulary x hidden, e.g. 1.27 GB for Qwen3.8-Flash-Next, 0.62 GB "
                          "for Qwen3-Next-80B in bf16) in pinned host memory: each step gathers its tokens' rows "
                          "(a few KiB) over PCIe inside the step, and the card's bytes go to expert slots. Default: on "
                          "when experts are offloaded on one CUDA GPU, off otherwise"),
    "storage_backend": ("how the pools resize: vmm (CUDA virtual memory) or mmap (host, Linux) free before they "
                        "allocate; realloc copies, so a resize holds old and new and the reachable ranges are narrower; "
                        "auto picks the best available"),
    "host_memory_check": ("before the weights load, check that what the model keeps in host memory (the routed "
                          "experts' store, an n-gram table, the embedding with --embedding-on-host; pinned beside a GPU, "
                          "so never swapped) fits the host's available memory (MemAvailable, or a container's "
                          "cgroup limit) with 2 GiB to spare, and refuse at once if not: pinned memory that does not "
                          "fit fails the load part way or has the kernel end the process; --no-host-memory-check "
                          "loads anyway (with tensor parallelism rank 0 checks the whole host before any worker starts: "
                          "the ranks' parts of the experts make the whole store)"),
    "ngram_table": ("where Qwen3.8-Flash-Next's n-gram table (~95 GiB in bf16) lives: host (pinned host memory; "
                    "the device reads each step's rows inside the step), disk (mapped from the checkpoint's files: "
                    "the host reads each step's rows through the page cache, which keeps the rows in use; on CUDA a "
                    "decode step is launched before its rows are read and waits for them at the table's layer, "
                    "~96%% of host memory's speed on an H100) or auto: host where the host-memory "
                    "plan fits, else disk (a host of 123 GB cannot pin the 63 GiB of experts and the table "
                    "together)"),
    "seed": "engine seed",
    "progress": ("loading progress: a bar on a terminal, one line per phase otherwise; --progress forces the bar, "
                 "--no-progress shows neither (default: auto)"),
}


CHOICES = {"ngram_table": ["auto", "host", "disk"], "moe_backend": ["offload", "resident"], "expert_policy": list(EXPERT_POLICIES), "kv_cache_dtype": list(KV_CACHE_DTYPES), "storage_backend": ["auto", "vmm", "mmap", "realloc"], "dtype": ["auto", "float32", "bfloat16", "float16"]}


def _kind(f: dataclasses.Field):
    """The argparse type of a field from its annotation ("int | None" -> int; byte sizes -> str)."""
    kinds = [k.strip() for k in str(f.type).split("|")]
    if "str" in kinds:  # byte sizes ("16GiB", "4.8GiB", "512MiB" or plain bytes): EngineConfig parses them
        return str
    return {"bool": bool, "int": int, "float": float}.get(kinds[0], str)


ALIASES = {
    "max_seq_len_override": ["--max-model-len", "--context-length"],  # vLLM, SGLang
    "max_running_requests": ["--max-num-seqs"],  # vLLM (SGLang's --max-running-requests is ours)
    "enable_prefix_cache": ["--enable-prefix-caching"],  # vLLM; BooleanOptionalAction adds --no-enable-prefix-caching
    "memory_ratio": ["--gpu-memory-utilization", "--mem-fraction-static"],  # vLLM, SGLang (a different base: see HELP)
    "tensor_parallel_size": ["-tp", "--tp-size"],  # vLLM, SGLang
    "model_overrides": ["--hf-overrides", "--json-model-override-args"],  # vLLM, SGLang
}
"""Other engines' spellings of our flags: field -> extra option strings of the same argument."""

METAVARS = {"model": "PATH", "tokenizer": "DIR", "model_overrides": "JSON", "chat_template": "FILE_OR_TEXT",
            "device": "DEVICE", "gpu_memory_limit": "SIZE", "cache_budget": "SIZE", "cuda_graph_bs": "SIZES"}
"""Value names in --help (others: N for integers, X for fractions and seconds, the choices)."""

AUTO_DEFAULTS = {"progress": None}
"""Fields whose command-line default differs from EngineConfig's: None = decided at startup
(`progress`: on when stderr is a terminal), resolved by `engine_config_from_args`."""


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """The engine's flags (one per EngineConfig field, plus ALIASES), -pp (only 1 is accepted,
    checked by `engine_config_from_args`), and an optional positional MODEL (`ft serve PATH`)."""
    g = parser.add_argument_group("engine")
    if positional_model:
        g.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="the checkpoint, as --model takes it (default: --model's value)")
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
        kind = _kind(f)
        default = AUTO_DEFAULTS.get(f.name, f.default)
        if kind is bool:
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=HELP.get(f.name))
        else:
            metavar = None if f.name in CHOICES else METAVARS.get(f.name, {int: "N", float: "X"}.get(kind))
            g.add_argument(*flags, type=kind, default=default, choices=CHOICES.get(f.name), metavar=metavar,
                           help=HELP.get(f.name))
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="GPUs for pipeline parallelism: accepted for vLLM/SGLang command lines, but FreeToken splits "
                        "a model over GPUs by tensor parallelism (--tensor-parallel-size), so only 1 is allowed")


def engine_config_from_args(args: argparse.Namespace, stream=None) -> EngineConfig:
    """The EngineConfig of parsed flags. Raises ConfigError (one line) for -pp other than 1 and
    for a positional MODEL that contradicts --model. An auto --progress is on when `stream`
    (default: stderr) is a terminal."""
    import os
    import sys

    from ft.errors import ConfigError

    n = getattr(args, "pipeline_parallel_size", 1)
    if n != 1:
        raise ConfigError(f"--pipeline-parallel-size {n}: FreeToken splits a model over GPUs by tensor parallelism; "
                          f"use --tensor-parallel-size {n}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if values["model"] is not None and os.path.normpath(values["model"]) != os.path.normpath(positional):
            raise ConfigError(f"two models given: {positional} (positional) and --model {values['model']}; give one")
        values["model"] = positional
    if values["progress"] is None:
        values["progress"] = (stream or sys.stderr).isatty()
    return EngineConfig(**values)
