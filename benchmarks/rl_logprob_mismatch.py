"""How far the engine's logprobs are from a trainer's: |Δ logprob| against a float32 recompute.

An RL trainer recomputes the logprobs of each rollout's tokens with its own float32 forward and
divides by the engine's (importance ratios); a mismatch biases the update. This samples rollouts on
the bundled SmolLM2 (temperature 1, seeded) in the default mode (``dtype auto``: bfloat16 on CPUs
that compute it natively, with the lossless int4/8-bit kernels) and with ``rl_exact_logprobs``, then
recomputes every sampled token's logprob with transformers in float32 over the same sequence, and
prints the mean and max |Δ| of each mode.

    .venv/bin/python benchmarks/rl_logprob_mismatch.py [--model smollm2-135m] [--rollouts 8] [--tokens 48]
"""

from __future__ import annotations

import argparse

import torch
import transformers

from tokenmill import LLM, SamplingParams
from tokenmill.loader import resolve_model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Three reasons to learn Rust are",
    "Once upon a time, in a small village,",
    "The derivative of x squared is",
    "My favourite recipe for pancakes:",
    "Explain photosynthesis in one sentence:",
]


def rollouts(llm: LLM, count: int, tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, sampled ids, their logprobs) of ``count`` seeded rollouts."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True, logprobs=0)
        for i in range(count)
    ]
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        sample = output.outputs[0]
        assert sample.logprobs is not None
        values = [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs)]
        results.append((output.prompt_token_ids, sample.token_ids, values))
    return results


def mismatch(
    reference: transformers.PreTrainedModel, results: list[tuple[list[int], list[int], list[float]]]
) -> tuple[float, float]:
    """Mean and max |engine logprob - float32 recompute| over every sampled token."""
    deltas = []
    with torch.no_grad():
        for prompt, sampled, values in results:
            logits = reference(torch.tensor([prompt + sampled])).logits[0].float()  # [len, vocab]
            logprobs = torch.log_softmax(logits, dim=-1)
            for i, (token, value) in enumerate(zip(sampled, values)):
                deltas.append(abs(value - logprobs[len(prompt) - 1 + i, token].item()))
    return sum(deltas) / len(deltas), max(deltas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    source = resolve_model(args.model)
    if source.format != "hf":
        raise SystemExit("the float32 recompute needs a Hugging Face folder (enable TOKENMILL_CONVERT_GGUF)")
    reference = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    rows = []
    for mode, kwargs in (("default", {}), ("rl_exact_logprobs", {"rl_exact_logprobs": True})):
        llm = LLM(args.model, num_threads=args.num_threads, seed=0, **kwargs)
        dtype = llm.engine.executor.runner.dtype  # type: ignore[attr-defined]
        mean, worst = mismatch(reference, rollouts(llm, args.rollouts, args.tokens))
        rows.append((mode, str(dtype).removeprefix("torch."), mean, worst))
        del llm
    count = args.rollouts * args.tokens
    print(f"{args.model}: {args.rollouts} rollouts x {args.tokens} sampled tokens ({count}), temperature 1")
    print(f"{'mode':<20}{'dtype':<10}{'mean |Δ|':>12}{'max |Δ|':>12}")
    for mode, dtype, mean, worst in rows:
        print(f"{mode:<20}{dtype:<10}{mean:>12.2e}{worst:>12.2e}")


if __name__ == "__main__":
    main()
