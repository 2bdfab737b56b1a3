"""Multi-LoRA serving against transformers + PEFT (``merge_and_unload``) in float32.

Adapters are random PEFT LoRAs on tiny random Llama and Qwen2 models; one batch mixes four adapters
and the base model, and every output must be token-identical to the merged reference's greedy
continuation, with logprobs close.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tests.models.lora_adapters import Adapter, make_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest

NUM_NEW = 12
LOGPROB_TOL = 1e-4


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 160) for _ in range(rng.choice((3, 9, 17, 30)))] for _ in range(count)]


def greedy(max_tokens: int = NUM_NEW, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tiny_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny model, four adapters (ranks 4/8/16/8; one rsLoRA, one on attention only) and an engine
    with three slots, so the mixed batch also swaps."""
    model = tiny_model(request.param)
    specs = [
        dict(rank=4, alpha=8.0),
        dict(rank=8, alpha=16.0, use_rslora=True),
        dict(rank=16, alpha=8.0, targets=("q_proj", "v_proj", "o_proj")),
        dict(rank=8, alpha=32.0, targets=("gate_proj", "up_proj", "down_proj", "k_proj")),
    ]
    adapters = [
        make_adapter(model.hf, str(tmp_path_factory.mktemp(f"lora-{i}")), f"a{i}", seed=10 + i, **spec)  # type: ignore[arg-type]
        for i, spec in enumerate(specs)
    ]
    llm = LLM(
        model.path,
        dtype="float32",
        block_size=4,
        num_blocks=400,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    )
    return model, adapters, llm


def lora(adapter: Adapter, index: int) -> LoRARequest:
    return LoRARequest(adapter.name, index + 1, adapter.path)


def test_mixed_batch_matches_peft(setup) -> None:  # type: ignore[no-untyped-def]
    model, adapters, llm = setup
    batch = prompts(10)
    choice: list[int | None] = [None, 0, 1, 2, 3, 0, None, 3, 2, 1]
    requests = [None if c is None else lora(adapters[c], c) for c in choice]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False, lora_request=requests
    )
    differs = 0
    for prompt, c, output in zip(batch, choice, outputs):
        expected = model.greedy(prompt, NUM_NEW) if c is None else adapters[c].greedy(prompt, NUM_NEW)
        assert output.outputs[0].token_ids == expected, f"adapter {c}, prompt of {len(prompt)}"
        if c is not None:
            differs += expected != model.greedy(prompt, NUM_NEW)
    assert differs >= 4, "the adapters should change most outputs"


def test_logprobs_close_to_peft(setup) -> None:  # type: ignore[no-untyped-def]
    _, adapters, llm = setup
    prompt = prompts(1, seed=3)[0]
    params = greedy(4, logprobs=3, prompt_logprobs=3)
    for index, adapter in enumerate(adapters[:2]):
        (output,) = llm.generate(
            [{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora(adapter, index)
        )
        tokens = prompt + output.outputs[0].token_ids
        reference = adapter.log_softmax(tokens)
        for position, entry in enumerate(output.outputs[0].logprobs):
            chosen = tokens[len(prompt) + position]
            want = reference[len(prompt) + position - 1, chosen].item()
            assert entry[chosen].logprob == pytest.approx(want, abs=LOGPROB_TOL)
        for position in range(1, len(prompt)):
            entry = output.prompt_logprobs[position]
            want = reference[position - 1, prompt[position]].item()
            assert entry[prompt[position]].logprob == pytest.approx(want, abs=LOGPROB_TOL)


def test_more_adapters_than_slots_chunked_and_n(setup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Five adapters over four slots, a token budget that chunks prompts and n=2: every output still
    matches, and the engine swapped slots."""
    model, adapters, llm = setup
    extra = make_adapter(model.hf, str(tmp_path / "extra"), "extra", seed=99, rank=8)
    every = [*adapters, extra]
    batch = prompts(10, seed=11)
    requests = [lora(every[i % 5], i % 5) for i in range(10)]
    llm.engine.scheduler.config.max_num_batched_tokens = 24
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch], greedy(n=2), use_tqdm=False, lora_request=requests
        )
    finally:
        llm.engine.scheduler.config.max_num_batched_tokens = 2048
    for i, (prompt, output) in enumerate(zip(batch, outputs)):
        expected = every[i % 5].greedy(prompt, NUM_NEW)
        assert [c.token_ids for c in output.outputs] == [expected, expected]
    assert llm.kv_stats()["lora_slot_swaps"] >= 5


def test_prefix_cache_is_namespaced_by_adapter(setup) -> None:  # type: ignore[no-untyped-def]
    """The same prompt under the base, adapter 0 and adapter 1: each matches its own reference, so a
    cached prefix of one never served another; the same adapter again hits its own blocks."""
    model, adapters, llm = setup
    prompt = prompts(1, seed=5)[0] * 3  # several full blocks
    llm.reset_prefix_cache()
    for c in (None, 0, 1, None, 0):
        hit_before = llm.engine.kv_manager.prefix_hit_tokens
        (output,) = llm.generate(
            [{"prompt_token_ids": prompt}],
            greedy(),
            use_tqdm=False,
            lora_request=None if c is None else lora(adapters[c], c),
        )
        expected = model.greedy(prompt, NUM_NEW) if c is None else adapters[c].greedy(prompt, NUM_NEW)
        assert output.outputs[0].token_ids == expected
        hits = llm.engine.kv_manager.prefix_hit_tokens - hit_before
        assert output.num_cached_tokens == hits
    # The last two runs (base, adapter 0 again) hit their own earlier blocks.
    assert output.num_cached_tokens > 0


@pytest.mark.parametrize("library", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_reference_agree(dtype: torch.dtype, library: str) -> None:
    """The C++ segmented kernel and the torch reference (float32 slots) give the same deltas, rows of
    several slots (one of rank 0 in this layer, odd ranks) and of the base mixed in one batch,
    on a merged and a plain layer; a small batch and one whose slots span several row chunks and
    tiles, with feature counts that are no multiple of the vector width. bfloat16 activations on a
    CPU with AVX512-BF16 use bfloat16 slots (``vdpbf16ps``), checked against the float32 reference
    within bfloat16 rounding. ``avx2``: the kernel built without AVX-512 (the code other x86 CPUs
    run, float32 slots), compared on this one."""
    from tokenmill.layers import lora_kernel
    from tokenmill.layers.cpu_isa import cpu_isa
    from tokenmill.layers.linear import MergedColumnLinear, RowParallelLinear
    from tokenmill.layers.lora import LoRABatch, LoRALinear, LoRAStepState, lora_delta_reference

    assert lora_kernel.load_error() is None, lora_kernel.load_error()
    kwargs = {}
    slot_dtype = lora_kernel.slot_dtype(dtype, torch.device("cpu"))
    if library == "avx2":
        assert lora_kernel.build_variant("tokenmill_lora_avx2", ("-mno-avx512f",)) is None
        kwargs["library"] = "tokenmill_lora_avx2"
        assert not lora_kernel.bf16_slots_available("tokenmill_lora_avx2")
        slot_dtype = torch.float32
    else:  # bfloat16 slots exactly where the path has vdpbf16ps (not under TOKENMILL_CPU_ISA=avx2)
        fast_path = dtype == torch.bfloat16 and cpu_isa() in ("amx", "avx512_bf16")
        assert slot_dtype == (torch.bfloat16 if fast_path else torch.float32)
    small = [(0, 3), (-1, 2), (2, 4), (0, 1), (3, 5), (1, 2)]
    large = [(1, 37), (0, 70), (-1, 5), (3, 3), (1, 2), (2, 6)]
    torch.manual_seed(0)
    for plan in (small, large):
        batch = LoRABatch.build(plan, torch.device("cpu"))
        assert batch is not None
        bases = [
            MergedColumnLinear(64, {"q": 64, "k": 32, "v": 32}, dtype=dtype),
            MergedColumnLinear(72, {"gate": 40, "up": 24}, dtype=dtype),
            RowParallelLinear(130, 70, dtype=dtype),
        ]
        for base in bases:
            reference = LoRALinear(base, LoRAStepState(), max_loras=4, max_rank=15)
            layer = LoRALinear(base, LoRAStepState(), max_loras=4, max_rank=15, slot_dtype=slot_dtype)
            for slot, rank in enumerate((4, 15, 0, 5)):
                a = torch.randn(len(layer.pieces) * rank, layer.in_features).to(dtype).float()
                bt = torch.randn(rank, layer.out_features).to(dtype).float()
                reference.set_slot(slot, rank, *reference.pack(a, bt))
                layer.set_slot(slot, rank, *layer.pack(a, bt))
            assert layer.lora_a.dtype == slot_dtype
            x = torch.randn(batch.num_tokens, layer.in_features).to(dtype)
            base_out = torch.randn(batch.num_tokens, layer.out_features).to(dtype)
            ref, fast = base_out.clone(), base_out.clone()
            lora_delta_reference(
                ref, x, reference.lora_a, reference.lora_bt, reference.ranks, batch.segments, layer.pieces
            )
            lora_kernel.lora_delta(
                fast,
                x,
                layer.lora_a,
                layer.lora_bt,
                layer.ranks_tensor,
                batch.row_slots,
                layer.piece_offsets,
                **kwargs,
            )
            if dtype == torch.float32:
                torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
            else:  # bfloat16 outputs: each rounded once, from sums taken in different orders
                scale = ref.float().abs().amax(dim=1, keepdim=True)  # [num_tokens, 1]
                assert ((fast.float() - ref.float()).abs() <= 0.01 * scale + 1e-2).all()
            rows_of = [slot for slot, count in plan for _ in range(count)]
            for row, slot in enumerate(rows_of):
                if slot in (-1, 2):  # the base, and slot 2 (rank 0 here): untouched
                    assert torch.equal(fast[row], base_out[row]) and torch.equal(ref[row], base_out[row])
                else:
                    assert not torch.equal(fast[row], base_out[row])


def test_kernel_under_cpu_isa_avx2(tests_under_isa: Callable[..., str]) -> None:
    """``TOKENMILL_CPU_ISA=avx2`` (what an AVX2-only CPU runs): the kernel is built without AVX-512,
    a bfloat16 model gets float32 slots, and the kernel test above passes in that process."""
    output = tests_under_isa("avx2", f"{__file__}::test_kernel_and_reference_agree", "-k", "native")
    assert "2 passed" in output


def test_bf16_slots_hold_the_packed_adapter() -> None:
    """bfloat16 slots: ``pack`` converts once (the adapter's CPU copy), a swap-in copies it as is."""
    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.layers.lora import LoRALinear, LoRAStepState

    layer = LoRALinear(RowParallelLinear(8, 4), LoRAStepState(), 2, 3, slot_dtype=torch.bfloat16)
    bt = torch.arange(12, dtype=torch.float32).view(3, 4)  # [rank, out]
    a, packed = layer.pack(torch.full((3, 8), 0.1), bt)
    assert a.dtype == packed.dtype == torch.bfloat16 and torch.equal(packed.float(), bt)
    layer.set_slot(1, 3, a, packed)
    assert torch.equal(layer.lora_bt[1], packed) and torch.equal(layer.lora_a[1], a) and layer.ranks == [0, 3]


def test_smollm2_adapters_match_peft(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The bundled SmolLM2 (its GGUF, which tokenmill serves through the converted Hugging Face
    folder) with two rank-16 adapters and the base in one batch, against transformers + PEFT."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama_family import SMOL_PLAIN, hf_greedy, smollm2_gguf

    folder, name = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    adapters = [
        make_adapter(hf, str(tmp_path / f"s{i}"), f"s{i}", seed=40 + i, rank=16, scale=0.3) for i in range(2)
    ]
    llm = LLM("smollm2-135m", dtype="float32", num_blocks=96, enable_lora=True, max_loras=2, max_lora_rank=16)
    tokenizer = llm.get_tokenizer()
    texts = SMOL_PLAIN[:2]
    batch = [tokenizer.encode(text) for text in texts for _ in range(3)]
    choice = [None, 0, 1] * len(texts)
    requests = [None if c is None else lora(adapters[c], c) for c in choice]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], greedy(10), use_tqdm=False, lora_request=requests
    )
    for prompt, c, output in zip(batch, choice, outputs):
        want = hf_greedy(hf if c is None else adapters[c].merged, prompt, 10)
        assert output.outputs[0].token_ids == want, (c, tokenizer.decode(prompt))
    assert outputs[1].outputs[0].token_ids != outputs[0].outputs[0].token_ids
