"""KV cache events: the prefixes an engine's radix tree stored and removed, named by block hashes.

A data-parallel frontend (``core/dp_client.py``) keeps a per-replica index of cached prefixes
(``router/prefix_index.py``). Fed only by its own dispatches it guesses; fed by these events it
knows what each replica's tree holds. ``KVEventCollector`` watches one ``RadixCache`` (its
``observer`` hook) and turns each change into a ``KVEvent``; the engine core sends the collected
events in its step outputs (``EngineCoreOutputs.kv_events``) and the client applies them in order.

A block is named by ``block_hashes``: blake2b chained over (the previous block's hash, the block's
token ids), seeded by the frontend's namespace of the request (cache salt, LoRA adapter name), so
entry ``i`` stands for the whole prefix ``tokens[: (i + 1) * block_size]`` and the frontend can
compute the same names from a prompt before dispatching it. The engine's own namespace also holds
the weight generation: a weight update drops the whole tree, reported as ``cleared``.
Pure Python over ints, msgspec structs only (no pickle).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import msgspec

from tokenmill.protocol import KVEvent

# A namespace as the frontend names it: (cache salt, LoRA adapter name), both optional.
FrontendNamespace = tuple[str | None, str | None]


def namespace_seed(namespace: FrontendNamespace) -> bytes:
    """The chain's starting value for ``namespace``."""
    return hashlib.blake2b(msgspec.msgpack.encode(["tokenmill-kv", *namespace]), digest_size=8).digest()


def chain(previous: bytes, block: Sequence[int]) -> bytes:
    """The hash of one block after the prefix whose hash is ``previous``."""
    data = previous + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block)
    return hashlib.blake2b(data, digest_size=8).digest()


def block_hashes(namespace: FrontendNamespace, tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full ``block_size`` blocks of ``tokens`` under ``namespace`` (a
    partial last block is not hashed: an engine caches whole blocks only)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    whole = len(tokens) - len(tokens) % block_size
    return [
        int.from_bytes(h, "little") for h in chain_run(namespace_seed(namespace), tokens[:whole], block_size)
    ]


def chain_run(previous: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes after ``previous`` of each ``block_size`` block of ``tokens`` (a partial
    last block hashed as it stands: a radix node's token run always ends on a block boundary)."""
    out: list[bytes] = []
    for start in range(0, len(tokens), block_size):
        previous = chain(previous, tokens[start : start + block_size])
        out.append(previous)
    return out


class RadixNodeLike(Protocol):
    """What the collector reads of a ``RadixNode``."""

    node_id: int
    namespace: Hashable
    tokens: tuple[int, ...]

    @property
    def parent(self) -> RadixNodeLike | None: ...


class KVEventCollector:
    """The ``RadixCache.observer`` of one engine: records the block hashes each change stores or
    removes, in order, until ``drain``.

    ``to_frontend`` maps the engine's radix namespace to the frontend's (``FrontendNamespace``).
    The hash at the end of each live node is remembered (by node id: a split keeps the lower node's
    id and end), so a node's blocks hash in time proportional to its own tokens.
    """

    def __init__(self, block_size: int, to_frontend: Callable[[Hashable], FrontendNamespace]) -> None:
        self.block_size = block_size
        self.to_frontend = to_frontend
        self._events: list[KVEvent] = []
        self._end_hash: dict[int, bytes] = {}

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ the radix tree's hook

    def on_stored(self, node: RadixNodeLike) -> None:
        """``node`` (a new leaf) now caches its blocks."""
        self._events.append(KVEvent("stored", self._node_hashes(node)))

    def on_removed(self, node: RadixNodeLike) -> None:
        """``node`` (a leaf) left the tree with its blocks."""
        hashes = self._node_hashes(node)
        self._end_hash.pop(node.node_id, None)
        self._events.append(KVEvent("removed", hashes))

    def on_cleared(self) -> None:
        """Every node left the tree."""
        self._end_hash.clear()
        self._events.append(KVEvent("cleared", []))

    # ------------------------------------------------------------------ helpers

    def _node_hashes(self, node: RadixNodeLike) -> list[int]:
        parent_end = self._end(node.parent)
        run = chain_run(parent_end, node.tokens, self.block_size)
        self._end_hash[node.node_id] = run[-1] if run else parent_end
        return [int.from_bytes(h, "little") for h in run]

    def _end(self, node: RadixNodeLike | None) -> bytes:
        """The hash of the prefix ending at ``node`` (a root: the namespace's seed)."""
        assert node is not None
        if node.parent is None:  # roots come and go unreported: not remembered
            return namespace_seed(self.to_frontend(node.namespace))
        known = self._end_hash.get(node.node_id)
        if known is not None:
            return known
        parent_end = self._end(node.parent)
        run = chain_run(parent_end, node.tokens, self.block_size)
        self._end_hash[node.node_id] = run[-1] if run else parent_end
        return self._end_hash[node.node_id]


class _EngineLike(Protocol):
    kv_manager: Any
    lora: Any


def attach_kv_events(engine: _EngineLike) -> KVEventCollector | None:
    """Watch ``engine``'s radix tree (None when it has none: prefix caching off). The engine's
    namespace (cache salt, weight generation, LoRA load id) maps to the frontend's (cache salt, LoRA
    adapter name); the generation is left out, since a weight update clears the tree."""
    radix = getattr(engine.kv_manager, "radix", None)
    if radix is None:
        return None

    def to_frontend(namespace: Hashable) -> FrontendNamespace:
        if not isinstance(namespace, tuple) or len(namespace) != 3:
            return (None, None)
        salt, _generation, lora_id = namespace
        return (salt, _adapter_name(engine.lora, lora_id))

    collector = KVEventCollector(radix.block_size, to_frontend)
    radix.observer = collector
    return collector


def _adapter_name(lora: Any, lora_id: int | None) -> str | None:
    if lora_id is None or lora is None:
        return None
    adapters = lora.adapters
    for adapter in [*adapters.by_name.values(), *adapters.draining.values()]:
        if adapter.lora_id == lora_id:
            return str(adapter.name)
    return f"lora-{lora_id}"
