"""The Python API that tests and benchmarks share.

    from ft.engine import LLM
    llm = LLM(model=PATH, device="cpu", dtype="float32", moe_cache_size=8)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], max_new_tokens=8, temperature=0.0)
    out[0].token_ids, out[0].text
"""

from __future__ import annotations

from dataclasses import dataclass

from ft.engine.core.engine import Engine
from ft.engine.base.engine_config import EngineConfig
from ft.errors import RequestError
from ft.engine.base.sampling_params import SamplingParams, TokenLogprob


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (a final stop token included)
    text: str
    finish_reason: str  # "stop" | "length"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # with SamplingParams.logprobs: one per generated token (raw logprobs, see SamplingParams)
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Owns an `Engine`; `**opts` are the `ft serve` flags with underscores."""

    def __init__(self, model: str | None = None, **opts) -> None:
        self.engine = Engine(EngineConfig.from_options(model=model, **opts))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes (nothing to do on one GPU)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | str | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        sampling_params: SamplingParams | None = None,
        **sampling,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text or token ids); results in prompt order.

        `sampling` are SamplingParams fields (max_new_tokens, temperature, top_k, top_p, min_p, seed,
        stop, stop_token_ids, ignore_eos, repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias, logprobs, prompt_logprobs) used when `sampling_params` is not given.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else prompts
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        if sampling_params is None:
            for key in ("stop", "stop_token_ids"):
                if key in sampling and sampling[key] is not None:
                    val = sampling[key]
                    sampling[key] = (val,) if isinstance(val, (str, int)) else tuple(val)
            sampling_params = SamplingParams(**sampling)
        seqs = [self.engine.add_request(ids, sampling_params) for ids in prompt_token_ids]
        self.engine.run_until_done(seqs)
        return [
            GenerationResult(s.prompt_ids, list(s.output_ids), self.engine.text_of(s), s.finish_reason, s.num_cached,
                             s.logprobs, s.prompt_logprobs)
            for s in seqs
        ]

    def chat(self, messages: list[dict], **sampling) -> GenerationResult:
        """One chat turn: the checkpoint's chat template, then `generate`."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt_token_ids=[self.tokenizer.encode(prompt)], **sampling)[0]
