"""A tiny Llama whose greedy output is a fixed script chosen by the prompt's last word.

Tool-call and reasoning tests need a model that writes ``<tool_call>...</tool_call>`` or
``<think>...</think>`` on cue, through the real engine and server. This one is a real Llama
checkpoint whose weights make the next token a function of the current token only: every layer's
output projections are zero (so the residual stream is the token's embedding), embeddings are
one-hot and the LM head maps token ``i`` to ``next[i]`` with a margin of 80 logits, so even
temperature-1 sampling follows the script. Its word-level tokenizer decodes tokens joined by single
spaces, so a script is a list of pieces that JSON tolerates spaces between. A script's pieces must
be unique across all scripts (each token has one successor); tokens with no successor lead to EOS.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

UNK, EOS = "<unk>", "</s>"
LOGIT_MARGIN = 10.0  # times sqrt(hidden_size) = 8 after the final norm: 80 logits

# Renders tools, assistant tool calls (arguments must arrive as a dict for ``.city`` to render) and
# tool results, so that a test can check them through the prompt's token count; the last word of the
# last message is the cue.
CHAT_TEMPLATE = (
    "{%- if tools %}{% for t in tools %}tool {{ t.function.name }} {% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} "
    "{{ c.function.arguments.city }} {% endfor %}{% endif %}"
    "{%- if m.role == 'tool' %}result {{ m.tool_call_id }} {% endif %}"
    "{{ m.content or '' }} {% endfor %}"
)


def build_scripted_model(path: str, scripts: dict[str, list[str]]) -> None:
    """Save the model and tokenizer under ``path``: prompt ending in a cue word → that cue's script."""
    vocab: dict[str, int] = {UNK: 0, EOS: 1}
    successor: dict[int, int] = {}
    for cue, pieces in scripts.items():
        chain = [cue, *pieces]
        for piece in chain:
            if piece in vocab:
                raise ValueError(f"{piece!r} appears twice in the scripts")
            vocab[piece] = len(vocab)
        for current, following in zip(chain, chain[1:]):
            successor[vocab[current]] = vocab[following]
    size = max(64, -(-len(vocab) // 16) * 16)
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=size,
        intermediate_size=2 * size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()  # layers add nothing: the residual stream stays the token's embedding
        model.model.embed_tokens.weight.copy_(torch.eye(size))  # [vocab, hidden], one-hot rows
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(size, size)  # [vocab, hidden]
        for token in range(size):
            head[successor.get(token, 1), token] = LOGIT_MARGIN
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token=UNK)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
