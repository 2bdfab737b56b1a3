"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, shaped like vLLM's.

Runs the engine core in this process (no ZMQ) behind an ``InProcClient`` (``core/client.py``), the
same client interface the server uses over ZMQ: admission is all or none per prompt (its n samples),
refusals raise ValueError, and utility calls (``reset_prefix_cache``, ``kv_stats``) are the engine
core's own. Input and output processing are the server's too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from tokenmill.config import build_engine_config
from tokenmill.core.client import InProcClient, UtilityCallError, complete_now
from tokenmill.core.engine_core import EngineCore
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.processor import InputProcessor
from tokenmill.loader import resolve_model
from tokenmill.lora import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import EngineCoreRequest, UtilityBytes, UtilityValue
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.weight_update import serialize_named_tensors

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any]
ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate completions for batches of prompts on one model.

    ``LLM("smollm2-135m", dtype="float32")``; any field of ModelConfig, CacheConfig or
    SchedulerConfig is accepted as a keyword (``max_model_len``, ``num_blocks``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``...). Results come back in input order.

    Contract: a prompt the engine refuses (it can never run, or ``max_waiting`` leaves no room for
    it) raises ValueError and leaves nothing of that ``generate``/``chat`` call in the engine: the
    prompts admitted before it are taken back.
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        config = build_engine_config(model, **kwargs)
        if config.data_parallel.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 needs `tokenmill serve` (several engine processes behind one "
                "server); LLM runs one engine in this process"
            )
        source = resolve_model(model)
        self.engine = EngineCore(config, source)
        self.client = InProcClient(self.engine)
        self.tokenizer = source.load_tokenizer()
        self.input_processor = InputProcessor(self.tokenizer, source.hf_config, self.engine.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block no request uses; False while requests still hold some."""
        return bool(self.call_utility("reset_prefix_cache")["success"])

    def kv_stats(self) -> dict[str, UtilityValue]:
        """The engine's KV-cache numbers: free / cached / in-use blocks, queue lengths (as the
        server's ``/v1/admin/kv``)."""
        return self.call_utility("kv_stats")

    def call_utility(self, method: str, **args: UtilityValue) -> dict[str, UtilityValue]:
        """Run an engine utility method by name (``protocol.UTILITY_METHODS``); raises
        ``UtilityCallError`` for an unknown method, one not supported yet, or one that failed."""
        return complete_now(self.client.call_utility(method, args))

    # ------------------------------------------------------------------ RL: weights, pause, memory

    def update_weights(
        self,
        weights: str | dict[str, torch.Tensor],
        weight_version: str | None = None,
    ) -> dict[str, UtilityValue]:
        """Load new weights in place: a safetensors model folder of the same architecture, or named
        tensors (Hugging Face names, any subset). Raises ``UtilityCallError`` (its message the
        ValueError's) on a name or shape mismatch, with the old weights intact. The prefix cache
        starts afresh and the weight version changes (``weight_version`` or the update count)."""
        if isinstance(weights, str):
            return self.update_weights_from_disk(weights, weight_version)
        return self.update_weights_from_tensor(weights, weight_version)

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, UtilityValue]:
        return self.call_utility(
            "update_weights_from_disk", model_path=model_path, weight_version=weight_version
        )

    def update_weights_from_tensor(
        self, named_tensors: dict[str, torch.Tensor] | bytes, weight_version: str | None = None
    ) -> dict[str, UtilityValue]:
        """``named_tensors``: tensors by name, or a safetensors blob of them (never pickle)."""
        data = named_tensors if isinstance(named_tensors, bytes) else serialize_named_tensors(named_tensors)
        return self.call_utility(
            "update_weights_from_tensor",
            serialized_named_tensors=UtilityBytes(data),
            weight_version=weight_version,
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> dict[str, UtilityValue]:
        """Join a trainer's broadcast group (rank 0 is the trainer, which opens it with
        ``tokenmill.worker.weight_update.open_weight_group``); blocks until every rank joined."""
        return self.call_utility(
            "init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
        group_name: str | None = None,
    ) -> dict[str, UtilityValue]:
        """Receive these tensors from the trainer's broadcasts (in order) and load them."""
        return self.call_utility(
            "update_weights_from_distributed",
            names=list(names),
            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
            shapes=[list(s) for s in shapes],
            weight_version=weight_version,
            group_name=group_name,
        )

    def get_weight_version(self) -> str:
        return str(self.call_utility("get_weight_version")["weight_version"])

    def pause_generation(self, mode: str = "abort") -> dict[str, UtilityValue]:
        """Stop taking steps (``abort``, ``in_place`` or ``retract``: ``core/pause.py``)."""
        return self.call_utility("pause_generation", mode=mode)

    def continue_generation(self) -> dict[str, UtilityValue]:
        return self.call_utility("continue_generation")

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, UtilityValue]:
        return self.call_utility("release_memory_occupation", tags=list(tags) if tags else None)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, UtilityValue]:
        return self.call_utility("resume_memory_occupation", tags=list(tags) if tags else None)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt. A prompt is a string, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``. ``sampling_params`` is one for all or one per prompt, and so
        is ``lora_request`` (None: the base model; needs ``enable_lora``), loaded on first use."""
        prompt_list: list[PromptInput] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        encoded = [self._encode(p) for p in prompt_list]
        return self._run(encoded, sampling_params, use_tqdm, self._lora_names(lora_request, len(encoded)))

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Load (read and check) an adapter now; ValueError when it does not fit the model."""
        try:
            self.call_utility(
                "load_lora",
                lora_name=lora_request.lora_name,
                lora_path=lora_request.lora_path,
                lora_int_id=lora_request.lora_int_id,
            )
        except UtilityCallError as exc:
            raise ValueError(str(exc)) from None

    def unload_lora(self, lora_name: str) -> None:
        """Stop serving an adapter (its running requests finish with it)."""
        try:
            self.call_utility("unload_lora", lora_name=lora_name)
        except UtilityCallError as exc:
            raise ValueError(str(exc)) from None

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[str | None]:
        """One adapter name (or None) per prompt, each adapter loaded first."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * count
        else:
            requests = list(lora_request)
            if len(requests) != count:
                raise ValueError(
                    f"got {len(requests)} LoRA requests for {count} prompts; give one or one per prompt"
                )
        for request in {r for r in requests if r is not None}:
            self.load_lora(request)
        return [None if r is None else r.lora_name for r in requests]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and complete each (with
        ``lora_request`` as in ``generate``)."""
        conversations: list[ChatMessages]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        encoded: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            text = self.input_processor.render_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
            )
            encoded.append((text, self.input_processor.tokenize(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm, self._lora_names(lora_request, len(encoded)))

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one completion (n must be 1) and yield its text as it is produced."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream generates one completion; n must be 1, got {params.n}")
        self._check_not_paused()
        text, token_ids = self._encode(prompt)
        request_id = str(next(self._ids))
        core_requests = self.input_processor.make_requests(request_id, token_ids, params)
        state = self.output_processor.add_request(request_id, text, token_ids, params)
        self._admit(request_id, core_requests)
        sample = state.samples[0]
        try:
            while sample.finish_reason is None:
                step = complete_now(self.client.get_outputs())
                _, to_abort = self.output_processor.process(step.outputs)
                if to_abort:
                    self.client.abort_requests(to_abort)
                if len(sample.text) > sample.sent_text:
                    yield sample.text[sample.sent_text :]
                    sample.sent_text = len(sample.text)
        finally:
            if sample.finish_reason is None:  # the caller stopped iterating early
                self.client.abort_requests(self.output_processor.abort(request_id))

    # ------------------------------------------------------------------ internals

    def _check_not_paused(self) -> None:
        """This thread drives the steps: while paused nothing would ever finish, so refuse."""
        if self.engine.pause.blocks_steps:
            raise ValueError("the engine is paused or its memory released; continue_generation first")

    def _admit(self, request_id: str, core_requests: list[EngineCoreRequest]) -> None:
        """Admit one prompt's samples all or none; on a refusal forget it and raise ValueError."""
        added = complete_now(self.client.add_request_group(core_requests))
        if added.error is not None:
            self.output_processor.abort(request_id)
            raise ValueError(added.error)

    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.input_processor.tokenize(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"], self.input_processor.tokenize(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_names: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        names = lora_names or [None] * len(encoded)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(encoded)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(encoded)} prompts; give one or one per prompt"
                )
        for (_, token_ids), params in zip(encoded, params_list):
            self.input_processor.check_prompt(token_ids, params)
        self._check_not_paused()

        order: list[str] = []
        try:
            for (text, token_ids), params, lora_name in zip(encoded, params_list, names):
                request_id = str(next(self._ids))
                core_requests = self.input_processor.make_requests(request_id, token_ids, params)
                for core_request in core_requests:
                    core_request.lora_name = lora_name
                self.output_processor.add_request(request_id, text, token_ids, params)
                self._admit(request_id, core_requests)
                order.append(request_id)
        except ValueError:
            # One call's prompts run together or not at all: take back those admitted before.
            for request_id in order:
                self.client.abort_requests(self.output_processor.abort(request_id))
            raise

        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.client.has_unfinished_requests():
                step = complete_now(self.client.get_outputs())
                changed, to_abort = self.output_processor.process(step.outputs)
                if to_abort:
                    self.client.abort_requests(to_abort)
                for state in changed:
                    if state.finished:
                        results[state.request_id] = state.to_output()
                        bar.update(1)
        return [results[request_id] for request_id in order]
