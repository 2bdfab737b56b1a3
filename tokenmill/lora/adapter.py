"""Reading a PEFT LoRA adapter folder into the layout of tokenmill's wrapped layers.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, per-module ``rank_pattern`` / ``alpha_pattern``) and
``adapter_model.safetensors`` with ``...<module>.lora_A.weight`` ``[r, in]`` and
``...<module>.lora_B.weight`` ``[out, r]`` per targeted module. Only safetensors are read (never a
pickled ``adapter_model.bin``). The delta of a module is ``B A x * scaling`` with scaling
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA); the scaling is folded into ``B`` here,
in float32.

Checkpoint modules map onto the model's projections as its weights do (``models/weights.py``):
``q_proj``/``k_proj``/``v_proj`` are pieces of ``qkv_proj``, ``gate_proj``/``up_proj`` of
``gate_up_proj``; an adapter that targets the fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3's names)
gives every piece the same ``A``. Anything that does not fit (a module the model lacks or we do
not adapt, a shape that is not the base layer's, a rank above the limit, DoRA, trained biases,
``modules_to_save``) is a ValueError naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tokenmill.layers.lora import LoRALinear

# Checkpoint leaf -> (our module leaf, piece); None: the whole module (a fused target).
ADAPTABLE = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", ""),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", ""),
    "qkv_proj": ("qkv_proj", None),
    "gate_up_proj": ("gate_up_proj", None),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class LayerDelta:
    """One wrapped layer's share of an adapter: ``a`` ``[P * rank, in]``, ``bt`` ``[rank, out]``
    (scaling folded in), already in the layer's slot dtype and layout (``LoRALinear.pack``: a
    swap-in is a copy)."""

    rank: int
    a: torch.Tensor
    bt: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter read and checked against a model: its deltas by our module path."""

    path: str
    rank: int
    layers: dict[str, LayerDelta]

    @property
    def num_bytes(self) -> int:
        return sum(
            d.a.numel() * d.a.element_size() + d.bt.numel() * d.bt.element_size()
            for d in self.layers.values()
        )


def _read_config(folder: Path) -> dict:  # type: ignore[type-arg]
    config_path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} does not exist")
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} has no adapter_config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is not JSON: {exc}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {str(folder)!r}: peft_type {peft_type!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {str(folder)!r}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"LoRA adapter {str(folder)!r}: trained biases (bias={config['bias']!r}) are not supported"
        )
    if config.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {str(folder)!r}: modules_to_save {config['modules_to_save']} (fully trained "
            "modules) are not supported"
        )
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {str(folder)!r}: fan_in_fan_out weights are not supported")
    return config  # type: ignore[no-any-return]


def _pattern_value(patterns: dict, module: str, default: float) -> float:  # type: ignore[type-arg]
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the value of the first key matching the end of
    the module's name (a regular expression), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def load_adapter(path: str, layers: dict[str, LoRALinear], max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter folder ``path`` for a model whose wrapped layers are ``layers`` (our
    module path -> layer); ValueError for anything that does not fit, naming it."""
    folder = Path(path)
    config = _read_config(folder)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        found = (
            "adapter_model.bin (a pickle, never loaded)"
            if (folder / "adapter_model.bin").exists()
            else "nothing"
        )
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors (found {found})")
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A / lora_B weight of a linear layer"
            )
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    default_rank, default_alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    deltas: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    top_rank = 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} lacks its lora_{'B' if 'A' in ab else 'A'}"
            )
        parent, _, leaf = module.rpartition(".")
        if leaf not in ADAPTABLE:
            raise ValueError(
                f"LoRA adapter {path!r} targets {module!r}; only the projections "
                f"{', '.join(ADAPTABLE)} can be adapted"
            )
        target, piece = ADAPTABLE[leaf]
        layer_path = f"{parent}.{target}"
        if layer_path not in layers:
            raise ValueError(f"LoRA adapter {path!r} targets {module!r}, which this model does not have")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(
                f"LoRA adapter {path!r} has rank {rank} at {module!r}, above max_lora_rank {max_rank}"
            )
        rank_cfg = int(_pattern_value(config.get("rank_pattern") or {}, module, default_rank))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, default_alpha)
        if b.shape[1] != rank or rank_cfg != rank:
            raise ValueError(
                f"LoRA adapter {path!r}: {module!r} has lora_A rank {rank}, lora_B {b.shape[1]}, config {rank_cfg}"
            )
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        deltas.setdefault(layer_path, {})[piece] = (a, b, scaling)
        top_rank = max(top_rank, rank)
    layer_deltas = {name: _layer_delta(path, name, layers[name], pieces) for name, pieces in deltas.items()}
    if not layer_deltas:
        raise ValueError(f"LoRA adapter {path!r} has no LoRA weights")
    return LoRAAdapter(path=path, rank=top_rank, layers=layer_deltas)


def _layer_delta(
    path: str,
    name: str,
    layer: LoRALinear,
    pieces: dict[str | None, tuple[torch.Tensor, torch.Tensor, float]],
) -> LayerDelta:
    """Lay one layer's pieces out as ``LoRALinear.set_slot`` takes them (this rank's shard, in the
    slots' dtype: ``LoRALinear.pack``), checking their shapes against the unsharded layer."""
    full_pieces = layer.full_pieces()
    if None in pieces:  # a fused target: one A for every piece, B cut into the pieces' rows
        if len(pieces) > 1:
            raise ValueError(f"LoRA adapter {path!r} targets {name!r} both fused and by its parts")
        a, b, scaling = pieces[None]
        total = sum(size for _, _, size in full_pieces)
        if b.shape[0] != total:
            raise ValueError(
                f"LoRA adapter {path!r}: {name} lora_B has {b.shape[0]} outputs, the base layer {total}"
            )
        pieces = {piece: (a, b[offset : offset + size], scaling) for piece, offset, size in full_pieces}
    rank = max(a.shape[0] for a, _, _ in pieces.values())
    num = len(layer.pieces)
    a_out = torch.zeros(num * rank, layer.in_features, dtype=torch.float32)
    bt_out = torch.zeros(rank, layer.out_features, dtype=torch.float32)
    for index, (piece, offset, size) in enumerate(layer.pieces):
        if piece not in pieces:
            continue
        a, b, scaling = pieces[piece]
        label = f"LoRA adapter {path!r}: {name}" + (f" ({piece})" if piece else "")
        a = layer.shard_a(a, label)  # [r, this rank's in]
        b = layer.shard_b(piece, b, label)  # [this rank's size, r]
        r = a.shape[0]
        a_out[index * rank : index * rank + r] = a.float()
        bt_out[:r, offset : offset + size] = (b.float() * scaling).T
    a_slot, bt_slot = layer.pack(a_out, bt_out)
    return LayerDelta(rank=rank, a=a_slot, bt=bt_slot)
