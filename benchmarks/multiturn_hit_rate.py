"""Prefix-cache hit rate over multi-turn ShareGPT conversations replayed turn by turn (issue 4).

Takes ``--num-conversations`` ShareGPT conversations with at least ``--min-turns`` user turns and
replays them in rounds: round k sends, for every conversation, the chat prompt of its first k user
turns with the dataset's own assistant answers in between (so turn k+1's prompt extends turn k's).
All conversations of a round are sent together, so they compete for the cache. Prints the share of
prompt tokens served from the cache (``num_cached_tokens``) against the share that could be: the
part of each prompt that repeats the conversation's previous prompt, rounded down to whole blocks.

    .venv/bin/python benchmarks/multiturn_hit_rate.py [--num-conversations 32] [--max-turns 4]
"""

from __future__ import annotations

import argparse

from tokenmill import LLM, SamplingParams
from tokenmill.bench.sharegpt import iter_conversations, sharegpt_path


def conversations(count: int, min_turns: int, max_turns: int) -> list[list[dict[str, str]]]:
    """Alternating user/assistant messages (cut to ``max_turns`` user turns) of ``count`` conversations."""
    out = []
    for record in iter_conversations(sharegpt_path()):
        turns = record.get("conversations")
        if not isinstance(turns, list):
            continue
        messages: list[dict[str, str]] = []
        for turn in turns:
            role = {"human": "user", "gpt": "assistant"}.get(
                turn.get("from") if isinstance(turn, dict) else None
            )
            value = turn.get("value") if isinstance(turn, dict) else None
            expected = "user" if len(messages) % 2 == 0 else "assistant"
            if role != expected or not isinstance(value, str) or not value:
                break
            messages.append({"role": role, "content": value[:2000]})
        user_turns = (len(messages) + 1) // 2
        if user_turns >= min_turns:
            out.append(messages[: 2 * max_turns])
        if len(out) == count:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-conversations", type=int, default=32)
    parser.add_argument("--min-turns", type=int, default=3)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--kv-cache-memory", type=float, default=0.3)
    args = parser.parse_args()

    llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory=args.kv_cache_memory)
    tokenizer = llm.get_tokenizer()
    block_size = llm.engine.config.cache.block_size
    convs = conversations(args.num_conversations, args.min_turns, args.max_turns)
    previous: dict[int, list[int]] = {}
    prompt_tokens = cached_tokens = reusable_tokens = 0
    params = SamplingParams(temperature=0, max_tokens=1)
    for round_index in range(args.max_turns):
        batch: list[tuple[int, list[int]]] = []
        for index, messages in enumerate(convs):
            upto = 2 * round_index + 1
            if upto > len(messages):
                continue
            text = tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: llm.engine.max_model_len - 1]
            batch.append((index, ids))
        if not batch:
            break
        outputs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], params, use_tqdm=False)
        for (index, ids), output in zip(batch, outputs, strict=True):
            before = previous.get(index, [])
            common = next(
                (i for i, (a, b) in enumerate(zip(before, ids, strict=False)) if a != b),
                min(len(before), len(ids)),
            )
            reusable_tokens += min(common, len(ids) - 1) // block_size * block_size
            prompt_tokens += len(ids)
            cached_tokens += output.num_cached_tokens
            previous[index] = ids
    print(f"{len(convs)} ShareGPT conversations, up to {args.max_turns} user turns, replayed turn by turn")
    print(
        f"prompt tokens {prompt_tokens}, served from the prefix cache {cached_tokens} ({cached_tokens / prompt_tokens:.1%})"
    )
    print(
        f"reusable (the previous turn's prompt, whole blocks): {reusable_tokens} ({reusable_tokens / prompt_tokens:.1%})"
    )
    print(
        f"cached / reusable: {cached_tokens / max(reusable_tokens, 1):.1%} (above 100% when conversations also "
        "share a prefix with each other, such as the chat template's system prompt)"
    )


if __name__ == "__main__":
    main()
