"""Exact GGUF groups on the level-sums kernel (``layers/level_sums.py``): a Q4_K tensor's 4-bit levels
with float32 scales, decoded from the file (``loader/gguf_k4.py``) and given to the layers whose
weights they hold exactly; a Q5_0 tensor's 5-bit levels, found from the layer's own values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from tests.unit.test_q8_small_levels import q5_0_like
from tokenmill.layers.int4 import INT4_PAIRS_MAX_ROWS, int4_blocked_f32_lanes, int4_pairs_available
from tokenmill.layers.level_sums import LevelWeight, five_bit_weight, pack_levels, unpack_levels
from tokenmill.layers.linear import RowParallelLinear
from tokenmill.layers.q8 import exact_small_level_groups
from tokenmill.loader.gguf_k4 import BLOCK_BYTES, SUPER_BLOCK, decode_q4_k, keep_exact_k4


def q4_k_blocks(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random Q4_K data ``[out, in / 256 * 144]`` uint8: float16 ``d`` and ``dmin`` of a weight's
    usual size, random 6-bit scales and minimums, random levels."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(
        0, 256, size=(out_features * in_features // SUPER_BLOCK, BLOCK_BYTES), dtype=np.uint8
    )
    scales = rng.uniform(1e-4, 3e-3, size=(blocks.shape[0], 2)).astype(np.float16)  # d, dmin
    blocks[:, 0:4] = scales.view(np.uint8).reshape(-1, 4)
    return blocks.reshape(out_features, -1)


@pytest.mark.parametrize("shape", [(3, 256), (40, 1024), (7, 2048)])
def test_q4_k_decodes_to_the_gguf_packages_values(shape: tuple[int, int]) -> None:
    out_features, in_features = shape
    raw = q4_k_blocks(out_features, in_features, seed=out_features)
    levels, scales, mins = decode_q4_k(raw, out_features, in_features)
    assert levels.dtype == torch.uint8 and int(levels.max()) <= 15
    assert scales.dtype == mins.dtype == torch.float32 and scales.shape == (out_features, in_features // 32)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(
        out_features, in_features
    )
    packed = pack_levels(levels)
    assert torch.equal(unpack_levels(packed), levels)
    assert torch.equal(LevelWeight(packed, scales, mins).dequantize(), reference)  # bit for bit


def _k4(out_features: int, in_features: int, seed: int) -> LevelWeight:
    levels, scales, mins = decode_q4_k(
        q4_k_blocks(out_features, in_features, seed), out_features, in_features
    )
    return LevelWeight(pack_levels(levels), scales, mins)


def _q5_0(out_features: int, in_features: int) -> LevelWeight:
    """The 5-bit form of a Q5_0-like weight's exact groups (a seed whose groups all have it: a group
    of tiny values may be found as 8-bit levels that are multiples of 7, say, with no 5-bit form)."""
    torch.manual_seed(0)
    groups = exact_small_level_groups(q5_0_like(out_features, in_features))
    assert groups is not None
    weight = five_bit_weight(*groups)
    assert weight is not None and weight.high is not None
    return weight


@pytest.mark.skipif(not int4_pairs_available(), reason="the level-sums kernel needs AVX512-BF16")
@pytest.mark.parametrize("rows", list(range(1, INT4_PAIRS_MAX_ROWS + 1)))
@pytest.mark.parametrize("kind", ["q4_k", "q5_0"])
def test_the_kernel_computes_with_the_exact_values(rows: int, kind: str) -> None:
    # 40 groups: pairs and a block of 16 groups that is not full; 39: a lone last group too.
    weight = _k4(96, 1280, seed=3) if kind == "q4_k" else _q5_0(96, 1248)
    in_features = 1280 if kind == "q4_k" else 1248
    torch.manual_seed(rows)
    x = torch.randn(rows + 1, in_features).to(torch.bfloat16)[1:]  # rows of a strided view
    exact = x.double() @ weight.dequantize().double().T  # [rows, 96]
    out = weight.linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    bound = 2.0**-8 * exact.abs() + 2.0**-16 * (x.double().abs() @ weight.dequantize().double().abs().T)
    assert ((out.double() - exact).abs() <= bound).all()
    # A row's bits do not depend on the step's other rows.
    assert torch.equal(weight.linear(x[:1]), out[:1])


def test_the_op_names_what_it_refuses() -> None:
    weight = _k4(16, 256, seed=1)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    if not int4_pairs_available():
        with pytest.raises(RuntimeError, match="level_sums_linear needs a CPU with AVX512-BF16"):
            weight.linear(x)
        return
    op = torch.ops.tokenmill.level_sums_linear
    with pytest.raises(RuntimeError, match="x has 128 features, the weight 256"):
        op(x[:, :128], weight.packed, weight.scales, weight.mins)
    with pytest.raises(RuntimeError, match=r"scales and mins must be contiguous float32 \(or both float16\)"):
        op(x, weight.packed, weight.scales, weight.mins.half())
    with pytest.raises(RuntimeError, match="the int4 level-sums kernel takes 1 to 8 rows, got 9"):
        op(torch.zeros(9, 256, dtype=torch.bfloat16), weight.packed, weight.scales, weight.mins)


def _write_gguf(path: str, tensors: dict[str, np.ndarray]) -> None:
    writer = GGUFWriter(path, "llama")
    for name, raw in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_layers_holding_a_q4_k_tensor_exactly_get_its_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    raw = {"a.weight": q4_k_blocks(24, 512, seed=7), "b.weight": q4_k_blocks(8, 256, seed=8)}
    path = str(tmp_path / "k4.gguf")
    _write_gguf(path, raw)
    values = {
        name: torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_K)).to(torch.bfloat16)
        for name, data in raw.items()
    }
    layers = torch.nn.ModuleDict(
        {
            "holds_a": RowParallelLinear(512, 24, dtype=torch.bfloat16),
            "holds_b": RowParallelLinear(256, 8, dtype=torch.bfloat16),
            "a_but_one_value": RowParallelLinear(512, 24, dtype=torch.bfloat16),
            "random": RowParallelLinear(512, 24, dtype=torch.bfloat16),
        }
    )
    layers["holds_a"].weight.data.copy_(values["a.weight"])
    layers["holds_b"].weight.data.copy_(values["b.weight"])
    changed = values["a.weight"].clone()
    changed[5, 300] += 1.0
    layers["a_but_one_value"].weight.data.copy_(changed)  # its first row matches: a candidate
    layers["random"].weight.data.copy_(torch.randn(24, 512))
    if not int4_pairs_available():
        assert keep_exact_k4(layers, path) == 0  # nothing changes without the kernel
        return
    assert keep_exact_k4(layers, path) == 2
    given = {name: layer.level_weight is not None for name, layer in layers.items()}
    assert given == {"holds_a": True, "holds_b": True, "a_but_one_value": False, "random": False}
    # A single row now takes the kernel, with the exact values; three rows and more up to its bound too.
    x = torch.randn(3, 512).to(torch.bfloat16)
    weight = layers["holds_a"].level_weight
    assert weight is not None
    assert torch.equal(layers["holds_a"](x), weight.linear(x))
    exact = x.double() @ weight.dequantize().double().T
    assert (layers["holds_a"](x).double() - exact).abs().max() <= 2.0**-7 * exact.abs().max()


def test_float32_layers_holding_a_q4_k_tensor_exactly_get_its_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A float32 model (the avx2 and avx512 paths): layers whose float32 weight is a Q4_K tensor's values
    and whose outputs are a multiple of 16 get its groups, multiplied on the blocked kernel for float32
    rows up to its rows, with the exact values."""
    raw = {"a.weight": q4_k_blocks(32, 512, seed=7), "b.weight": q4_k_blocks(24, 256, seed=8)}
    path = str(tmp_path / "k4.gguf")
    _write_gguf(path, raw)
    values = {
        name: torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_K)) for name, data in raw.items()
    }
    layers = torch.nn.ModuleDict(
        {
            "holds_a": RowParallelLinear(512, 32, dtype=torch.float32),
            "holds_b_uneven": RowParallelLinear(256, 24, dtype=torch.float32),
            "a_rounded": RowParallelLinear(512, 32, dtype=torch.float32),
        }
    )
    layers["holds_a"].weight.data.copy_(values["a.weight"])
    layers["holds_b_uneven"].weight.data.copy_(values["b.weight"])
    layers["a_rounded"].weight.data.copy_(values["a.weight"].to(torch.bfloat16).float())
    if not int4_blocked_f32_lanes():
        assert keep_exact_k4(layers, path) == 0
        return
    assert keep_exact_k4(layers, path) == 1
    weight = layers["holds_a"].level_weight
    assert weight is not None and layers["a_rounded"].level_weight is None
    assert layers["holds_b_uneven"].level_weight is None  # 24 outputs: not the blocked kernel's
    assert torch.equal(weight.dequantize(), values["a.weight"])
    top = weight.float32_max_rows
    for rows in (1, 5, top):
        x = torch.randn(rows, 512)
        assert weight.takes(x) and torch.equal(layers["holds_a"](x), weight.linear(x))
        exact = x.double() @ values["a.weight"].double().T
        assert (layers["holds_a"](x).double() - exact).abs().max() <= 2.0**-18 * exact.abs().max()
    assert not weight.takes(torch.randn(top + 1, 512))


def test_a_q5_0_weight_keeps_its_levels_and_fifth_bits() -> None:
    torch.manual_seed(4)
    weight = q5_0_like(40, 256)  # bfloat16 d * (q - 16)
    groups = exact_small_level_groups(weight)
    assert groups is not None
    five = five_bit_weight(*groups)
    assert five is not None and five.high is not None and five.high.dtype == torch.int32
    q = groups[0].to(torch.int16).reshape(40, -1, 32)
    ours = (five.levels().to(torch.int16) - 16).reshape(40, -1, 32)
    flipped = five.scales != groups[1]  # groups found with levels up to +16 are taken negated
    assert flipped.any() and torch.equal(five.scales, torch.where(flipped, -groups[1], groups[1]))
    assert torch.equal(ours, torch.where(flipped[..., None], -q, q))
    assert five.scales.dtype == five.mins.dtype == torch.float16
    # The values rounded to bfloat16 are the weight: the same weight, streamed at 5.5 bits.
    assert torch.equal(five.dequantize().to(torch.bfloat16), weight)
    # Levels outside -16..15 (a Q8_0 group) have no 5-bit form.
    assert five_bit_weight(groups[0].clone().index_fill_(1, torch.tensor([3]), 17), groups[1]) is None


def test_a_linear_layer_of_q5_0_values_takes_the_level_sums_up_to_eight_rows() -> None:
    torch.manual_seed(6)
    layer = RowParallelLinear(256, 48, dtype=torch.bfloat16)
    layer.weight.data.copy_(q5_0_like(48, 256))
    assert layer.keep_exact_q8()
    if not int4_pairs_available():
        assert layer.q8_weight is not None and layer.level_weight is None  # the 8-bit copy there
        return
    assert layer.q8_weight is None and layer.level_weight is not None and layer.level_weight.high is not None
    for rows in (1, 8):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        assert torch.equal(layer(x), layer.level_weight.linear(x))
