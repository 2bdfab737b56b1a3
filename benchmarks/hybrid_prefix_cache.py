"""Multi-turn chat on a hybrid (linear + full attention) model: state snapshots in the prefix cache.

A ~50M-parameter random model shaped like Qwen3-Next (Gated DeltaNet layers with a full-attention
layer every fourth, MoE with a shared expert) runs C conversations of 4 turns each, one request at a
time, in two engines side by side in one process: the prefix cache on (turn N+1 resumes from the
state snapshot at turn N's last output block boundary plus the full-attention layers' cached blocks)
and off (every turn recomputes its whole history). Prints the time to first token of each turn for
both, the ratio on turns 3-4 (histories of ~1k tokens), the prefix-cache hit rate and the memory the
state snapshots hold, and whether the two engines' greedy tokens agree.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/hybrid_prefix_cache.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from tokenmill import LLM, SamplingParams
from tokenmill.protocol import EngineCoreRequest


def build_model(folder: str, vocab: int) -> int:
    """Save a random Qwen3-Next-shaped model to ``folder``; returns its parameter count."""
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return save_random_model(config, folder, vocab)


def save_random_model(config: transformers.PreTrainedConfig, folder: str, vocab: int) -> int:
    """Save a seeded random model of ``config`` (weights spread by ``_spread_weights``) and a word
    tokenizer of ``vocab`` words to ``folder``; returns its parameter count."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model)
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(vocab), unk_token="<unk>", eos_token="</s>"
    ).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _spread_weights(model: torch.nn.Module) -> None:
    """Wider random weights than the default init (std 0.02), whose near-uniform logits leave
    argmax ties that float rounding flips: greedy runs that compute the same thing in a different
    order (from a restored snapshot, or all at once) would then part ways for no real reason."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                continue
            noise = torch.randn(param.shape, generator=generator)
            scale = 1.0 if "embed_tokens" in name or "lm_head" in name else 2.0 / param.shape[-1] ** 0.5
            param.copy_(scale * noise)


def _word_tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def run_turn(llm: LLM, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """Run one request alone; returns its time to first token (seconds) and its tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(
        EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
    )
    ttft = 0.0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if not tokens and output.new_token_ids:
                ttft = time.perf_counter() - started
            tokens.extend(output.new_token_ids)
    return ttft, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--first-prompt", type=int, default=700, help="tokens of turn 1's prompt")
    parser.add_argument("--user-turn", type=int, default=128, help="new user tokens of each later turn")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (two spin badly on a busy machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="hybrid-bench-")
    num_params = build_model(folder, args.vocab)
    common = {"dtype": "float32", "block_size": 16, "num_blocks": 2048, "max_num_batched_tokens": 2048}
    engines = {"cache": LLM(folder, **common), "no cache": LLM(folder, enable_prefix_caching=False, **common)}
    generator = torch.Generator().manual_seed(1)

    def words(n: int) -> list[int]:
        return torch.randint(2, args.vocab, (n,), generator=generator).tolist()

    for llm in engines.values():  # one throw-away request each: lazy initialisation
        run_turn(llm, "warm-up", words(64), 2)
        llm.reset_prefix_cache()
        llm.engine.kv_manager.prefix_queried_tokens = llm.engine.kv_manager.prefix_hit_tokens = 0
    ttfts: dict[str, list[list[float]]] = {name: [[] for _ in range(4)] for name in engines}
    agree = True
    history_lengths: list[list[int]] = [[] for _ in range(4)]
    for c in range(args.conversations):
        first = words(args.first_prompt)
        histories = {name: list(first) for name in engines}
        user_turns = [words(args.user_turn) for _ in range(3)]
        for turn in range(4):
            outputs = {}
            for name, llm in engines.items():
                ttft, tokens = run_turn(llm, f"c{c}-t{turn}", histories[name], args.output_len)
                ttfts[name][turn].append(ttft)
                outputs[name] = tokens
            history_lengths[turn].append(len(histories["cache"]))
            agree = agree and outputs["cache"] == outputs["no cache"]
            if turn < 3:
                for name in engines:
                    histories[name] = histories[name] + outputs[name] + user_turns[turn]
    stats = engines["cache"].kv_stats()
    kv = engines["cache"].engine.kv_manager
    print(
        f"model: random Qwen3-Next shape, {num_params / 1e6:.1f}M parameters, float32, {args.threads} threads"
    )
    print(f"{args.conversations} conversations x 4 turns, {args.output_len} output tokens a turn")
    print(f"{'turn':>4} {'prompt':>7} {'TTFT cache (ms)':>16} {'TTFT no cache (ms)':>19} {'ratio':>6}")
    ratios = []
    for turn in range(4):
        with_cache = statistics.mean(ttfts["cache"][turn]) * 1e3
        without = statistics.mean(ttfts["no cache"][turn]) * 1e3
        length = statistics.mean(history_lengths[turn])
        ratio = without / with_cache
        if turn >= 2:
            ratios.append(ratio)
        print(f"{turn + 1:>4} {length:>7.0f} {with_cache:>16.1f} {without:>19.1f} {ratio:>6.2f}")
    print(f"turns 3-4 TTFT ratio (no cache / cache): {statistics.mean(ratios):.2f}x")
    hit_rate = kv.prefix_hit_tokens / max(kv.prefix_queried_tokens, 1)
    print(f"prefix-cache hit rate: {hit_rate:.1%} of prompt tokens")
    print(
        f"state snapshots: {stats['state_snapshots']} held, "
        f"{int(stats['state_snapshot_bytes']) / 1e6:.1f} MB ({int(stats['state_slot_bytes']) / 1e3:.0f} KB each)"
    )
    print(f"greedy tokens identical with and without the cache: {agree}")


if __name__ == "__main__":
    main()
