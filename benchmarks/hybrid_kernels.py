"""The hybrid models' recurrent C++ CPU kernels against the torch reference, in one run.

Two random models, one Qwen3-Next-shaped (Gated DeltaNet layers, full attention every fourth, MoE;
``benchmarks/hybrid_prefix_cache.py``'s) and one Nemotron-H-shaped (Mamba-2 blocks between attention
and MLP blocks), each loaded once; ``TOKENMILL_RECURRENT_KERNELS`` is read at every call, so the same
engine runs with the kernels (``1``) and the torch reference (``0``) in turn. Prints prefill tok/s (one
prompt alone, its time to first token) and decode tok/s (a batch decoding together, after its
prefill), both paths, and whether their greedy tokens agree.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/hybrid_kernels.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_prefix_cache import build_model, save_random_model  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def build_nemotron(folder: str, vocab: int) -> int:
    """Save a random Nemotron-H-shaped model to ``folder``; returns its parameter count."""
    config = transformers.NemotronHConfig(
        vocab_size=vocab,
        hidden_size=512,
        num_hidden_layers=8,
        layer_types=["linear_attention", "mlp", "linear_attention", "full_attention"] * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        mamba_num_heads=16,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=4,
        conv_kernel=4,
        chunk_size=64,
        intermediate_size=1024,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return save_random_model(config, folder, vocab)


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outputs]


def measure(llm: LLM, args: argparse.Namespace, vocab: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(2, vocab, (args.prompt_len,), generator=generator).tolist()
    batch = [torch.randint(2, vocab, (16,), generator=generator).tolist() for _ in range(args.batch)]
    results: dict[str, dict[str, float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for kernels in ("1", "0"):
        os.environ["TOKENMILL_RECURRENT_KERNELS"] = kernels
        timed(llm, [long_prompt[:32]], 2)  # warm-up
        prefill_s, _ = timed(llm, [long_prompt], 1)
        batch_prefill_s, _ = timed(llm, batch, 1)
        total_s, tokens[kernels] = timed(llm, batch, args.decode_len + 1)
        decode_s = max(total_s - batch_prefill_s, 1e-9)
        results[kernels] = {
            "prefill": args.prompt_len / prefill_s,
            "decode": args.batch * args.decode_len / decode_s,
        }
    results["agree"] = {"tokens": float(tokens["1"] == tokens["0"])}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = {
        "dtype": "float32",
        "block_size": 16,
        "num_blocks": 1024,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": False,
    }
    for name, build in (("qwen3_next", build_model), ("nemotron_h", build_nemotron)):
        folder = tempfile.mkdtemp(prefix=f"hybrid-kernels-{name}-")
        num_params = build(folder, args.vocab)
        llm = LLM(folder, **common)
        results = measure(llm, args, args.vocab)
        on, off = results["1"], results["0"]
        print(f"{name} ({num_params / 1e6:.0f}M params, float32, {args.threads} thread(s)):")
        for phase in ("prefill", "decode"):
            print(
                f"  {phase:8s} kernels {on[phase]:8.1f} tok/s   torch {off[phase]:8.1f} tok/s"
                f"   x{on[phase] / off[phase]:.2f}"
            )
        print(f"  greedy tokens agree: {bool(results['agree']['tokens'])}")
        del llm


if __name__ == "__main__":
    main()
