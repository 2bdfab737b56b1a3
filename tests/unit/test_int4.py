"""Weight-only int4 (groups of 32, scale and minimum): the format, our kernel against the dequantized
weights, the dequantize op against a torch reference, and the engine option end to end."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.layers import int4 as int4_module
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.int4 import (
    BLOCK_OUTPUTS,
    INT4_BLOCKED_MAX_ROWS,
    INT4_MAX_ROWS,
    INT4_PAIRS_MAX_ROWS,
    INT4_WIDE_MAX_ROWS,
    METHOD_PAIRS,
    METHOD_ROWS,
    METHOD_TILES,
    dequantize_int4_float32,
    dequantize_int4_reference,
    int4_blocked_available,
    int4_dequantize,
    int4_has_tiles,
    int4_linear,
    int4_max_rows,
    int4_pairs_available,
    quantize_int4,
)
from tokenmill.layers.linear import MergedColumnLinear, RowParallelLinear
from tokenmill.layers.quantization import check_quantization

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """``q [out, in]`` from the packed bytes, by the documented layout (written independently of the
    module's reference): byte j of a group is element j (low nibble) and element j + 16 (high)."""
    out_features, half = packed.shape
    q = torch.empty(out_features, half * 2, dtype=torch.int64)
    for group in range(half // 16):
        chunk = packed[:, group * 16 : (group + 1) * 16].long()  # [out, 16]
        q[:, group * 32 : group * 32 + 16] = chunk % 16
        q[:, group * 32 + 16 : group * 32 + 32] = chunk // 16
    return q


def test_quantized_values_lie_on_each_groups_grid_within_half_a_step() -> None:
    weight = (torch.randn(48, 128) * torch.linspace(0.01, 2.0, 48)[:, None]).to(BF16)
    weight[3, 32:64] = 0.75  # a constant group: d = 0, every value is m
    packed, scales, mins = quantize_int4(weight)
    assert packed.shape == (48, 64) and packed.dtype == torch.uint8
    assert scales.shape == mins.shape == (48, 4) and scales.dtype == mins.dtype == torch.float16
    q = _unpack(packed)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    d = scales.float().repeat_interleave(32, dim=1)  # [48, 128]
    m = mins.float().repeat_interleave(32, dim=1)
    rebuilt = q.float() * d + m
    # Every group uses its whole range: q = 0 at the minimum and q = 15 at the maximum.
    assert bool((q.reshape(48, 4, 32).amin(dim=2) == 0).all())
    assert bool((q.reshape(48, 4, 32).amax(dim=2)[scales > 0] == 15).all())
    # Half a step, plus the float16 rounding of the minimum and of the scale (times q <= 15).
    bound = d / 2 + m.abs() * 2**-11 + 15 * d * 2**-11 + 1e-6
    assert bool(((rebuilt - weight.float()).abs() <= bound).all())
    assert float(scales[3, 1]) == 0.0 and float(mins[3, 1]) == 0.75
    assert torch.equal(rebuilt[3, 32:64], torch.full((32,), 0.75))


def test_a_weight_already_on_a_q4_1_grid_is_reproduced_exactly() -> None:
    # Multiples of 1/32 below 5 (8 significant bits): d * q + m is exact in float16 and bfloat16.
    d = torch.randint(1, 8, (16, 6)).to(torch.float16) / 32  # [out, groups]
    m = torch.randint(-16, 16, (16, 6)).to(torch.float16) / 16
    q = torch.randint(0, 16, (16, 6, 32))
    q[:, :, 5], q[:, :, 20] = 0, 15  # each group spans the whole grid
    weight = (q * d.float()[..., None] + m.float()[..., None]).reshape(16, 192).to(BF16)
    packed, scales, mins = quantize_int4(weight)
    assert torch.equal(scales, d) and torch.equal(mins, m)
    assert torch.equal(_unpack(packed), q.reshape(16, 192))
    assert torch.equal(int4_dequantize(packed, scales, mins), weight)


@pytest.mark.parametrize("shape", [(960, 576), (33, 96), (5, 32), (576, 1536)])
def test_dequantize_op_is_bit_identical_to_the_torch_formula(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, dtype=BF16) * 0.3
    packed, scales, mins = quantize_int4(weight)
    dequantized = int4_dequantize(packed, scales, mins)
    assert dequantized.dtype == BF16 and dequantized.shape == shape
    assert torch.equal(dequantized, dequantize_int4_reference(packed, scales, mins))
    # The reference itself follows the documented layout.
    rebuilt = _unpack(packed).float() * scales.float().repeat_interleave(
        32, 1
    ) + mins.float().repeat_interleave(32, 1)
    assert torch.equal(dequantized, rebuilt.to(BF16))


# Row counts around the kernels' boundaries: the row kernel's passes of 16, the tile kernel's row blocks
# of 16, its passes of 2 row blocks over a pair of output blocks and of 4 over a lone last block (37
# outputs: a pair and a block of 5), and the auto choice at 6 rows.
ROW_COUNTS = [*range(1, 18), 31, 32, 33, 63, 64, 65, 100, 130]
# The kernels that compute with the bfloat16 weight (auto: above the level-sums kernel's rows).
METHODS = [0, METHOD_ROWS, METHOD_TILES] if int4_has_tiles() else [0, METHOD_ROWS]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(960, 576), (37, 64), (1, 32), (576, 1536)])
def test_kernel_equals_the_product_with_the_dequantized_weight(shape: tuple[int, int], method: int) -> None:
    out_features, in_features = shape
    weight = torch.randn(shape, dtype=BF16) / in_features**0.5
    packed, scales, mins = quantize_int4(weight)
    dequantized = int4_dequantize(packed, scales, mins).float()  # [out, in]
    x_all = torch.randn(max(ROW_COUNTS), in_features, dtype=BF16)
    for rows in ROW_COUNTS:
        if method == 0 and rows <= INT4_PAIRS_MAX_ROWS and int4_pairs_available():
            continue  # the level-sums kernel's rows: test_level_sums_kernel_...
        x = x_all[:rows]
        expected = (x.float() @ dequantized.T).to(BF16).float()  # [rows, out]
        got = int4_linear(x, packed, scales, mins, None, method)
        assert got.dtype == BF16 and got.shape == (rows, out_features)
        # Float32 accumulation in another order, then one bfloat16 rounding each: 1 ulp of bf16 apart.
        assert torch.allclose(got.float(), expected, rtol=2**-7, atol=1e-5), rows
    # A strided view of rows (contiguous features), and a bias.
    wide = torch.randn(INT4_PAIRS_MAX_ROWS + 1, in_features * 2, dtype=BF16)
    bias = torch.randn(out_features, dtype=BF16)
    got = int4_linear(wide[:, :in_features], packed, scales, mins, bias, method).float()
    expected = wide[:, :in_features].float() @ dequantized.T + bias.float()
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2)


def _exact_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """``(x @ W.T in float64 for the exact weight values d * q + m, the sum of |x| |W| per output)``."""
    weight = dequantize_int4_float32(packed, scales, mins).double()  # [out, in], exact values
    return x.double() @ weight.T, x.double().abs() @ weight.abs().T  # [rows, out] each


@pytest.mark.skipif(not int4_pairs_available(), reason="the level-sums kernel needs AVX512-BF16")
@pytest.mark.parametrize("shape", [(960, 576), (37, 64), (1, 32), (33, 96), (50, 544), (576, 1536)])
def test_level_sums_kernel_computes_with_the_exact_weight_values(shape: tuple[int, int]) -> None:
    """Up to its 8 rows the auto choice is the level-sums kernel: d * sum(x q) + m * sum(x) per group, the
    exact values d * q + m (no bfloat16 rounding of the weight), float32 sums, one bfloat16 rounding of
    the result. Odd group counts (1, 3, 17) take its lone-last-group path. A row's bits do not depend on
    the step's other rows."""
    out_features, in_features = shape
    weight = torch.randn(shape, dtype=BF16) / in_features**0.5 + 0.01
    packed, scales, mins = quantize_int4(weight)
    x_all = torch.randn(INT4_PAIRS_MAX_ROWS, in_features, dtype=BF16)
    alone = int4_linear(x_all[:1], packed, scales, mins, None, METHOD_PAIRS)  # [1, out]
    for rows in range(1, INT4_PAIRS_MAX_ROWS + 1):
        x = x_all[:rows]
        got = int4_linear(x, packed, scales, mins, None, METHOD_PAIRS)
        assert torch.equal(int4_linear(x, packed, scales, mins, None), got)  # auto picks it
        assert torch.equal(got[:1], alone)
        exact, magnitude = _exact_product(x, packed, scales, mins)
        # One bfloat16 rounding of the result, and float32 sums' error relative to sum |x w|.
        error = (got.double() - exact).abs()
        assert bool((error <= 2**-8 * exact.abs() + 2**-16 * magnitude).all()), rows
    wide = torch.randn(3, in_features * 2, dtype=BF16)
    bias = torch.randn(out_features, dtype=BF16)
    got = int4_linear(wide[:, :in_features], packed, scales, mins, bias, METHOD_PAIRS).double()
    exact, magnitude = _exact_product(wide[:, :in_features], packed, scales, mins)
    assert bool(((got - exact - bias.double()).abs() <= 2**-7 * (exact.abs() + 1) + 2**-16 * magnitude).all())


def test_the_level_sums_kernel_takes_its_rows_and_is_refused_elsewhere() -> None:
    assert torch.ops.tokenmill.int4_pairs_max_rows() == INT4_PAIRS_MAX_ROWS  # the kernel's own bound
    packed, scales, mins = quantize_int4(torch.randn(16, 64, dtype=BF16))
    x = torch.randn(INT4_PAIRS_MAX_ROWS + 1, 64, dtype=BF16)
    if not int4_pairs_available():
        with pytest.raises(RuntimeError, match="the int4 level-sums kernel needs AVX512-BF16"):
            int4_linear(x[:1], packed, scales, mins, None, METHOD_PAIRS)
        return
    with pytest.raises(RuntimeError, match="and 1 to 8 rows"):
        int4_linear(x, packed, scales, mins, None, METHOD_PAIRS)
    with pytest.raises(RuntimeError, match="take bfloat16 rows, not float32"):
        int4_linear(x[:1].float(), packed, scales, mins, None, METHOD_PAIRS)


def test_the_tile_kernel_is_used_where_amx_is_granted_and_refused_elsewhere() -> None:
    packed, scales, mins = quantize_int4(torch.randn(16, 64, dtype=BF16))
    x = torch.randn(8, 64, dtype=BF16)
    if int4_has_tiles():
        assert int4_max_rows(16) == int4_max_rows(40) == 128
        tiles = int4_linear(x, packed, scales, mins, None, METHOD_TILES)
        assert torch.equal(int4_linear(x, packed, scales, mins, None), tiles)  # auto picks tiles at 8 rows
        small = METHOD_PAIRS if int4_pairs_available() else METHOD_ROWS  # at 1 row: level sums or rows
        one_row = int4_linear(x[:1], packed, scales, mins, None)
        assert torch.equal(one_row, int4_linear(x[:1], packed, scales, mins, None, small))
    else:
        # Any number of rows for weights the blocked and wide kernels take (outputs a multiple of 16), else
        # the row kernels' bound.
        assert int4_max_rows(16) == (INT4_WIDE_MAX_ROWS if int4_blocked_available() else INT4_MAX_ROWS)
        assert int4_max_rows(40) == INT4_MAX_ROWS
        with pytest.raises(RuntimeError, match="the int4 tile path needs AMX"):
            int4_linear(x, packed, scales, mins, None, METHOD_TILES)
    with pytest.raises(RuntimeError, match="method must be 0"):
        int4_linear(x, packed, scales, mins, None, 4)


def test_kernel_rejects_bad_shapes() -> None:
    packed, scales, mins = quantize_int4(torch.randn(8, 64, dtype=BF16))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        int4_linear(torch.randn(2, 32, dtype=BF16), packed, scales, mins, None)
    with pytest.raises(RuntimeError, match="x must be a bfloat16 or float32"):
        int4_linear(torch.randn(2, 64, dtype=torch.float16), packed, scales, mins, None)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        int4_linear(torch.randn(2, 64, dtype=BF16), packed, scales[:, :1].contiguous(), mins, None)


def test_layers_use_the_kernel_for_small_batches_and_the_same_weights_for_large() -> None:
    layer = MergedColumnLinear(128, {"a": 64, "b": 32}, bias=True, dtype=BF16)
    layer.weight.data.copy_(torch.randn(96, 128) / 128**0.5)
    layer.bias.data.copy_(torch.randn(96))  # type: ignore[union-attr]
    original = layer.weight.data.clone()
    assert layer.quantize_weights("int4") is None
    layer.prepare_for_inference()
    assert layer.int4_weight is not None
    int4 = layer.int4_weight
    assert torch.equal(layer.weight.data, dequantize_int4_reference(int4.packed, int4.scales, int4.mins))
    assert not torch.equal(layer.weight.data, original)
    # Past the int4 kernels' bound: oneDNN's bfloat16 GEMM on the dequantized weight; where there is none
    # (the blocked copy's weights), the wide kernel.
    x = torch.randn(min(int4.max_rows, 64) + 8, 128, dtype=BF16)
    large = layer(x).float()
    small = layer(x[:4]).float()  # the int4 kernel
    assert torch.allclose(small, large[:4], rtol=2e-2, atol=2e-2)
    # The kernel the weight picks for 4 bfloat16 rows: its blocked copy's where it has one (96 outputs),
    # else the row layout's.
    kernel = torch.ops.tokenmill.int4_linear(x[:4], *int4.triple(4, BF16)) + layer.bias
    assert torch.equal(small, kernel.float())


def test_a_layer_whose_inputs_do_not_split_into_groups_keeps_its_weights() -> None:
    layer = RowParallelLinear(48, 64, dtype=BF16)
    layer.weight.data.copy_(torch.randn(64, 48))
    original = layer.weight.data.clone()
    assert layer.quantize_weights("int4") == "in_features 48 is not a multiple of 32"
    assert layer.int4_weight is None and torch.equal(layer.weight.data, original)


def test_the_lm_head_stays_exact_under_int4() -> None:
    """4-bit logits cost perplexity the int4 decoder layers do not (docs/performance.md): the head, and
    the tied embedding table behind it, keep their float weights, and say why."""
    embedding = VocabEmbedding(200, 64, BF16)
    embedding.weight.data.copy_(torch.randn(200, 64))
    table = embedding.weight.data.clone()
    head = LMHead(200, 64, BF16, tied_to=embedding)
    reason = head.quantize_weights("int4")
    assert reason is not None and "LM head stays in its float dtype" in reason
    head.prepare_for_inference()
    assert torch.equal(embedding.weight.data, table)
    assert head.dequantized_weight is None
    hidden = torch.randn(2, 64, dtype=BF16)
    torch.testing.assert_close(head(hidden).float(), (hidden.float() @ table.float().T), rtol=2e-2, atol=2e-2)


def test_without_the_kernels_int4_is_a_clear_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_module, "load_error", lambda: "RuntimeError: no C++ compiler found")
    layer = RowParallelLinear(64, 32, dtype=BF16)
    layer.weight.data.copy_(torch.randn(32, 64))
    with pytest.raises(
        RuntimeError, match="'int4' needs the C\\+\\+ CPU kernels, which are unavailable: .*no C"
    ):
        layer.quantize_weights("int4")


def test_check_quantization_accepts_int4_in_bfloat16_on_cpu_only() -> None:
    check_quantization("int4", BF16, torch.device("cpu"))
    with pytest.raises(
        ValueError, match="quantization 'int4' needs dtype bfloat16 on CPU, got torch.float32"
    ):
        check_quantization("int4", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs dtype bfloat16 on CPU, got torch.bfloat16 on cuda"):
        check_quantization("int4", BF16, torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        check_quantization("int3", BF16, torch.device("cpu"))


def test_engine_int4_gives_the_same_greedy_tokens_alone_and_in_a_large_batch(
    tiny_model,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tokenmill import LLM, SamplingParams

    path = tiny_model("qwen3").path  # untied head, head_dim 24: o_proj has 96 inputs
    with pytest.raises(ValueError, match="needs dtype bfloat16 on CPU"):
        LLM(path, dtype="float32", quantization="int4", num_blocks=16)
    with (
        caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"),
        caplog.at_level(logging.INFO, logger="tokenmill.layers.quantization"),
    ):
        llm = LLM(path, dtype="bfloat16", quantization="int4", num_blocks=64, enable_prefix_caching=False)
    # 2 layers x (qkv, o, gate_up, down); the LM head stays exact.
    assert "int4 weights in 8 layers" in caplog.text
    assert "lm_head keeps its torch.bfloat16 weights (not int4)" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [7, 8, 9, 10, 11]
    alone = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    # Past the int4 kernels' bound (the bfloat16 weight's steps), or where there is none (the blocked
    # copy's weights) past the blocked kernel's (the wide kernel's steps).
    bound = int4_max_rows(BLOCK_OUTPUTS)
    others = [
        {"prompt_token_ids": [20 + i % 100, 30, 40 + i % 7]}
        for i in range((bound if bound < INT4_WIDE_MAX_ROWS else INT4_BLOCKED_MAX_ROWS) + 8)
    ]
    batch = llm.generate([{"prompt_token_ids": prompt}, *others], params, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_the_runner_counts_quantized_layers_and_logs_each_one_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tokenmill.layers.quantization import quantize_modules

    model = torch.nn.ModuleDict(
        {"fits": RowParallelLinear(64, 32, dtype=BF16), "odd": RowParallelLinear(48, 32, dtype=BF16)}
    )
    for layer in model.values():
        layer.weight.data.copy_(torch.randn(32, layer.in_features))
    with caplog.at_level(logging.INFO, logger="tokenmill.layers.quantization"):
        assert quantize_modules(model, "int4", BF16, torch.device("cpu")) == 1
    assert (
        "odd keeps its torch.bfloat16 weights (not int4): in_features 48 is not a multiple of 32"
        in caplog.text
    )
    assert "fits keeps" not in caplog.text


def test_exactly_4bit_layers_get_the_kernel_by_default_and_nothing_else_changes(
    tiny_model,  # type: ignore[no-untyped-def]
    tmp_path,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model whose linear weights are exactly 4-bit groups (as a Q4_1 GGUF's are) runs them on the
    int4 kernel without being asked, with the same tokens as with ``quantization="none"``; a model
    whose weights are not on such a grid keeps them, and so does ``none``."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill import LLM, SamplingParams

    source = tiny_model("qwen3").path
    weights = load_file(f"{source}/model.safetensors")
    on_grid = {}
    for name, tensor in weights.items():
        if name.endswith("proj.weight") and tensor.shape[1] % 32 == 0:
            # Round to int4 groups until rounding changes nothing (2 rounds here): a weight that a
            # 4-bit format holds exactly, as a Q4_1 GGUF's layers are.
            for _ in range(5):
                rounded = dequantize_int4_reference(*quantize_int4(tensor)).float()
                if torch.equal(rounded, tensor):
                    break
                tensor = rounded
            assert torch.equal(dequantize_int4_reference(*quantize_int4(tensor)).float(), tensor)
        on_grid[name] = tensor
    folder = tmp_path / "on-grid"
    shutil.copytree(source, folder)
    save_file(on_grid, str(folder / "model.safetensors"))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7, 8, 9, 10, 11]}, {"prompt_token_ids": [20, 30, 40]}]

    def tokens(path: str, **kwargs: str) -> list[list[int]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
            llm = LLM(path, dtype="bfloat16", num_blocks=32, enable_prefix_caching=False, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    exact = tokens(str(folder))
    # 2 layers x (qkv, o, gate_up, down)
    assert "the int4 kernel on 8 exactly 4-bit layers (lossless)" in caplog.text
    assert tokens(str(folder), quantization="none") == exact
    assert "exactly 4-bit" not in caplog.text
    tokens(source)
    assert "exactly 4-bit" not in caplog.text
