"""Which arrivals may stop the engine's step in flight, and the prefix-cache guess that decides it.

``StepCuts`` is the server's side of step interrupts (``step_control.py``): a request of a tier with
a TTFT target (the step may be cut short), or one whose prompt needs at most
``short_prefill_interrupt`` tokens computed beyond the prefix cache (a follow-up chat turn, an
agent's next call; the step may pause for it), raises the interrupt flag once sent.

The engine process owns the radix tree; the server process sees only the prompts it sends and the
tokens that come back. So ``PrefixEstimate`` keeps the server's own record of the block-aligned
prefixes it has sent: a chain hash per full block (each block's hash covers every block before it and
the namespace, so equal hashes mean equal prefixes), in LRU order, bounded by the engine's block
count as the tree is. It is a guess: the engine may have evicted what the record still holds, or hold
what it has forgotten (an answer's tokens when the stream was abandoned). A wrong guess costs only
timing (a step stopped that need not have been, or one not stopped); outputs never depend on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixEstimate:
    """Chain hashes of the full blocks of recent prompts (and answers), most recent last.

    Contract: ``observe`` returns how many of ``token_ids``' tokens the engine would have to compute
    if its cache held exactly the blocks recorded so far (at least 1: the engine always computes a
    prompt's last token), then records the sequence's full blocks. ``record`` records only.
    """

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError(
                f"block_size and capacity_blocks must be positive, got {block_size} and {capacity_blocks}"
            )
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def observe(self, namespace: str | None, token_ids: Sequence[int]) -> int:
        # The engine matches at most len - 1 tokens, so the last token is always computed.
        limit = max(0, len(token_ids) - 1) // self.block_size
        matched = 0
        for index, chain in enumerate(self._chain(namespace, token_ids)):
            if index < limit and matched == index and chain in self._blocks:
                matched += 1
            self._touch(chain)
        return len(token_ids) - matched * self.block_size

    def record(self, namespace: str | None, token_ids: Sequence[int]) -> None:
        for chain in self._chain(namespace, token_ids):
            self._touch(chain)

    def clear(self) -> None:
        self._blocks.clear()

    def _chain(self, namespace: str | None, token_ids: Sequence[int]) -> list[int]:
        size = self.block_size
        chain = hash(("tokenmill-prefix", namespace))
        hashes = []
        for start in range(0, len(token_ids) - size + 1, size):
            chain = hash((chain, tuple(token_ids[start : start + size])))
            hashes.append(chain)
        return hashes

    def _touch(self, chain: int) -> None:
        blocks = self._blocks
        if chain in blocks:
            blocks.move_to_end(chain)
            return
        blocks[chain] = None
        if len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)


class StepCuts:
    """The server's side of step interrupts: whether a request just sent may stop the step in flight.

    ``ttft_tiers`` are the tiers with a TTFT target (their requests always may); ``short_prefill`` is
    ``SchedulerConfig.short_prefill_interrupt`` (0: no prompt stops it for its length); ``estimate`` is
    None when the engine has no prefix cache (every prompt token is then computed).
    """

    def __init__(self, ttft_tiers: set[str], short_prefill: int, estimate: PrefixEstimate | None) -> None:
        self.ttft_tiers = ttft_tiers
        self.short_prefill = short_prefill
        self.estimate = estimate

    def on_send(self, service_tier: str, prompt_token_ids: Sequence[int], cache_salt: str | None) -> bool:
        """Whether the request just sent may stop the step in flight (its prompt is recorded in the
        estimate either way)."""
        uncached = len(prompt_token_ids)
        if self.estimate is not None:
            uncached = self.estimate.observe(cache_salt, prompt_token_ids)
        return service_tier in self.ttft_tiers or uncached <= self.short_prefill

    def on_finish(
        self, cache_salt: str | None, prompt_token_ids: Sequence[int], answers: Sequence[Sequence[int]]
    ) -> None:
        """A request finished: the engine keeps each of its sequences' blocks, the prompt followed by
        an answer (the next turn's prefix)."""
        if self.estimate is not None:
            for answer in answers:
                self.estimate.record(cache_salt, [*prompt_token_ids, *answer])

    def on_cache_reset(self) -> None:
        if self.estimate is not None:
            self.estimate.clear()
