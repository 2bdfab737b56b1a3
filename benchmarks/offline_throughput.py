"""Offline throughput: tokenmill vs transformers (static batching), same model, dtype and prompts.

Prints output tokens/s for each and the ratio. Default workload (issue 2): 256 prompts of 128 random
token ids, 128 output tokens each with EOS ignored, SmolLM2-135M in bfloat16. Both sides load the same
GGUF file: any bundled GGUF alias works (``--model gemma3-270m`` for Gemma 3 270M, whose sliding and
global layers and 262k vocabulary make a different workload), and so does a Hugging Face folder.
``--device cuda`` runs both sides on the GPU.

    .venv/bin/python benchmarks/offline_throughput.py [--model gemma3-270m] [--num-prompts 256]

``--model-impl compare`` runs tokenmill twice on the same architecture, with its native model code
and with the transformers fallback (transformers' model code over our paged KV cache), and prints
the fallback's throughput as a fraction of the native one.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import torch


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: small vocabularies put special tokens there.
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_tokenmill(args: argparse.Namespace, prompts: list[list[int]], model_impl: str = "auto") -> float:
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        args.model,
        model_impl=model_impl,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return num_tokens / elapsed


def gguf_location(model: str) -> tuple[str, str]:
    """The folder and file name of the GGUF behind a bundled alias (or a .gguf path)."""
    from tokenmill.loader.bundled import BUNDLED_MODELS, locate_bundled

    path = locate_bundled(model) if model in BUNDLED_MODELS else model
    if not path.endswith(".gguf"):
        raise SystemExit(f"this needs a bundled GGUF alias or a .gguf file, got {model!r}")
    folder, name = os.path.split(os.path.abspath(path))
    return folder, name


def load_transformers(model: str, dtype: torch.dtype, device: str) -> Any:
    """transformers' model of a Hugging Face folder, a bundled GGUF alias or a .gguf file."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(model):
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    else:
        folder, name = gguf_location(model)
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return hf_model.to(device).eval()


def vocab_size_of(model: str) -> int:
    from tokenmill.loader import resolve_model

    return int(resolve_model(model).hf_config.vocab_size)


def run_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") else torch.float32
    model = load_transformers(args.model, dtype, args.device)
    batch = args.hf_batch_size
    with torch.inference_mode():
        warm = torch.tensor(prompts[:2], device=args.device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        num_tokens = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=args.device)  # equal lengths: no padding
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
            )
            num_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return num_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda, for both sides")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also run llama-batched-bench on the same GGUF ($LLAMA_CPP_BIN), same prompt/output lengths",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "native", "transformers", "compare"],
        help="tokenmill's model code; compare runs native and the transformers fallback",
    )
    args = parser.parse_args()

    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size_of(args.model), args.seed)
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads"
    )
    if args.model_impl == "compare":
        ours = run_tokenmill(args, prompts, "native")
        print(f"tokenmill    : {ours:8.1f} output tok/s (native model code)")
        fallback = run_tokenmill(args, prompts, "transformers")
        print(f"tokenmill    : {fallback:8.1f} output tok/s (transformers fallback)")
        print(f"fallback     : {fallback / ours:8.2f}x native")
    else:
        ours = run_tokenmill(args, prompts, args.model_impl)
        print(f"tokenmill    : {ours:8.1f} output tok/s ({args.model_impl} model code)")
    if args.llama_cpp:
        peer = run_llama_cpp(args)
        print(
            f"llama.cpp    : {peer:8.1f} output tok/s (llama-batched-bench, {min(args.num_prompts, args.max_num_seqs)} parallel)"
        )
        print(f"vs llama.cpp : {ours / peer:8.2f}x")
    if args.skip_transformers:
        return
    theirs = run_transformers(args, prompts)
    print(f"transformers : {theirs:8.1f} output tok/s (static batches of {args.hf_batch_size})")
    print(f"ratio        : {ours / theirs:8.2f}x")


def run_llama_cpp(args: argparse.Namespace) -> float:
    """End-to-end output tokens/s of llama-batched-bench (prompt processing included, as ours is)."""
    from peers import llama_batched_bench, llama_cpp_tool

    binary = llama_cpp_tool("llama-batched-bench", None)
    if binary is None:
        raise SystemExit("llama-batched-bench not found: set LLAMA_CPP_BIN (see ../shared/PEERS.md)")
    folder, name = gguf_location(args.model)
    parallel = min(args.num_prompts, args.max_num_seqs)
    row = llama_batched_bench(binary, os.path.join(folder, name), parallel, args.input_len, args.output_len)
    return parallel * args.output_len / float(row["t"])


if __name__ == "__main__":
    main()
