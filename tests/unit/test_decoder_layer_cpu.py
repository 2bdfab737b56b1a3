"""The fused CPU decode stack (``csrc/decoder_layer_cpu.cpp``): a step of decodes with int4 projections
runs every Llama layer and the final norm in one C++ call, with the same bits as the modules."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_kernels, fused_cpu
from tokenmill.layers.cpu_gemm import float32_panels_preferred
from tokenmill.layers.fused_decode_stack import PANELS_MAX_ROWS
from tokenmill.layers.int4 import BLOCK_OUTPUTS, int4_blocked_available, int4_max_rows

STACK_SIGNATURE = inspect.signature(fused_cpu.llama_decode_stack)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        logprobs = [
            [(token, entry.logprob) for token, entry in sorted(row.items())] for row in completion.logprobs
        ]
        results.append((list(completion.token_ids), logprobs))
    return results


def _count_stack_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the rows of every call of the fused decode stack from now on."""
    calls: list[int] = []
    original = fused_cpu.llama_decode_stack

    def counting(hidden: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(fused_cpu, "llama_decode_stack", counting)
    return calls


# qwen2: QKV biases, tied embeddings; qwen3: per-head q/k norms, head_dim 24 (not 16 * n)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_steps_run_fused_with_the_same_tokens_and_logprobs_as_the_layer_modules(
    arch: str,
    tiny_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(
        tiny_model(arch).path,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=64,
        enable_prefix_caching=False,
    )
    model = llm.engine.executor.runner.model
    stack = model.decode_stack
    assert stack is not None and len(stack.layers) == 2
    has_qkv_bias = [layer.biases[0] is not None for layer in stack.layers]
    assert has_qkv_bias == [arch == "qwen2"] * 2
    num_weights = [len(layer.weights) for layer in stack.layers]
    assert num_weights == [16 if arch == "qwen3" else 14] * 2  # with the q/k norms' weights
    assert len(stack.weights) == sum(num_weights) and len(stack.biases) == 8
    calls = _count_stack_rows(monkeypatch)
    # Different lengths: sequences finish prefill in different steps, so decode steps hold 1 to 5 rows
    # (and the steps that still hold a prompt chunk go through the modules).
    prompts = [[7 + i for i in range(length)] for length in (3, 17, 40, 9, 64)]
    fused = _generate(llm, prompts)
    assert calls and max(calls) == len(prompts) and min(calls) >= 1
    # Every decode step of the 11 decoded tokens after the first went through the op (once a step).
    assert len(calls) >= 11

    calls.clear()
    model.decode_stack = None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls


def test_steps_with_short_prompt_chunks_run_fused_with_the_same_results(
    tiny_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 24-token step budget cuts the prompts into short chunks beside the other sequences' decodes:
    # the attention attends every row as a decode (rows_as_decodes), and so does the fused stack.
    llm = LLM(
        tiny_model("qwen2").path,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=64,
        enable_prefix_caching=False,
        max_num_batched_tokens=24,
    )
    model = llm.engine.executor.runner.model
    calls = _count_stack_rows(monkeypatch)
    prompts = [[7 + i for i in range(length)] for length in (30, 5, 47, 12)]
    fused = _generate(llm, prompts)
    # Steps holding prompt chunks went through the op: more rows than sequences.
    assert max(calls) > len(prompts)

    calls.clear()
    model.decode_stack = None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls


def test_steps_with_prompt_chunks_over_the_prefill_kernel_run_fused_with_the_same_results(
    tiny_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Heads of 64 dimensions in bfloat16: where the CPU has AVX512-BF16 every prompt chunk attends
    # through the prefill kernel, in the fused stack as in the modules; a budget of up to 40 tokens
    # (no more than the rows the stack takes: 128 with AMX, 8 without) puts chunks (some over earlier
    # chunks) beside decodes, and the prefix cache adds chunks over cached blocks. The same tokens and
    # logprobs as the modules, bitwise.
    llm = LLM(
        tiny_model("wide-heads").path,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=64,
        max_num_batched_tokens=min(40, int4_max_rows(BLOCK_OUTPUTS)),
    )
    model = llm.engine.executor.runner.model
    assert model.decode_stack is not None
    calls = _count_stack_rows(monkeypatch)
    chunked: list[dict[str, Any]] = []  # the arguments of the calls with chunks
    original = fused_cpu.llama_decode_stack

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        arguments = STACK_SIGNATURE.bind(*args, **kwargs).arguments
        if arguments.get("chunks") is not None:
            chunked.append({**arguments, "hidden": arguments["hidden"].clone()})
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_cpu, "llama_decode_stack", recording)
    shared = [30 + (5 * i) % 60 for i in range(36)]
    prompts = [[7 + i for i in range(length)] for length in (30, 5, 47, 12)]
    prompts += [shared + [90, 91, 92], shared + [93, 94]]
    fused = _generate(llm, prompts)
    assert calls and max(calls) > len(prompts)
    assert bool(chunked) == cpu_kernels.prefill_kernel_available()
    if chunked:
        # The op checks that the decode rows and the chunks cover the step's rows exactly.
        arguments = chunked[-1]
        spans = arguments["chunks"].chunk_spans.clone()
        spans[-1, 2] -= 1
        short = dataclasses.replace(arguments["chunks"], chunk_spans=spans)
        with pytest.raises(RuntimeError, match="decode rows and chunks cover"):
            original(**{**arguments, "hidden": arguments["hidden"].clone(), "chunks": short})

    calls.clear()
    llm.engine.kv_manager.reset_prefix_cache()
    model.decode_stack = None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls


def test_steps_above_the_small_int4_kernels_rows_run_as_one_call_with_the_same_results(
    tiny_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps with more rows than the small-step int4 kernels take (decodes of 12 sequences without AMX;
    prompt steps of hundreds of rows) run as one call too, with the same tokens and logprobs as the
    modules, bitwise: where the blocked kernel runs, on the same stack (its wide kernel takes any number
    of rows); elsewhere on a wide stack over the layers' oneDNN-packed weights (where every layer has
    them: oneDNN with bfloat16 kernels on this CPU)."""
    llm = LLM(
        tiny_model("wide-heads").path,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=128,
        enable_prefix_caching=False,
    )
    model = llm.engine.executor.runner.model
    stack = model.decode_stack
    assert stack is not None and stack.max_rows == int4_max_rows(BLOCK_OUTPUTS)
    unbounded = stack.max_rows >= PANELS_MAX_ROWS
    packed = [
        linear.packed_weight
        for layer in model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    if unbounded:
        assert int4_blocked_available() and stack.wide is None
    elif any(p is None or p.panels for p in packed):
        assert stack.wide is None
        return
    else:
        wide = stack.wide
        assert wide is not None and wide.dtype == torch.bfloat16 and wide.wide is None
        assert [len(layer.weights) for layer in wide.layers] == [6, 6]
        assert all(weight.is_mkldnn for layer in wide.layers for weight in layer.weights[2:])
    calls = _count_stack_rows(monkeypatch)
    prompts = [[7 + (i * 13 + j) % 90 for j in range(20 + 4 * i)] for i in range(12)]
    fused = _generate(llm, prompts)
    assert max(calls) > 400  # the first step holds every prompt
    assert calls.count(len(prompts)) >= 10  # the decode steps of all twelve

    calls.clear()
    model.decode_stack = None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls


def test_layers_that_the_op_does_not_compute_keep_the_modules(tiny_model) -> None:  # type: ignore[no-untyped-def]
    # Without int4 projections (random bfloat16 weights, or int8) there is nothing to fuse.
    for path, kwargs in (
        (tiny_model("qwen3").path, {"quantization": "int8"}),
        (tiny_model("llama").path, {}),
    ):
        llm = LLM(path, dtype="bfloat16", num_blocks=16, enable_prefix_caching=False, **kwargs)
        assert llm.engine.executor.runner.model.decode_stack is None


def test_the_op_names_a_wrong_weight_bias_or_cache_list() -> None:
    hidden = torch.zeros(1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=torch.bfloat16)
    index = torch.zeros(1, dtype=torch.long)
    for weights, biases, caches, message in (
        (
            [hidden],
            [None] * 4,
            [cache],
            r"weights must hold 14 or 16 \(int4\), 6 or 8 \(float32 panels or oneDNN-packed\) tensors per layer \(1 layers\), got 1",
        ),
        (
            [hidden] * 28,
            [None] * 8,
            [cache],
            r"weights must hold 14 or 16 \(int4\), 6 or 8 \(float32 panels or oneDNN-packed\) tensors per layer \(1 layers\), got 28",
        ),
        ([hidden] * 28, [None] * 4, [cache] * 2, r"biases must hold 4 entries per layer \(2 layers\), got 4"),
        ([hidden] * 14, [None] * 4, [cache[0]], r"each kv cache must be \[2, blocks, block_size, heads, D\]"),
        ([], [], [], "kv_caches must hold one cache per layer, got none"),
        (
            [hidden] * 6,
            [None] * 4,
            [cache],
            "bfloat16 hidden states with one tensor a projection take oneDNN-packed weights",
        ),
    ):
        with pytest.raises(RuntimeError, match=message):
            fused_cpu.llama_decode_stack(
                hidden,
                weights,
                biases,
                caches,
                index,
                hidden,
                hidden,
                index,
                index[None],
                index + 1,
                hidden[0],
                (4, 2, 16),
                1e-6,
                0.25,
                None,
            )


# qwen2: QKV biases, tied embeddings; qwen3: per-head q/k norms, head_dim 24; wide-heads: heads of 64,
# whose prompt chunks attend through the float32 prefill kernel where the CPU has it (AVX2, no
# AVX-512), beside decodes, and over cached prefixes; a float16 cache under float32 for one of them.
@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"),
    [
        ("llama", "auto"),
        ("qwen2", "auto"),
        ("qwen3", "auto"),
        ("wide-heads", "auto"),
        ("wide-heads", "float16"),
    ],
)
def test_float32_steps_on_panels_run_fused_with_the_same_tokens_and_logprobs_as_the_layer_modules(
    arch: str,
    kv_cache_dtype: str,
    tiny_model,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Float32 weights go to panels on CPUs without AVX-512, and then every step the attention
    serves with its kernels runs as one call, with the same bits as the modules (elsewhere float32
    weights stay with oneDNN and the stack is not built)."""
    llm = LLM(
        tiny_model(arch).path,
        dtype="float32",
        num_blocks=64,
        max_num_batched_tokens=40,
        kv_cache_dtype=kv_cache_dtype,
    )
    model = llm.engine.executor.runner.model
    stack = model.decode_stack
    if not float32_panels_preferred():
        assert stack is None
        return
    assert stack is not None and stack.dtype == torch.float32 and len(stack.layers) == 2
    assert [len(layer.weights) for layer in stack.layers] == [8 if arch == "qwen3" else 6] * 2
    calls = _count_stack_rows(monkeypatch)
    shared = [30 + (5 * i) % 60 for i in range(36)]
    prompts = [[7 + i for i in range(length)] for length in (3, 17, 40, 9, 64)]
    prompts += [shared + [90, 91, 92], shared + [93, 94]]
    fused = _generate(llm, prompts)
    assert len(calls) >= 11 and max(calls) >= len(prompts)  # every decode step, at least
    if arch == "wide-heads" and cpu_kernels.prefill_kernel_available(torch.float32):
        assert max(calls) > len(prompts)  # steps with prompt chunks went through the op too

    calls.clear()
    llm.engine.kv_manager.reset_prefix_cache()
    model.decode_stack = None  # the layer modules only
    assert _generate(llm, prompts) == fused
    assert not calls
