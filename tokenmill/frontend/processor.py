"""Turns user prompts (text, token ids, chat messages) into engine-core requests.

Runs on the frontend side (the offline LLM or the server process): tokenization and chat
templates happen here, so the engine core only ever sees token ids.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenmill.protocol import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.validate import validate_structured_outputs


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, hf_config: Any) -> list[int]:
    """Every id that ends generation: the tokenizer's EOS and the model config's (one or a list)."""
    ids: list[int] = []
    config_eos = getattr(hf_config, "eos_token_id", None)
    for value in (tokenizer.eos_token_id, config_eos):
        if value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            if token not in ids:
                ids.append(int(token))
    return ids


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine-core id of sample ``index`` of ``n``: the request id itself when n == 1."""
    return request_id if n == 1 else f"{request_id}-{index}"


class InputProcessor:
    """Validates prompts against the context window and builds ``EngineCoreRequest``s.

    Contract: ``tokenize`` and ``apply_chat_template`` return token ids; ``make_requests`` raises
    ValueError, naming both numbers, when a prompt leaves no room for output in the context window,
    and returns one core request per sample (n > 1 becomes n sibling requests sharing a group).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, hf_config: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids(tokenizer, hf_config)
        self.vocab_size = int(hf_config.vocab_size)
        self.model_max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to ``messages`` as text (ValueError if the model has none)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass chat_template or use a plain prompt")
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,  # type: ignore[arg-type]
            **template_kwargs,
        )
        assert isinstance(text, str)
        return text

    def chat_token_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template already writes any BOS it wants, so no special tokens are added again.
        return self.tokenize(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num = len(prompt_token_ids)
        if num == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        # Checked here, not only in the engine core, so that a batch is rejected before any of it is queued.
        bad = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        validate_structured_outputs(params)
        if num >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num} tokens, which leaves no room for output{self._why_window()}"
            )
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num} prompt tokens "
                f"plus max_tokens={params.max_tokens} make {num + params.max_tokens}{self._why_window()}"
            )

    def _why_window(self) -> str:
        # A window below the model's own limit was set by max_model_len or capped by the KV pool; a
        # request that does not fit the pool must say so rather than blame the model.
        if self.model_max_len <= self.max_model_len:
            return ""
        return (
            f" (the model itself allows {self.model_max_len}; the window is lowered by max_model_len or by "
            "the size of the KV cache, which kv_cache_memory or num_blocks can raise)"
        )

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        self.check_prompt(prompt_token_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        child_params = params.clone(n=1) if params.n > 1 else params
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=prompt_token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                group_id=request_id if params.n > 1 else None,
                sibling_index=i,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
