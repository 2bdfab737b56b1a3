"""Shared fixtures: tiny random-weight model folders, their transformers references, and the KV check.

Every ``LLM`` built while the tests run is recorded (weakly) so that, after each test, the KV-cache
invariant of DESIGN.md section 3 can be asserted on all of them: no request left behind, every block
free or held only by the prefix tree, and ``check_integrity()`` passing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

VOCAB_SIZE = 160
UNK, EOS = 0, 1
SPECIAL_TOKENS = ["<unk>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
FIRST_WORD = len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word(token_id: int) -> str:
    """The text of an ordinary (non-special) token of the tiny tokenizer."""
    assert token_id >= FIRST_WORD
    return f"w{token_id}"


# ---------------------------------------------------------------- tiny architectures


@dataclass(frozen=True)
class TinySpec:
    """A tiny config of one native architecture and what makes it interesting."""

    arch: str
    config_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)


TINY_SPECS: dict[str, TinySpec] = {
    # GQA (4 query heads over 2 KV heads), untied lm_head.
    "llama": TinySpec("llama", "LlamaConfig", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    # One KV head for all four query heads, tied embeddings, no sliding window.
    "mistral": TinySpec(
        "mistral",
        "MistralConfig",
        {"num_key_value_heads": 1, "tie_word_embeddings": True, "sliding_window": None},
    ),
    # Q/K/V biases (randomised below so that they matter), tied embeddings.
    "qwen2": TinySpec("qwen2", "Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # Per-head q/k RMSNorm and head_dim (24) != hidden_size / num_heads (16), untied.
    "qwen3": TinySpec(
        "qwen3", "Qwen3Config", {"num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False}
    ),
    # Llama with heads of 64 dimensions, the AMX prefill kernel's shape (named to sort last: the
    # weight seeds of the others follow the sorted names).
    "wide-heads": TinySpec(
        "llama", "LlamaConfig", {"num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False}
    ),
    # Llama with four layers, for passes stopped and resumed between inner layers (named to sort
    # after the others, whose weight seeds follow the sorted names).
    "x-four-layers": TinySpec(
        "llama",
        "LlamaConfig",
        {"num_key_value_heads": 2, "num_hidden_layers": 4, "tie_word_embeddings": False},
    ),
}


def _build_config(spec: TinySpec):  # type: ignore[no-untyped-def]
    import transformers

    cls = getattr(transformers, spec.config_cls)
    defaults: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "pad_token_id": UNK,
    }
    return cls(**{**defaults, **spec.kwargs})  # a spec may override a default (e.g. the layer count)


def spread_weights(
    model: torch.nn.Module, seed: int, *, norm: float = 0.2, lm_head: float = 1.0, layers: float = 3.0
) -> None:
    """Spread a Llama-style model's weights so that greedy outputs vary and argmax margins are wide.

    The default init (std 0.02) gives near-uniform logits, so a tiny model repeats one token and a
    batching bug could not be told from a correct run; it also leaves near-ties that float rounding
    may flip. Norm weights become ``1 + norm * noise`` and biases ``0.5 * noise`` (so that q/k norms
    and QKV biases change the output), embeddings unit noise, the LM head ``lm_head * noise``, and
    every other matrix ``layers`` times the variance-preserving scale: by default three times, so the
    layers outweigh the embedding (with tied embeddings a model otherwise repeats its last token).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + norm * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif "lm_head" in name:
                param.copy_(lm_head * noise)
            else:
                param.copy_(layers * noise / param.shape[-1] ** 0.5)


def _build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {text: i for i, text in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(FIRST_WORD, VOCAB_SIZE)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="</s>",
        pad_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(spec: TinySpec, seed: int, folder: str):  # type: ignore[no-untyped-def]
    """Build ``spec`` with spread random weights, save it and the tiny tokenizer to ``folder``;
    returns the transformers model (float32, eval mode), the reference for comparisons."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_build_config(spec), dtype=torch.float32).eval()
    spread_weights(model, seed=seed)
    model.save_pretrained(folder)
    _build_tokenizer().save_pretrained(folder)
    return model


@dataclass
class TinyModel:
    """A saved tiny model folder plus its transformers twin, the reference for every comparison."""

    arch: str
    path: str
    hf: Any  # transformers PreTrainedModel in float32, eval mode
    _greedy: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy continuation, never stopping at EOS (as ``ignore_eos=True``)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = self._generate(prompt, max_new_tokens)
        return list(self._greedy[key])

    def _generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=UNK,
        )
        return out[0, len(prompt) :].tolist()

    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), vocab]`` next-token log-probabilities at each position, in float32."""
        with torch.no_grad():
            logits = self.hf(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """Factory: ``tiny_model("qwen3")`` builds (once per session) a saved folder and its HF twin."""
    built: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in built:
            import transformers

            spec = TINY_SPECS[arch]
            config = _build_config(spec)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            spread_weights(model, seed=sorted(TINY_SPECS).index(arch))
            model.generation_config.eos_token_id = None
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(folder)
            _build_tokenizer().save_pretrained(folder)
            built[arch] = TinyModel(arch=arch, path=str(folder), hf=model)
        return built[arch]

    return get


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch on one thread. The models here are tiny or small, so a second thread gains little,
    and on a busy shared machine OpenMP threads spin at every barrier while a sibling is descheduled:
    transformers' greedy decode of SmolLM2 measured 2 s on one thread and 20-40 s on two."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------- the KV invariant after every test

_LIVE_LLMS: weakref.WeakSet[Any] = weakref.WeakSet()


@pytest.fixture(scope="session", autouse=True)
def _track_llms() -> Iterator[None]:
    """Record every ``LLM`` constructed during the session (the engine itself keeps no registry)."""
    from tokenmill.llm import LLM

    original = LLM.__init__

    # TOKENMILL_TEST_DEVICE=cuda runs every LLM of the session on that device (the references stay
    # on the CPU): how the engine is checked on a GPU machine, which CI does not have.
    device = os.environ.get("TOKENMILL_TEST_DEVICE")

    @functools.wraps(original)
    def tracking_init(self: LLM, *args: Any, **kwargs: Any) -> None:
        if device:
            kwargs.setdefault("device", device)
        original(self, *args, **kwargs)
        _LIVE_LLMS.add(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLM, "__init__", tracking_init)
        yield


@pytest.fixture(autouse=True)
def _kv_cache_is_clean_after_test() -> Iterator[None]:
    """After each test, every live LLM holds no request and no block outside the prefix tree."""
    yield
    for llm in list(_LIVE_LLMS):
        engine = llm.engine
        assert not engine.has_unfinished_requests(), "a request was left in the engine"
        assert not llm.output_processor.requests, "a request was left in the output processor"
        engine.kv_manager.check_integrity()
        assert engine.kv_manager.all_free_or_cached(), "blocks are still held outside the prefix tree"


# ---------------------------------------------------------------- a tiny model with a byte-level tokenizer

_BPE_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["red", "green"], "ok": true, "note": null}',
    '[{"x": 1, "y": -2.5}, {"x": 0, "y": 3e2}]',
    "The quick brown fox jumps over the lazy dog. Hello there, here is some data: 1 2 3.",
    "Call +1 555-0100 ext. 42 or write to zip 90210; yes, no, maybe not, ça va.",
]


@pytest.fixture(scope="session")
def structured_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with a byte-level BPE tokenizer (any text spells out; ~400 tokens).

    Grammars need tokens that spell text, so the word-level test tokenizer will not do; this one is
    trained in milliseconds on a few lines. The weights are spread so greedy choices have clear
    margins and seeded sampling still varies.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_BPE_CORPUS, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    spread_weights(model, seed=0, lm_head=0.5, layers=2.0)
    folder = tmp_path_factory.mktemp("tiny-structured")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tests_under_isa() -> Callable[..., str]:
    """``run(isa, target, *args)``: pytest on ``target`` (a file or test id, with ``args``) in a fresh
    process under ``TOKENMILL_CPU_ISA=isa`` (the kernels built for that path); asserts it passed and
    returns its output."""

    def run(isa: str, target: str, *args: str) -> str:
        env = {**os.environ, "TOKENMILL_CPU_ISA": isa}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target, *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    return run
