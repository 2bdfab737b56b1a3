"""What every route needs: the engine client, the server's settings and metrics; plus shared helpers
for turning ``RequestState``s into OpenAI pieces (new text since the last chunk, usage)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.output_processor import RequestState, SampleState
from tokenmill.outputs import PositionLogprobDict
from tokenmill.server.errors import APIError, bad_request, model_not_found
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openai_protocol import PromptTokensDetails, Usage
from tokenmill.server.settings import ServerSettings


class ServerContext:
    """Shared by all routes of one app; lives from lifespan start to shutdown."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        # LoRA adapters served by name (``--lora-modules``, then /v1/load_lora_adapter): name -> folder.
        self.lora_adapters: dict[str, str] = dict(engine.config.lora.lora_modules)
        self.lora_metrics: Any = None  # serving_lora's collector, registered on the first /metrics

    def resolve_service_tier(self, requested: str | None) -> str:
        """The tier a request runs in (``auto`` or none: ``default``); 400 for a tier not offered."""
        try:
            return self.engine.config.scheduler.resolve_tier(requested)
        except ValueError as exc:
            raise bad_request(str(exc), param="service_tier") from None

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is None, one of the served names or a LoRA adapter's."""
        if (
            name is not None
            and name not in self.settings.served_model_names
            and name not in self.lora_adapters
        ):
            raise model_not_found(name)

    def lora_name_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model."""
        if model is None or model in self.settings.served_model_names:
            return None
        return model if model in self.lora_adapters else None

    def check_alive(self) -> None:
        """503 at once when the engine process is gone."""
        if not self.engine.is_alive:
            reason = self.engine.dead_reason or "the engine process is not running"
            raise APIError(
                503, f"the engine is not available: {reason}", type="server_error", code="engine_unavailable"
            )

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def get_context(request: Request) -> ServerContext:
    """FastAPI dependency: the app's ``ServerContext``."""
    ctx = request.app.state.ctx
    assert isinstance(ctx, ServerContext)
    return ctx


@dataclass
class SampleDelta:
    """What a sample produced since the last chunk sent for it."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobDict]


def take_delta(sample: SampleState) -> SampleDelta:
    """The sample's new text, tokens and logprobs since the last call; marks them as sent."""
    delta = SampleDelta(
        text=sample.text[sample.sent_text :],
        token_ids=sample.token_ids[sample.sent_tokens :],
        logprobs=sample.logprobs[sample.sent_logprobs :] if sample.logprobs is not None else [],
    )
    sample.sent_text = len(sample.text)
    sample.sent_tokens = len(sample.token_ids)
    sample.sent_logprobs = len(sample.logprobs) if sample.logprobs is not None else 0
    return delta


def usage_of(states: list[RequestState]) -> Usage:
    """OpenAI usage over one or more prompts: each prompt counted once, every sample's output."""
    prompt = sum(len(s.prompt_token_ids) for s in states)
    completion = sum(len(sample.token_ids) for s in states for sample in s.samples)
    cached = sum(s.num_cached_tokens for s in states)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def request_user(user_field: str | None, raw: Request) -> str | None:
    """Whose fair share a request uses: its ``user`` field, else its API key.

    The key is represented by ``key:`` and the first 16 hex digits of its SHA-256, so identities can
    be logged and configured (``--user-weight key:...=2``) without revealing the key. None when the
    request has neither (every anonymous request then shares one identity).
    """
    if user_field:
        return user_field
    authorization = raw.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return None


def openai_finish_reason(reason: str | None) -> str | None:
    """The finish reason as OpenAI clients know it: a passed deadline (``timeout``) is reported as
    ``length`` (the answer was cut short); ``stop_reason`` still says ``timeout``."""
    return "length" if reason == "timeout" else reason
