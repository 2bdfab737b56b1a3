"""Quality of the opt-in int8 / int4 weights against bfloat16, on ShareGPT text (issue 5's quality guard).

Prints, for SmolLM2-135M and each mode of ``--quantization`` (default int8):
- perplexity of the ShareGPT answers (prompt log-probabilities of "question + answer" texts, scored
  on the answer tokens) in bfloat16 and in the quantized mode, and their ratio;
- greedy agreement: for chat prompts made of ShareGPT questions, the fraction of generated tokens
  that equal bfloat16's output up to the first divergence, and the fraction of fully identical
  completions.

    .venv/bin/python benchmarks/quantization_quality.py [--quantization int8 int4] [--num-texts 64] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import _first_turns
from tokenmill.bench.sharegpt import sharegpt_path


def texts(count: int, max_tokens: int, tokenizer: Any) -> list[tuple[list[int], int]]:
    """(token ids of question + answer, index of the first answer token), cut to ``max_tokens``."""
    out = []
    for question, answer in _first_turns(str(sharegpt_path())):
        q_ids = tokenizer(question + "\n", add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(q_ids) > max_tokens // 2 or len(a_ids) < 32:
            continue
        out.append(((q_ids + a_ids)[:max_tokens], len(q_ids)))
        if len(out) == count:
            break
    return out


def perplexity(llm: LLM, samples: list[tuple[list[int], int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in samples], params, use_tqdm=False)
    total, count = 0.0, 0
    for (ids, start), output in zip(samples, outputs, strict=True):
        assert output.prompt_logprobs is not None
        for position in range(max(start, 1), len(ids)):
            entry = output.prompt_logprobs[position]
            assert entry is not None
            total -= entry[ids[position]].logprob
            count += 1
    return math.exp(total / count)


def greedy(llm: LLM, questions: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-texts", type=int, default=64)
    parser.add_argument("--max-text-tokens", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quantization", nargs="+", default=["int8"], choices=["int8", "int4", "default"])
    args = parser.parse_args()

    results: dict[str, dict[str, Any]] = {}
    samples: list[tuple[list[int], int]] = []
    questions: list[str] = []
    for mode in ("none", *args.quantization):
        # "none": the weights as loaded on the bfloat16 path alone (not even the lossless int4 kernel);
        # "default": what LLM() does unasked (the int4 kernel on exactly 4-bit layers).
        llm = LLM("smollm2-135m", dtype="bfloat16", quantization=None if mode == "default" else mode)
        if not samples:
            samples = texts(args.num_texts, args.max_text_tokens, llm.get_tokenizer())
            questions = [q[:600] for q, _ in _first_turns(str(sharegpt_path()))][: args.num_prompts]
        results["bf16" if mode == "none" else mode] = {
            "ppl": perplexity(llm, samples),
            "greedy": greedy(llm, questions, args.output_len),
        }
        del llm

    base = results["bf16"]
    print(
        f"ShareGPT: {len(samples)} texts for perplexity, {len(questions)} chat prompts x {args.output_len} greedy tokens"
    )
    for mode in args.quantization:
        quant = results[mode]
        prefix_fractions, identical = [], 0
        for ref, got in zip(base["greedy"], quant["greedy"], strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
            )
            prefix_fractions.append(same / max(len(ref), 1))
            identical += ref == got
        print(
            f"perplexity  bf16 {base['ppl']:.3f}  {mode} {quant['ppl']:.3f}  ratio {quant['ppl'] / base['ppl']:.4f}"
        )
        print(
            f"{mode} greedy agreement with bf16: mean matching prefix {statistics.mean(prefix_fractions) * 100:.1f}% "
            f"of tokens, {identical}/{len(questions)} completions identical"
        )


if __name__ == "__main__":
    main()
