"""The offline API, shaped like vLLM's ``LLM`` so its users feel at home.

with LLM(model="/path/to/checkpoint", dtype="bfloat16", max_model_len=2048) as llm:  # shut down on leaving
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.engine_args import EngineArgs
from engine.inputs import PromptType, RequestOptions
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.metrics.reader import Metric, engine_metrics
from engine.model.source import sampling_defaults
from engine.request_output import RequestOutput
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
        loras = self._loras_per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._request_counter))
                options = RequestOptions(priority=priority[i] if priority else 0, lora_request=loras[i])
                final_only = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, final_only, options)
                request_ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

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
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"Got {len(sampling_params)} SamplingParams for {num_prompts} prompts.")
        return list(sampling_params)

    @staticmethod
    def _loras_per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        if len(lora_request) != num_prompts:
            raise ValueError(f"Got {len(lora_request)} LoRA requests for {num_prompts} prompts.")
        return list(lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        progress = tqdm(
            total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        num_generated = 0
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    num_generated += sum(len(completion.token_ids) for completion in output.outputs)
                    progress.update(1)
                    progress.set_postfix_str(
                        f"gen {num_generated / max(progress.format_dict['elapsed'], 1e-9):.0f} tok/s"
                    )
        progress.close()
        return [finished[request_id] for request_id in request_ids]
