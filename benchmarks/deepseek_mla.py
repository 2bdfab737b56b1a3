"""DeepSeek-V3's multi-head latent attention: KV memory per token, and decode speed native vs fallback.

1. KV bytes per token for the real DeepSeek-V3 and Kimi K2 shapes (from their configs' numbers):
   the latent cache (``kv_lora_rank + qk_rope_head_dim`` per layer) against a per-head cache of keys
   and values (what an engine without MLA stores), and the ratio.
2. A ~100M-parameter random-weight DeepSeek-V3-shaped model (8 layers, the first dense, 12 routed
   experts of which 4 per token plus a shared one, q/kv LoRA ranks, YaRN), run twice in one process:
   the native implementation (latent cache, absorbed decode) and the transformers fallback on the same
   weights (``model_impl="transformers"``: transformers' modelling code over a per-head paged cache).
   Greedy decode of ``--batch`` sequences: output tok/s, the ratio, the KV bytes per token each engine
   allocated, and whether their greedy tokens agree.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/deepseek_mla.py
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from typing import Any

import torch
import transformers
from peers import cpu_name, git_describe

from tokenmill import LLM, SamplingParams
from tokenmill.loader import resolve_model

# name: (layers, heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
REAL_SHAPES = {
    "DeepSeek-V3": (61, 128, 512, 64, 128, 128),
    "Kimi-K2": (61, 64, 512, 64, 128, 128),
}
BENCH_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 512,
    "intermediate_size": 1408,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 12,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "tie_word_embeddings": False,
}


def kv_table(bytes_per_element: int) -> None:
    print(f"KV cache bytes per token ({bytes_per_element}-byte elements, all layers):")
    print(f"{'model':<12} {'latent (MLA)':>14} {'per-head K+V':>14} {'ratio':>7}")
    for name, (layers, heads, rank, rope, nope, v) in REAL_SHAPES.items():
        latent = layers * (rank + rope) * bytes_per_element
        per_head = layers * heads * ((nope + rope) + v) * bytes_per_element
        print(f"{name:<12} {latent:>14,} {per_head:>14,} {per_head / latent:>6.1f}x")


def build_model(folder: str) -> int:
    """Save the random DeepSeek-V3-shaped model (and SmolLM2's tokenizer) to ``folder``; its size."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**BENCH_CONFIG, bos_token_id=None, eos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    resolve_model("smollm2-135m").load_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run(folder: str, impl: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict[str, Any]:
    llm = LLM(folder, model_impl=impl, dtype=dtype, num_blocks=256, block_size=16)
    runner = llm.engine.executor.runner
    kv_per_token = runner.kv_cache_bytes / (runner.num_blocks * runner.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    del llm, runner
    gc.collect()
    return {
        "tok_s": sum(len(t) for t in tokens) / elapsed,
        "seconds": elapsed,
        "kv_per_token": kv_per_token,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print(f"{git_describe()} on {cpu_name()}, {torch.get_num_threads()} threads")
    kv_table(2)
    print()
    with tempfile.TemporaryDirectory() as folder:
        num_params = build_model(folder)
        print(f"random DeepSeek-V3-shaped model: {num_params / 1e6:.0f}M parameters")
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(100, 40000, (args.batch, args.prompt_len), generator=generator).tolist()
        results = {
            impl: run(folder, impl, prompts, args.max_tokens, args.dtype)
            for impl in ("native", "transformers")
        }
    native, fallback = results["native"], results["transformers"]
    print(
        f"greedy decode, {args.batch} sequences x {args.max_tokens} tokens after {args.prompt_len}-token prompts"
    )
    print(f"{'implementation':<14} {'tok/s':>8} {'seconds':>8} {'KV bytes/token':>15}")
    for impl, result in results.items():
        print(
            f"{impl:<14} {result['tok_s']:>8.1f} {result['seconds']:>8.2f} {result['kv_per_token']:>15,.0f}"
        )
    print(
        f"native / transformers: {native['tok_s'] / fallback['tok_s']:.2f}x tok/s, "
        f"{fallback['kv_per_token'] / native['kv_per_token']:.1f}x less KV per token"
    )
    same = sum(a == b for a, b in zip(native["tokens"], fallback["tokens"]))
    print(f"greedy outputs identical: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
