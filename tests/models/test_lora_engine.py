"""LoRA in the engine beyond the mixed batch: bad adapters, unload and reload, preemption, quantized
bases, structured outputs, and combinations refused at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.models.lora_adapters import make_adapter
from tests.models.test_lora import NUM_NEW, greedy, prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import build_engine_config
from tokenmill.lora import LoRARequest


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):  # type: ignore[no-untyped-def]
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(tiny_llama):  # type: ignore[no-untyped-def]
    # Few blocks, so that a batch of long generations must preempt.
    return LLM(
        tiny_llama.path,
        dtype="float32",
        block_size=4,
        num_blocks=40,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):  # type: ignore[no-untyped-def]
    return make_adapter(tiny_llama.hf, str(tmp_path_factory.mktemp("good")), "good", seed=1, rank=8)


def test_bad_adapters_are_clear_errors(engine, tiny_llama, tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    def load(path: Path | str, name: str = "bad") -> None:
        engine.load_lora(LoRARequest(name, 1, str(path)))

    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "missing")
    big = make_adapter(tiny_llama.hf, str(tmp_path / "big"), "big", seed=2, rank=16)
    with pytest.raises(ValueError, match="rank 16 .* above max_lora_rank 8"):
        load(big.path)
    pickled = tmp_path / "pickled"
    shutil.copytree(big.path, pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(
        ValueError, match=r"no adapter_model.safetensors \(found adapter_model.bin \(a pickle"
    ):
        load(pickled)
    other = tiny_model("qwen3")  # head_dim 24: q/k/v projections of other shapes
    mismatched = make_adapter(other.hf, str(tmp_path / "other"), "other", seed=3, rank=4)
    with pytest.raises(ValueError, match=r"lora_B has 48 outputs, the base layer 64|lora_B has \d+ outputs"):
        load(mismatched.path)
    embedding = make_adapter(
        tiny_llama.hf, str(tmp_path / "emb"), "emb", seed=4, rank=4, targets=("embed_tokens",)
    )
    with pytest.raises(ValueError, match="not a lora_A / lora_B weight of a linear layer"):
        load(embedding.path)
    dora = tmp_path / "dora"
    shutil.copytree(big.path, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        load(dora)
    with pytest.raises(ValueError, match=r"LoRA adapter 'nope' is not loaded"):
        engine.engine.add_request(_core_request("x", "nope"))
    assert engine.kv_stats()["lora_loaded_adapters"] == 0  # nothing half-registered


def _core_request(request_id: str, lora_name: str):  # type: ignore[no-untyped-def]
    from tokenmill.protocol import EngineCoreRequest

    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7], sampling_params=greedy(), lora_name=lora_name
    )


def test_unload_reload_and_preemption(engine, tiny_llama, adapter, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Long generations over few blocks (so requests are preempted) match the reference; unloading
    fails waiting requests with a message and lets running ones finish; a reload from other weights
    under the same name never reuses the old adapter's cached KV."""
    request = LoRARequest("good", 1, adapter.path)
    batch = prompts(6, seed=21)
    params = greedy(24)
    preempted_before = engine.kv_stats()["num_preemptions"]
    outputs = engine.generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=request
    )
    assert engine.kv_stats()["num_preemptions"] > preempted_before
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == adapter.greedy(prompt, 24)
    # Unload while one request runs and one waits (max_num_seqs=1 holds the second back).
    core = engine.engine
    core.scheduler.config.max_num_seqs = 1
    try:
        core.add_request(_core_request("run", "good"))
        core.add_request(_core_request("wait", "good"))
        outputs_by_id: dict[str, list] = {"run": [], "wait": []}  # type: ignore[type-arg]
        for out in core.step().outputs:
            outputs_by_id[out.request_id].append(out)
        answer = engine.call_utility("unload_lora", lora_name="good")
        assert answer == {"lora_name": "good", "failed_waiting": 1, "finishing_running": 1}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                outputs_by_id[out.request_id].append(out)
    finally:
        core.scheduler.config.max_num_seqs = 256
    assert outputs_by_id["wait"][-1].error == "LoRA adapter 'good' was unloaded"
    run_tokens = [t for out in outputs_by_id["run"] for t in out.new_token_ids]
    assert run_tokens == adapter.greedy([5, 6, 7], NUM_NEW)
    assert engine.kv_stats()["lora_loaded_adapters"] == 0
    with pytest.raises(ValueError, match="not loaded"):
        core.add_request(_core_request("late", "good"))
    # Reload the name from different weights: the outputs are the new adapter's.
    other = make_adapter(tiny_llama.hf, str(tmp_path / "v2"), "good", seed=77, rank=8)
    (output,) = engine.generate(
        [{"prompt_token_ids": batch[0]}],
        params,
        use_tqdm=False,
        lora_request=LoRARequest("good", 1, other.path),
    )
    assert output.outputs[0].token_ids == other.greedy(batch[0], 24)
    engine.unload_lora("good")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_lora_beside_a_quantized_base(quantization: str) -> None:
    """The delta is added in the activation dtype beside a quantized base layer's own product, from
    float32 slots and (where the CPU has AVX512-BF16) bfloat16 ones."""
    from tokenmill.layers import lora_kernel
    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.layers.lora import LoRABatch, LoRALinear, LoRAStepState

    torch.manual_seed(0)
    base = RowParallelLinear(64, 32, dtype=torch.bfloat16)
    base.weight.data.copy_(torch.randn(32, 64).to(torch.bfloat16))
    assert base.quantize_weights(quantization) is None
    a, bt = torch.randn(8, 64).to(torch.bfloat16), torch.randn(8, 32).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    batch = LoRABatch.build([(1, 2), (-1, 1)], torch.device("cpu"))
    plain = base(x)
    expected = plain[:2].float() + (x[:2].float() @ a.float().T) @ bt.float()
    for slot_dtype in {torch.float32, lora_kernel.slot_dtype(torch.bfloat16, torch.device("cpu"))}:
        state = LoRAStepState()
        layer = LoRALinear(base, state, max_loras=2, max_rank=8, slot_dtype=slot_dtype)
        layer.set_slot(1, 8, *layer.pack(a.float(), bt.float()))
        with state.bound(batch):
            out = layer(x)
        torch.testing.assert_close(out[:2].float(), expected, rtol=0.02, atol=0.5)
        assert torch.equal(out[2], plain[2])


def test_structured_output_under_lora(structured_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A choice constraint holds under an adapter (structured outputs compose by construction)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(structured_model_dir, dtype=torch.float32)
    adapter = make_adapter(hf, str(tmp_path / "s"), "s", seed=5, rank=4)
    llm = LLM(
        structured_model_dir, dtype="float32", num_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=4
    )
    from tokenmill.sampling_params import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    (output,) = llm.generate(
        ["Pick:"], params, use_tqdm=False, lora_request=LoRARequest("s", 1, adapter.path)
    )
    assert output.outputs[0].text in choices


def test_lora_under_the_multiprocess_executor(tiny_llama, adapter, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Slots reach the worker process through collective_rpc and the plan deltas: two adapters and
    the base over one slot match the reference; a bad adapter's error comes back from the worker."""
    other = make_adapter(tiny_llama.hf, str(tmp_path / "other"), "other", seed=8, rank=4)
    llm = LLM(
        tiny_llama.path,
        dtype="float32",
        block_size=4,
        num_blocks=200,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        executor_backend="mp",
    )
    try:
        batch = prompts(6, seed=31)
        choice = [0, None, 1, 0, 1, None]
        requests = [
            None if c is None else LoRARequest(*(("good", 1, adapter.path), ("other", 2, other.path))[c])
            for c in choice
        ]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False, lora_request=requests
        )
        for prompt, c, output in zip(batch, choice, outputs):
            want = (
                tiny_llama.greedy(prompt, NUM_NEW)
                if c is None
                else (adapter, other)[c].greedy(prompt, NUM_NEW)
            )
            assert output.outputs[0].token_ids == want
        with pytest.raises(ValueError, match="does not exist"):
            llm.load_lora(LoRARequest("bad", 3, str(tmp_path / "missing")))
    finally:
        llm.engine.shutdown()


def test_refused_combinations(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="max_cpu_loras .* must be >= max_loras"):
        build_engine_config(tiny_llama.path, enable_lora=True, max_loras=4, max_cpu_loras=2).validate()
    with pytest.raises(ValueError, match="LoRA with the transformers model implementation"):
        LLM(tiny_llama.path, dtype="float32", num_blocks=16, enable_lora=True, model_impl="transformers")
    llm = LLM(tiny_llama.path, dtype="float32", num_blocks=16)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate(["x"], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_bfloat16_model_with_bfloat16_slots_tracks_peft(tiny_llama, adapter) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 model keeps its slots in bfloat16 where the kernel has AVX512-BF16 (float32
    elsewhere), and its prompt logprobs under the adapter follow PEFT's float32 reference within
    the error bfloat16 gives the base model alone (float32 transformers), far closer than to the
    base model's."""
    from tokenmill.layers import lora_kernel

    llm = LLM(
        tiny_llama.path,
        dtype="bfloat16",
        block_size=4,
        num_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    layers = llm.engine.executor.runner.lora.layers.values()
    want = lora_kernel.slot_dtype(torch.bfloat16, torch.device("cpu"))
    assert {layer.lora_a.dtype for layer in layers} == {want}
    prompt = [11 + (7 * i) % 140 for i in range(40)]
    (output,) = llm.generate(
        [{"prompt_token_ids": prompt}],
        greedy(1, prompt_logprobs=1),
        use_tqdm=False,
        lora_request=LoRARequest("good", 1, adapter.path),
    )
    ours = torch.tensor([output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    positions = torch.arange(len(prompt) - 1)
    targets = torch.tensor(prompt[1:])
    with_adapter = adapter.log_softmax(prompt)[positions, targets]  # [len - 1]
    base = tiny_llama.log_softmax(prompt)[positions, targets]
    error, gap = (ours - with_adapter).abs().mean().item(), (base - with_adapter).abs().mean().item()
    (plain,) = llm.generate([{"prompt_token_ids": prompt}], greedy(1, prompt_logprobs=1), use_tqdm=False)
    ours_base = torch.tensor([plain.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    base_error = (ours_base - base).abs().mean().item()
    assert error < 0.2 * gap and error < 1.25 * base_error, (error, gap, base_error)
