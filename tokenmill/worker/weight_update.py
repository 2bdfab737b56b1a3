"""Weight updates in place: named tensors into a live model, from a folder, bytes or a trainer.

RL frameworks push new weights into the rollout engine after every training step. This module is
the worker's half (the engine core's half, the version and the cache namespace, is
``core/weights.py``). Every source ends in ``WeightUpdater.load``: the tensors' names and shapes are
checked against what the model accepts *before* anything is copied, so a bad update raises
ValueError and leaves the old weights intact; then the model's own ``load_weights`` (its checkpoint
name mapping: merged q/k/v and gate/up, Gemma's norms, MoE experts) copies them in, and the runner
re-derives what it keeps beside the weights (quantized int8/int4 copies, packed matrices, the fused
decoder stack).

Sources: a safetensors folder (``load_folder``), safetensors bytes (``load_safetensors_bytes``:
never pickle), and a ``torch.distributed`` group shared with the trainer (``init_group`` then
``receive_broadcast``: rank 0 is the trainer, which broadcasts each tensor in turn). The group's
rendezvous is a TCP store at the trainer's address with the keys under ``group_name``, the
convention SGLang's trainers use, so one trainer script can drive either engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors_bytes_into
from safetensors.torch import save as save_safetensors_bytes

from tokenmill.loader import ModelSource, hf_loader
from tokenmill.models.base import CausalLM

logger = logging.getLogger(__name__)

# Tensors a checkpoint may carry that the model recomputes itself (rotary tables).
_IGNORED_NAME_PARTS = ("rotary_emb.inv_freq",)
# What layers keep beside their weights, derived from them (quantized copies, packed matrices);
# dropped before the derivation runs again on the new weights.
DERIVED_WEIGHT_ATTRIBUTES = (
    "packed_weight",
    "int8_weight",
    "int8_scales",
    "int4_weight",
    "dequantized_weight",
    "q8_weight",
    "level_weight",
    "one_plus_weight",
    "decode_stack",
)
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
GROUP_TIMEOUT_S = 120.0


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` → ``torch.bfloat16``; ValueError for anything else."""
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unsupported weight dtype {name!r}; expected one of {sorted(DTYPES)}")
    return dtype


def open_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = GROUP_TIMEOUT_S,
) -> Any:
    """A process group of its own (not the default one) for broadcasting weights: rank 0 (the
    trainer) hosts a TCP store at ``master_address:master_port``, keys live under ``group_name``.
    Both sides call it (the trainer with rank 0); it returns once all ``world_size`` ranks joined,
    or raises after ``timeout_s``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store: dist.Store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout
    )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    raise ValueError(f"unknown weight-group backend {backend!r}; expected 'gloo' (CPU) or 'nccl' (GPU)")


@dataclass
class WeightUpdater:
    """Loads named tensors into ``model``; ``prepare`` re-derives the runner's copies afterwards.

    Contract: every ``load*`` either copies all the given tensors or raises ValueError having
    copied none (unknown name, wrong shape, non-float dtype, empty update). The accepted names are
    the model checkpoint's (Hugging Face names, as in ``ModelSource.iter_weights``), plus
    ``lm_head.weight`` for a model whose head is tied to its embedding (ignored there, as at load).
    """

    model: CausalLM
    source: ModelSource
    prepare: Callable[[], None]
    device: torch.device
    # The folder the live weights last came from whole (the model's own, or an update's).
    folder: str = ""
    groups: dict[str, Any] = field(default_factory=dict)  # name → a gloo / nccl backend
    _shapes: dict[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        self.folder = self.folder or self.source.path

    # ------------------------------------------------------------------ what the model accepts

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name → shape of every tensor the model loads (read once from the model's own
        checkpoint: safetensors headers only, or the tensors of a GGUF or ``.bin`` checkpoint)."""
        if self._shapes is None:
            shapes: dict[str, tuple[int, ...]] = {}
            if self.source.format == "hf" and hf_loader.weight_files(self.source.path)[0] == "safetensors":
                shapes = _safetensors_shapes(self.source.path)
            else:
                shapes = {name: tuple(t.shape) for name, t in self.source.iter_weights()}
            embed = shapes.get("model.embed_tokens.weight")
            if "lm_head.weight" not in shapes and embed is not None:
                shapes["lm_head.weight"] = embed  # tied: a trainer's state dict still names it
            self._shapes = {n: s for n, s in shapes.items() if not _ignored(n)}
        return self._shapes

    def check(self, named_shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
        """Raise ValueError naming the first tensor the model cannot take; returns how many."""
        expected = self.expected_shapes()
        count = 0
        for name, shape, dtype in named_shapes:
            count += 1
            if _ignored(name):
                continue
            want = expected.get(name)
            if want is None:
                raise ValueError(f"unknown weight name {name!r}: this model has no such tensor")
            if tuple(shape) != want:
                raise ValueError(f"weight {name!r} has shape {list(shape)}, but the model's is {list(want)}")
            if not dtype.is_floating_point:
                raise ValueError(f"weight {name!r} has dtype {dtype}; weights must be floating point")
        if count == 0:
            raise ValueError("the update holds no tensors")
        return count

    # ------------------------------------------------------------------ sources

    def load(self, tensors: dict[str, torch.Tensor]) -> int:
        """Check, then copy ``tensors`` into the model and re-derive; returns how many were loaded."""
        count = self.check((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
        with torch.inference_mode():
            self.model.load_weights(  # type: ignore[operator]
                (n, t) for n, t in tensors.items() if not _ignored(n)
            )
            self.prepare()
        return count

    def load_folder(self, folder: str) -> int:
        """Every tensor of the safetensors checkpoint in ``folder`` (same architecture): checked from
        the headers first, then streamed in one shard at a time."""
        if not os.path.isdir(folder):
            raise ValueError(f"no such model folder {folder!r}")
        try:
            kind, _ = hf_loader.weight_files(folder)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if kind != "safetensors":
            raise ValueError(f"{folder!r} has no safetensors weights (weights are never unpickled here)")
        headers = _safetensors_shapes(folder, with_dtypes=True)
        count = self.check((n, s, d) for n, (s, d) in headers.items())
        with torch.inference_mode():
            self.model.load_weights(  # type: ignore[operator]
                (n, t) for n, t in hf_loader.iter_weights(folder) if not _ignored(n)
            )
            self.prepare()
        if set(self.expected_shapes()) - {"lm_head.weight"} <= set(headers):
            self.folder = folder  # a whole checkpoint: what the weights reload from after a release
        return count

    def load_safetensors_bytes(self, data: bytes) -> int:
        """The named tensors of one safetensors blob (``safetensors.torch.save``)."""
        try:
            tensors = load_safetensors_bytes_into(data)
        except Exception as exc:  # safetensors raises its own error types for a malformed blob
            raise ValueError(f"the update is not a safetensors blob: {exc}") from None
        return self.load(tensors)

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's weight group as ``rank`` (the trainer is rank 0)."""
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        if rank == 0:
            raise ValueError("rank 0 of a weight update group is the trainer; give rank_offset >= 1")
        self.groups[group_name] = open_weight_group(
            master_address, master_port, rank, world_size, group_name, backend
        )

    def destroy_group(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise ValueError(f"no weight update group {group_name!r}")

    def receive_broadcast(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str | None
    ) -> int:
        """Receive each named tensor from rank 0's broadcast, in order, then load them all (so a
        broken transfer leaves the old weights). Checked before any receive."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
            )
        group = self._group(group_name)
        torch_dtypes = [dtype_from_name(d) for d in dtypes]
        self.check((n, tuple(s), d) for n, s, d in zip(names, shapes, torch_dtypes))
        received: dict[str, torch.Tensor] = {}
        for name, shape, dtype in zip(names, shapes, torch_dtypes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            group.broadcast(tensor, 0).wait()
            received[name] = tensor
        return self.load(received)

    def _group(self, group_name: str | None) -> Any:
        if group_name is not None and group_name in self.groups:
            return self.groups[group_name]
        if group_name is None and len(self.groups) == 1:
            return next(iter(self.groups.values()))
        known = ", ".join(sorted(self.groups)) or "none"
        raise ValueError(
            f"no weight update group {group_name or ''!r} (groups: {known}); "
            "call init_weights_update_group first"
        )

    def reload(self) -> None:
        """Load the whole checkpoint of ``folder`` again (after the weights were released)."""
        with torch.inference_mode():
            self.model.load_weights(  # type: ignore[operator]
                (n, t) for n, t in _iter_folder_or_source(self.folder, self.source) if not _ignored(n)
            )
            self.prepare()


def serialize_named_tensors(tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as one safetensors blob (what ``update_weights_from_tensor`` takes): detached,
    contiguous CPU copies, so a trainer can pass its live parameters."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    return save_safetensors_bytes({n: t.detach().to("cpu").contiguous() for n, t in items})


def drop_derived_weights(model: torch.nn.Module) -> None:
    """Forget every layer's copies derived from its weights (``DERIVED_WEIGHT_ATTRIBUTES``) before
    they are derived again from new weights."""
    for module in model.modules():
        for attribute in DERIVED_WEIGHT_ATTRIBUTES:
            if getattr(module, attribute, None) is not None:
                setattr(module, attribute, None)


def _ignored(name: str) -> bool:
    return any(part in name for part in _IGNORED_NAME_PARTS)


def _safetensors_shapes(folder: str, with_dtypes: bool = False) -> dict:  # type: ignore[type-arg]
    """Name → shape (with ``with_dtypes``: → (shape, dtype)) from a safetensors checkpoint's headers."""
    from safetensors import safe_open

    _, files = hf_loader.weight_files(folder)
    result: dict[str, object] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor_slice = f.get_slice(name)
                shape = tuple(int(d) for d in tensor_slice.get_shape())
                if with_dtypes:
                    dtype_name = str(tensor_slice.get_dtype()).lower()
                    result[name] = (shape, _SAFETENSORS_DTYPES.get(dtype_name, torch.int64))
                else:
                    result[name] = shape
    return result


_SAFETENSORS_DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
}


def _iter_folder_or_source(folder: str, source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    if folder == source.path:
        yield from source.iter_weights()
    else:
        yield from hf_loader.iter_weights(folder)
