"""The offline API, shaped like vLLM's ``LLM`` so its users feel at home.

with LLM(model="/path/to/checkpoint", dtype="bfloat16", max_model_len=2048) as llm:  # shut down on leaving
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    vectors = [output.outputs.embedding for output in llm.embed(["Hello"])]  # runner "auto" or "pooling"
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from engine.engine_args import EngineArgs
from engine.inputs import PromptType, RequestOptions
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.metrics.reader import Metric, engine_metrics
from engine.model.source import sampling_defaults
from engine.pooling_params import PoolingParams
from engine.request_output import EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str, **engine_kwargs) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, like vLLM's ``LLM.get_metrics()``: ``Counter``s (since start) and
        ``Gauge``s with ``.value``, ``Vector``s with ``.values`` (``engine.metrics.reader``), named as the
        replicas' Prometheus series (``serval_generation_tokens``, ``serval_spec_decode_num_drafts``, ...)
        and labelled with ``model_name``. Speculative decoding's appear only when it is configured."""
        return engine_metrics(self.llm_engine.get_stats(), {"model_name": self.llm_engine.config.model_config.model})

    def shutdown(self) -> None:
        """Releases the workers: their weights and KV caches, and the Ray worker actors and placement
        group when there are any. Idempotent; dropping the last reference to this LLM does the same."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order.

        ``lora_request``: multi-LoRA (``enable_lora``): one adapter for every prompt, or a list aligned with
        the prompts (None entries: the base model).

        A bad prompt or parameter raises ValueError before any of this call's
        requests run.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts))
        final_only = [params.clone(output_kind=RequestOutputKind.FINAL_ONLY) for params in params_list]
        request_ids = self._add_requests(prompts, final_only, priority, lora_request)
        return self._run_engine(request_ids, use_tqdm, _num_generated_tokens)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's vector (``output.outputs.embedding``), in the prompts' order,
        pooled as the engine's ``pooler_config`` says (default: the last token's final hidden state,
        L2-normalized); ``pooling_params`` may cut it (``dimensions``) or leave it unnormalized. Needs
        ``runner`` "auto" or "pooling". A bad prompt or parameter raises ValueError before any of them runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_per_prompt(pooling_params or PoolingParams(), len(prompts), PoolingParams)
        request_ids = self._add_requests(prompts, params_list, None, lora_request)
        return self._run_engine(request_ids, use_tqdm, lambda output: len(output.prompt_token_ids))

    def _add_requests(self, prompts, params_list: list, priority, lora_request) -> list[str]:
        """Queues one request per prompt; on a ValueError aborts those already queued and raises it."""
        loras = self._loras_per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._request_counter))
                options = RequestOptions(priority=priority[i] if priority else 0, lora_request=loras[i])
                self.llm_engine.add_request(request_id, prompt, params, options)
                request_ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the tokenizer's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=chat_template, add_generation_prompt=add_generation_prompt
            )
            # The template already holds the special tokens; don't let encode() add a second BOS.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` uses without sampling params (the model's generation config's sampling
        defaults over ``SamplingParams()``'s; ``generation_config="vllm"`` for none)."""
        config = self.llm_engine.config.model_config
        return SamplingParams(**sampling_defaults(config.model, config.generation_config))

    @staticmethod
    def _params_per_prompt(params, num_prompts: int, params_type: type = SamplingParams) -> list:
        if isinstance(params, params_type):
            return [params] * num_prompts
        if len(params) != num_prompts:
            raise ValueError(f"Got {len(params)} {params_type.__name__} for {num_prompts} prompts.")
        return list(params)

    @staticmethod
    def _loras_per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        if len(lora_request) != num_prompts:
            raise ValueError(f"Got {len(lora_request)} LoRA requests for {num_prompts} prompts.")
        return list(lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool, count_tokens: Callable[[Any], int]) -> list:
        """Steps until every request finished; their outputs in ``request_ids``' order. ``count_tokens``: the
        tokens of a finished output the progress bar's throughput counts."""
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        progress = tqdm(
            total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        num_tokens = 0
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    num_tokens += count_tokens(output)
                    progress.update(1)
                    progress.set_postfix_str(f"{num_tokens / max(progress.format_dict['elapsed'], 1e-9):.0f} tok/s")
        progress.close()
        return [finished[request_id] for request_id in request_ids]


def _num_generated_tokens(output: RequestOutput) -> int:
    return sum(len(completion.token_ids) for completion in output.outputs)
