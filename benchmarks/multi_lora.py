"""Multi-LoRA serving: batched throughput over many adapters against the base model, and swap-in TTFT.

One process, one run of each configuration side by side: 64 requests (64 random prompt tokens, 32
output tokens, greedy, EOS ignored) on SmolLM2-135M, served by

- a plain engine (no LoRA: the base model's own speed, with every fast path it has);
- a LoRA engine running the base only (what wrapping the layers costs when no row uses an adapter);
- the LoRA engine with the requests spread round-robin over 1, 4 and 8 adapters of each rank
  (default 8, 16 and 64), all adapters in slots (``--max-loras 8``), every batch mixing them.

Then the time to first token of a one-token request whose adapter must be put into a device slot
(one slot, alternating between two adapters held on the CPU) against one whose adapter is already in
it, and one whose adapter must first be read again from its folder (evicted from a CPU cache of one).

Adapters are random PEFT-format folders (``adapter_config.json`` + ``adapter_model.safetensors``)
for every projection, written here with the model's shapes. Prints tokens/s and the ratios to the
plain engine.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/multi_lora.py
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from peers import cpu_name
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.loader import resolve_model
from tokenmill.lora import LoRARequest

SHAPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Wall-clock time, or with --cpu-time the CPU time of this process (the engine runs in it): on a
# machine shared with other work, CPU time barely moves when others take the cores, wall time does.
CLOCK = time.perf_counter


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    """A random rank-``rank`` LoRA on every projection of every layer, in PEFT's file layout."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    dims = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name, (fan_in, fan_out) in dims.items():
            group = "self_attn" if name in SHAPES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(SHAPES),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def throughput(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]
) -> float:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = CLOCK()
    outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)  # type: ignore[arg-type]
    elapsed = CLOCK() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def first_token_seconds(llm: LLM, prompt: list[int], lora: LoRARequest) -> float:
    start = CLOCK()
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
        lora_request=lora,
    )
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--swap-trials", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each is kept")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time with this process's CPU time, not the wall clock"
    )
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time

    source = resolve_model(args.model)
    hf_config = source.hf_config
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, hf_config.vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(enable_prefix_caching=False, max_num_seqs=args.num_requests, num_threads=args.num_threads)
    folder = Path(tempfile.mkdtemp(prefix="multi-lora-"))
    adapters = {
        (rank, i): LoRARequest(f"r{rank}-{i}", 1000 * rank + i, str(folder / f"r{rank}-{i}"))
        for rank in args.ranks
        for i in range(max(args.adapters))
    }
    for (rank, i), request in adapters.items():
        write_adapter(Path(request.lora_path), hf_config, rank, seed=rank * 100 + i)

    plain = LLM(args.model, **common)  # type: ignore[arg-type]
    lora_llm = LLM(
        args.model,
        enable_lora=True,
        max_loras=max(args.adapters),
        max_lora_rank=max(args.ranks),
        max_cpu_loras=len(adapters),
        **common,
    )  # type: ignore[arg-type]
    warm = prompts[:8]
    plain.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    lora_llm.generate(
        [{"prompt_token_ids": p} for p in warm],
        params,
        use_tqdm=False,
        lora_request=[adapters[(args.ranks[0], i % max(args.adapters))] for i in range(len(warm))],
    )
    for request in adapters.values():
        lora_llm.load_lora(request)

    # Rounds: each configuration once per round, interleaved, and the best round of each kept, so a
    # burst of load from other processes on a shared machine hits one round, not one configuration.
    configs: list[tuple[str, LLM, list[LoRARequest | None]]] = [
        ("plain engine, base model", plain, [None] * len(prompts)),
        ("LoRA engine, base model only", lora_llm, [None] * len(prompts)),
    ]
    for rank in args.ranks:
        for count in args.adapters:
            loras = [adapters[(rank, i % count)] for i in range(len(prompts))]
            configs.append((f"{count} adapter(s) of rank {rank}", lora_llm, loras))  # type: ignore[arg-type]
    best = {name: 0.0 for name, _, _ in configs}
    for _ in range(args.rounds):
        for name, llm, loras in configs:
            best[name] = max(best[name], throughput(llm, prompts, params, loras))
    rows = list(best.items())

    base = rows[0][1]
    print(f"\nmulti-LoRA throughput, {args.model}, {torch.get_num_threads()} threads, {cpu_name()}")
    print(
        f"{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output tokens),"
        f" best of {args.rounds} interleaved rounds, {'CPU' if args.cpu_time else 'wall-clock'} time\n"
    )
    print(f"{'configuration':36s} {'tok/s':>9s} {'vs plain':>9s}")
    for name, value in rows:
        print(f"{name:36s} {value:9.1f} {value / base:9.2f}")

    # Swap-in: one slot, two adapters alternating (each needs a slot load), against the same adapter
    # again (already in the slot), and against one that must be read from disk again.
    rank = 16 if 16 in args.ranks else args.ranks[0]
    swap_llm = LLM(
        args.model,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=max(args.ranks),
        max_cpu_loras=2,
        enable_prefix_caching=False,
        num_threads=args.num_threads,
    )
    first, second, third = adapters[(rank, 0)], adapters[(rank, 1)], adapters[(rank, 2 % max(args.adapters))]
    prompt = prompts[0]
    for request in (first, second):
        swap_llm.load_lora(request)
    first_token_seconds(swap_llm, prompt, first)
    resident, swapped = [], []
    for trial in range(args.swap_trials):
        resident.append(first_token_seconds(swap_llm, prompt, first if trial % 2 == 0 else second))
        swapped.append(first_token_seconds(swap_llm, prompt, second if trial % 2 == 0 else first))
        resident.append(first_token_seconds(swap_llm, prompt, second if trial % 2 == 0 else first))
    runner_lora = swap_llm.engine.executor.runner.lora  # type: ignore[attr-defined]
    slot_seconds = runner_lora.load_seconds_total / max(runner_lora.num_slot_loads, 1)
    swap_llm.load_lora(third)  # the CPU cache holds two: reading it evicts the older of them
    cached_ids = set(swap_llm.engine.executor.runner.lora.cpu_cache)  # type: ignore[attr-defined]
    by_name = swap_llm.engine.lora.adapters.by_name  # type: ignore[union-attr]
    evicted = next(r for r in (first, second) if by_name[r.lora_name].lora_id not in cached_ids)
    runner_lora = swap_llm.engine.executor.runner.lora  # type: ignore[attr-defined]
    loads_before, seconds_before = runner_lora.num_slot_loads, runner_lora.load_seconds_total
    cold = first_token_seconds(swap_llm, prompt, evicted)
    cold_load = runner_lora.load_seconds_total - seconds_before
    assert runner_lora.num_slot_loads == loads_before + 1
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(
        f"\nTTFT of a {args.input_len}-token request, rank {rank} adapters, one slot (median of {args.swap_trials}):"
    )
    print(f"  adapter already in the slot   {1000 * med(resident):7.1f} ms")
    print(
        f"  adapter swapped into the slot {1000 * med(swapped):7.1f} ms  (+{1000 * (med(swapped) - med(resident)):.1f} ms)"
    )
    print(f"  adapter read again from disk  {1000 * cold:7.1f} ms  (+{1000 * (cold - med(resident)):.1f} ms)")
    print(
        f"  slot load itself (timed in the worker): {1000 * slot_seconds:.2f} ms per swap from the CPU cache,"
        f" {1000 * cold_load:.2f} ms with the read from disk"
    )


if __name__ == "__main__":
    main()
