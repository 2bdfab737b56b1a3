"""The engine core: one loop of schedule → execute → update over token ids.

It never sees text or HTTP. The offline ``LLM`` calls it in-process; the server runs it in its own
process behind a ZMQ socket. Every message in and out is a ``tokenmill.protocol`` struct.
"""

from __future__ import annotations

import logging

from tokenmill.config import EngineConfig
from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.inprocess import InProcessExecutor
from tokenmill.loader import ModelSource
from tokenmill.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


def effective_max_model_len(config: EngineConfig, source: ModelSource, capacity_tokens: int) -> int:
    """The context window: the configured or model limit, capped by what the KV pool can hold."""
    model_limit = int(getattr(source.hf_config, "max_position_embeddings", 0) or 0) or 2048
    wanted = config.model.max_model_len or model_limit
    if config.model.max_model_len and config.model.max_model_len > model_limit:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} exceeds the model's limit of {model_limit} positions"
        )
    if wanted > capacity_tokens:
        logger.warning(
            "context window lowered from %d to %d tokens: that is all the KV cache holds "
            "(give it more with kv_cache_memory)",
            wanted,
            capacity_tokens,
        )
        wanted = capacity_tokens
    return wanted


class EngineCore:
    """Owns the scheduler, the KV cache manager and the executor.

    Contract: ``add_request`` raises ValueError for a request that can never run and leaves the
    engine unchanged; ``step`` advances every scheduled request by one step and returns their
    outputs; ``abort_requests`` frees blocks at once.
    """

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        config.validate()
        self.config = config
        self.source = source
        self.executor = InProcessExecutor(config, source)
        block_size = config.cache.block_size
        self.kv_manager = KVCacheManager(
            self.executor.num_blocks,
            block_size,
            config.cache.enable_prefix_caching,
            sliding_window=self.executor.kv_window,
        )
        self.max_model_len = effective_max_model_len(config, source, self.kv_manager.capacity_tokens)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        logger.info(
            "engine ready: max_model_len=%d, %d KV tokens, prefix caching %s",
            self.max_model_len,
            self.kv_manager.capacity_tokens,
            "on" if config.cache.enable_prefix_caching else "off",
        )

    def add_request(self, core_request: EngineCoreRequest) -> None:
        vocab_size = int(self.source.hf_config.vocab_size)
        bad = [t for t in core_request.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        bias = core_request.sampling_params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        self.scheduler.add_request(Request(core_request, self.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        return self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan)
        outputs = self.scheduler.update(plan, result)
        return EngineCoreOutputs(
            outputs=outputs,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage(),
            num_preemptions=plan.num_preempted,
            prefix_cache_queried_tokens=self.kv_manager.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv_manager.prefix_hit_tokens,
            num_running_by_tier=self.scheduler.running_by_tier(),
            num_waiting_by_tier=self.scheduler.waiting.waiting_by_tier(),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()
