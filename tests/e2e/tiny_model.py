"""A tiny random-weight Llama with a word-level tokenizer and a chat template, built on the fly.

Token ``i`` is the word ``<i>``; text is words separated by spaces, so tests can write prompts as
token ids or as text. ``<1>`` is EOS. The weights are spread wide so that argmax margins are large:
greedy output then does not depend on float rounding (batch shape), and different prompts give
different continuations. It allows long sequences so tests can keep a request running for seconds.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.conftest import spread_weights

VOCAB_SIZE = 256
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<2> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<3>{% endif %}"
)


def words(token_ids: list[int]) -> str:
    """The text of ``token_ids`` as the tiny tokenizer writes it."""
    return " ".join(f"<{t}>" for t in token_ids)


def build_tiny_model(path: str, max_positions: int = 4096) -> None:
    """Save a random 2-layer Llama and its tokenizer under ``path`` (a Hugging Face folder)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    # Wide margins with sampling that still varies: logits with std ~4 (the LM head at half scale).
    spread_weights(model, seed=0, norm=0.1, lm_head=0.5, layers=2.0)
    model.save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<1>", unk_token="<0>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
