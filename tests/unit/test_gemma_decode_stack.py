"""The fused Gemma 3 decode stack (``csrc/gemma_decoder_cpu.cpp``, ``layers/gemma_decode_stack.py``): a
step of decodes runs every layer and the final norm in one C++ call, each projection on the kernel its
module takes, with the same bits as the modules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.conftest import save_tiny_model
from tests.models.test_gemma3 import GEMMA3
from tests.unit.test_q8_small_levels import q5_0_like
from tokenmill import LLM, SamplingParams
from tokenmill.layers import fused_cpu
from tokenmill.layers.batch_invariant import row_kernel_available
from tokenmill.layers.cpu_gemm import BF16_ROW_KERNEL_MAX_ROWS, float32_panels_preferred
from tokenmill.layers.cpu_isa import cpu_flags
from tokenmill.layers.gemma_decode_stack import (
    KIND_BF16_ROWS,
    KIND_INT4,
    KIND_LEVELS,
    KIND_ONEDNN,
    KIND_PANELS,
    KIND_Q8,
)
from tokenmill.layers.int4 import (
    BLOCK_OUTPUTS,
    INT4_BLOCKED_F32_MAX_ROWS,
    INT4_PAIRS_MAX_ROWS,
    INT4_WIDE_MAX_ROWS,
    blocked_takes,
    int4_blocked_f32_lanes,
    int4_max_rows,
    int4_pairs_available,
)
from tokenmill.layers.level_sums import LevelWeight, pack_levels
from tokenmill.layers.q8 import Q8_MAX_ROWS
from tokenmill.models.base import prepare_for_inference
from tokenmill.step_control import LayerProgress

NUM_LAYERS = len(GEMMA3.kwargs["layer_types"])


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Gemma 3 of ``tests/models/test_gemma3.py``: sliding and global layers, each with its
    rope, q/k norms, a soft-capped tied head."""
    folder = str(tmp_path_factory.mktemp("tiny-gemma3-stack"))
    save_tiny_model(GEMMA3, seed=31, folder=folder)
    return folder


@pytest.fixture(scope="module")
def gguf_like_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Gemma 3 with weights as a Q4_K_M GGUF's load: Q5_0-like q/k/v and gate/up (exact
    8-bit groups), Q4_1-like o projections (exact 4-bit groups), and down projections that are
    neither (bfloat16)."""
    folder = str(tmp_path_factory.mktemp("tiny-gemma3-gguf-like"))
    hf = save_tiny_model(GEMMA3, seed=31, folder=folder)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if any(part in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                param.copy_(q5_0_like(*param.shape))
            elif "o_proj" in name:
                param.copy_(_q4_1_like(*param.shape))
    hf.save_pretrained(folder)
    return folder


def _q4_1_like(out_features: int, in_features: int) -> torch.Tensor:
    """Values ``d * q + m`` (float16 ``d``, ``m``; ``q`` in 0..15 per group of 32), as bfloat16 holds
    them exactly: small ``q`` and power-of-two ``d`` keep ``d * q + m`` within bfloat16's bits."""
    q = torch.randint(0, 16, (out_features, in_features // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans the levels, so its d and m are found again
    d = 2.0 ** torch.randint(-7, -4, (out_features, in_features // 32, 1)).float()
    m = -8 * d
    return (q * d + m).reshape(out_features, in_features).to(torch.bfloat16)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    results = []
    for prompt in prompts:  # one at a time: every decode step a single row
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = output.outputs[0]
        assert completion.logprobs is not None
        rows = [[(t, e.logprob) for t, e in sorted(row.items())] for row in completion.logprobs]
        results.append((list(completion.token_ids), rows))
    return results


def _count_stack_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the rows of every call of the fused Gemma stack from now on."""
    calls: list[int] = []
    original = fused_cpu.gemma_decode_stack

    def counting(hidden: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(fused_cpu, "gemma_decode_stack", counting)
    return calls


def _assert_same_as_the_modules(llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps go through the op, and give the tokens and logprobs of the layer modules."""
    model = llm.engine.executor.runner.model
    calls = _count_stack_rows(monkeypatch)
    fused = _generate(llm, prompts)
    assert len(calls) >= 9 * len(prompts)  # every decode step after the first token
    calls.clear()
    stack, model.decode_stack = model.decode_stack, None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls
    model.decode_stack = stack


PROMPTS = [[10 + (11 * i + 3 * j) % 140 for j in range(n)] for i, n in enumerate((1, 6, 19, 27))]


def test_int4_decode_steps_run_fused_with_the_same_tokens_and_logprobs(
    gemma_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        gemma_folder,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=64,
        block_size=4,
        enable_prefix_caching=False,
    )
    stack = llm.engine.executor.runner.model.decode_stack
    assert stack is not None
    assert stack.kinds == [KIND_INT4] * 4 * NUM_LAYERS and stack.max_rows == int4_max_rows(BLOCK_OUTPUTS)
    # Two attention kinds (sliding with the local rope, global with the scaled one), in layer order.
    assert stack.windows == [GEMMA3.kwargs["sliding_window"], None] and stack.layer_kinds == [0, 0, 1, 0]
    _assert_same_as_the_modules(llm, PROMPTS, monkeypatch)
    # A batch of decodes is one call per step too.
    calls = _count_stack_rows(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert calls.count(len(PROMPTS)) == 5  # the decode steps (the prompts' step has 53 rows)
    assert llm.engine.kv_manager.all_free_or_cached()


def test_gguf_like_layers_take_their_exact_kernels_in_the_stack(
    gguf_like_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(gguf_like_folder, dtype="bfloat16", num_blocks=64, block_size=4, enable_prefix_caching=False)
    stack = llm.engine.executor.runner.model.decode_stack
    if not row_kernel_available():  # the down projections have no small-step kernel without AVX512-BF16
        assert stack is None
        return
    assert stack is not None
    # Q5_0 groups take the level sums (5-bit levels) where they run, else the 8-bit kernel.
    five = KIND_LEVELS if int4_pairs_available() else KIND_Q8
    assert stack.kinds == [five, KIND_INT4, five, KIND_BF16_ROWS] * NUM_LAYERS
    assert stack.max_rows == (2 if int4_pairs_available() else 1)  # the row kernel's or the 8-bit one's
    _assert_same_as_the_modules(llm, PROMPTS, monkeypatch)


def test_steps_above_every_small_kernel_run_on_the_wide_stack_with_the_same_results(
    gguf_like_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF-like mix carries a wide stack on the layers' oneDNN-packed weights (where oneDNN has
    bfloat16 kernels here), except for projections whose small-step kernel takes any number of rows
    (int4 and level groups on their blocked copies), which keep it; taken from one row more than the
    widest bounded small-step kernel's rows: a batch of 12 decodes is one call a step, with the same
    tokens and logprobs as the modules, bitwise."""
    llm = LLM(gguf_like_folder, dtype="bfloat16", num_blocks=128, block_size=4, enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    stack = model.decode_stack
    if stack is None:  # no small-step kernel for the down projections here (see above): no stack at all
        assert not row_kernel_available()
        return
    packed = [layer.mlp.down_proj.packed_weight for layer in model.layers]
    if any(p is None or p.panels for p in packed):
        assert stack.wide is None
        return
    wide = stack.wide
    unbounded = [
        kind in (KIND_INT4, KIND_LEVELS) and blocked_takes(outputs)
        for kind, outputs in zip(stack.kinds, stack.out_features, strict=True)
    ]
    expected = [kind if keeps else KIND_ONEDNN for kind, keeps in zip(stack.kinds, unbounded, strict=True)]
    assert wide is not None and wide.kinds == expected and wide.wide is None
    assert KIND_ONEDNN in wide.kinds  # the mix has bounded kernels (the 8-bit and bfloat16 ones)
    bounds = {
        KIND_Q8: Q8_MAX_ROWS,
        KIND_BF16_ROWS: BF16_ROW_KERNEL_MAX_ROWS,
        KIND_LEVELS: INT4_PAIRS_MAX_ROWS,
    }
    widest = max(
        bounds.get(kind) or int4_max_rows(outputs)
        for kind, outputs, keeps in zip(stack.kinds, stack.out_features, unbounded, strict=True)
        if not keeps
    )
    assert wide.min_rows == widest + 1
    prompts = [[10 + (7 * i + 5 * j) % 140 for j in range(3 + 2 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def generate() -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for output in outputs:
            completion = output.outputs[0]
            assert completion.logprobs is not None
            rows = [[(t, e.logprob) for t, e in sorted(row.items())] for row in completion.logprobs]
            results.append((list(completion.token_ids), rows))
        return results

    calls = _count_stack_rows(monkeypatch)
    fused = generate()
    if wide.min_rows <= len(prompts):
        assert calls.count(len(prompts)) >= 6  # the decode steps of all twelve
    calls.clear()
    model.decode_stack = None  # the layer modules only
    assert generate() == fused
    assert not calls
    assert llm.engine.kv_manager.all_free_or_cached()


def _give_downs_q4_k_like_groups(model: torch.nn.Module) -> list[LevelWeight]:
    """Random exact 4-bit groups with float32 scales (a GGUF's Q4_K layers, ``layers/level_sums.py``)
    as every layer's down projection, its weight set to their values in the weight's dtype; returns
    them in layer order."""
    torch.manual_seed(9)
    given = []
    for layer in model.layers:
        down = layer.mlp.down_proj
        out_features, in_features = down.weight.shape
        levels = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        scales = torch.rand(out_features, in_features // 32) * 0.02  # float32, not float16 values
        k4 = LevelWeight(pack_levels(levels), scales, -8 * scales)
        down.weight.data.copy_(k4.dequantize().to(down.weight.dtype))
        down.level_weight = k4
        given.append(k4)
    return given


@pytest.mark.skipif(not int4_pairs_available(), reason="the level-sums kernel needs AVX512-BF16")
def test_q4_k_like_layers_take_the_level_sums_kernel_in_the_stack(
    gguf_like_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down projections holding exact 4-bit groups with float32 scales (a GGUF's Q4_K layers,
    ``layers/level_sums.py``) take ``level_sums_linear`` in the stack as in their modules."""
    llm = LLM(gguf_like_folder, dtype="bfloat16", num_blocks=64, block_size=4, enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    _give_downs_q4_k_like_groups(model)
    prepare_for_inference(model)  # the stack again, over the new weights
    stack = model.decode_stack
    assert stack is not None
    assert stack.kinds == [KIND_LEVELS, KIND_INT4, KIND_LEVELS, KIND_LEVELS] * NUM_LAYERS
    # Any number of rows where the blocked and wide kernels take every projection (outputs a multiple
    # of 16), else the level sums' 8.
    layer = model.layers[0]
    projections = (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )
    blocked = all(blocked_takes(p.weight.shape[0]) for p in projections)
    assert stack.max_rows == (INT4_WIDE_MAX_ROWS if blocked else 8)
    _assert_same_as_the_modules(llm, PROMPTS, monkeypatch)
    # Steps of several decodes too (the kernel's multi-row passes, in the stack and in the modules).
    calls = _count_stack_rows(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    fused = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params, use_tqdm=False)
    ]
    assert calls.count(len(PROMPTS)) >= 5  # the decode steps (the prompts' step has more rows)
    model.decode_stack = None
    assert [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params, use_tqdm=False)
    ] == fused


def test_float32_steps_on_panels_run_fused_with_the_same_results(
    gemma_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 weights go to panels on CPUs without AVX-512, and the stack runs on them; elsewhere
    they stay with oneDNN and no stack is built."""
    llm = LLM(gemma_folder, dtype="float32", num_blocks=64, block_size=4, enable_prefix_caching=False)
    stack = llm.engine.executor.runner.model.decode_stack
    if not float32_panels_preferred():
        assert stack is None
        return
    assert stack is not None and stack.kinds == [KIND_PANELS] * 4 * NUM_LAYERS
    _assert_same_as_the_modules(llm, PROMPTS, monkeypatch)


def test_the_stack_stops_before_a_layer_when_the_flag_is_raised_and_goes_on_from_there(
    gemma_folder: str,
) -> None:
    llm = LLM(gemma_folder, dtype="bfloat16", quantization="int4", num_blocks=16, block_size=4)
    recorded: list[tuple[tuple[object, ...], dict[str, object], torch.Tensor]] = []
    original = fused_cpu.gemma_decode_stack

    def recording(hidden: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        hidden_in = hidden.clone()
        out = original(hidden, *args, **kwargs)
        assert isinstance(out, torch.Tensor)
        recorded.append(((hidden_in, *args), kwargs, out.clone()))
        return out

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_cpu, "gemma_decode_stack", recording)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}], params, use_tqdm=False)
    (hidden, *args), _, out = recorded[-1]
    *args, _, _ = args  # the interrupt and resume_from, passed below
    raised, lowered = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    assert torch.equal(original(hidden.clone(), *args, lowered), out)  # the KV writes are idempotent
    progress = original(hidden.clone(), *args, raised)
    assert isinstance(progress, LayerProgress) and progress.next_layer == 0 and progress.residual is None
    # A resumed call runs one layer before it reads the flag again; from where it stops, the rest of
    # the stack gives the same bits as one call.
    for layer in (1, 2, 3):
        progress = original(progress.hidden, *args, raised, progress)
        assert isinstance(progress, LayerProgress) and progress.next_layer == layer
    assert torch.equal(original(progress.hidden, *args, lowered, progress), out)
    with pytest.raises(RuntimeError, match="interrupt must be a uint8 CPU tensor"):
        original(hidden.clone(), *args, torch.ones(1))


def test_the_op_names_a_wrong_kind_list_or_weight_count(gemma_folder: str) -> None:
    llm = LLM(gemma_folder, dtype="bfloat16", quantization="int4", num_blocks=16, block_size=4)
    stack = llm.engine.executor.runner.model.decode_stack
    assert stack is not None
    hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
    caches = [torch.zeros(2, 4, 4, 2, 32, dtype=torch.bfloat16)] * NUM_LAYERS
    index = torch.zeros(1, dtype=torch.long)
    rotary = stack.rotaries[0]
    per_kind = (
        [rotary.cos_cache] * 2,
        [rotary.sin_cache] * 2,
        [index] * 2,
        [index[None]] * 2,
        [index + 1] * 2,
    )

    def call(weights, kinds, caches=caches, hidden=hidden):  # type: ignore[no-untyped-def]
        fused_cpu.gemma_decode_stack(
            hidden, weights, kinds, stack.out_features, stack.biases, caches, index, stack.layer_kinds,
            *per_kind, [4, 0], stack.final_norm, stack.shape, stack.eps, 0.2,
        )  # fmt: skip

    kinds = stack.kinds
    with pytest.raises(RuntimeError, match=r"kinds, out_features and biases must hold 4 entries per layer"):
        call(stack.weights, kinds[:-1])
    with pytest.raises(RuntimeError, match=r"projection kind must be 0 \(int4\), 1 .*got 7"):
        call(stack.weights, [7, *kinds[1:]])
    with pytest.raises(RuntimeError, match="weights hold 1 tensors past the last layer's"):
        call([*stack.weights, hidden], kinds)
    with pytest.raises(RuntimeError, match="weights end inside layer 3's projection 3"):
        call(stack.weights[:-1], kinds)
    with pytest.raises(RuntimeError, match="float32 panels go with float32 hidden states"):
        call(stack.weights, [KIND_PANELS, *kinds[1:]])
    with pytest.raises(RuntimeError, match=r"each kv cache must be \[2, blocks, block_size, heads, D\]"):
        call(stack.weights, kinds, caches=[caches[0][0]] * NUM_LAYERS)


def test_the_deterministic_mode_runs_the_layer_modules(gemma_folder: str) -> None:
    """Its backend attends row-independently, which this stack does not: no stack then."""
    llm = LLM(gemma_folder, dtype="bfloat16", quantization="int4", num_blocks=16, deterministic=True)
    assert llm.engine.executor.runner.model.decode_stack is None


@pytest.mark.skipif(int4_blocked_f32_lanes() == 0, reason="the blocked kernel for float32 rows needs AVX2")
def test_q4_k_like_layers_of_a_float32_model_take_the_blocked_kernel_in_the_stack(
    gguf_like_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same in float32 (the avx2 and avx512 paths): Q4_K-like down projections whose outputs are a
    multiple of 16 multiply small steps on the blocked kernel for float32 rows, in the stack as in
    their modules."""
    llm = LLM(gguf_like_folder, dtype="float32", num_blocks=64, block_size=4, enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    for k4 in _give_downs_q4_k_like_groups(model):
        assert k4.packed.shape[0] % 16 == 0
        assert k4.float32_max_rows == INT4_BLOCKED_F32_MAX_ROWS[int4_blocked_f32_lanes()]
    prepare_for_inference(model)
    down = model.layers[0].mlp.down_proj
    x = torch.randn(3, down.weight.shape[1])
    assert torch.equal(down(x), down.level_weight.linear(x))  # the module's small steps
    stack = model.decode_stack
    if not float32_panels_preferred():
        # float32 weights on oneDNN (AVX-512): the Q5_0-like projections have no small-step kernel in
        # float32 here, so there is no stack; the avx2 path (panels) builds it (the test below).
        assert stack is None
        return
    assert stack is not None and stack.kinds[3::4] == [KIND_LEVELS] * NUM_LAYERS
    _assert_same_as_the_modules(llm, PROMPTS, monkeypatch)


@pytest.mark.skipif(
    "avx512f" not in cpu_flags() or int4_blocked_f32_lanes() == 0,
    reason="the avx2 path is checked from a CPU with AVX-512 (an AVX2-only CPU runs the test above there)",
)
def test_q4_k_like_layers_of_a_float32_model_in_the_stack_under_cpu_isa_avx2(
    tests_under_isa: Callable[..., str],
) -> None:
    test = f"{__file__}::test_q4_k_like_layers_of_a_float32_model_take_the_blocked_kernel_in_the_stack"
    assert "1 passed" in tests_under_isa("avx2", test)
