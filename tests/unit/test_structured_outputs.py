"""Structured outputs end to end in the engine: a tiny random Llama with a byte-level BPE tokenizer.

A random model has no idea of JSON, so every valid output here is the grammar's doing. Sampling is
seeded and ``max_tokens`` generous: every output must parse, validate and end with ``stop`` (the
grammar's end), and the masks must leave unconstrained rows exactly as they were.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required and optional fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "[0-9]{5}"},
                },
                "required": ["zip"],
            },
        },
        "required": ["name", "address"],
    },
    {  # arrays with min/max items, enums
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "level": {"enum": ["low", "high", 3]},
        },
        "required": ["tags", "level"],
    },
    {  # integers and numbers with bounds, booleans, nulls
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 5},
        },
        "required": ["age", "score", "ok", "note"],
    },
    {  # top-level array of patterned strings
        "type": "array",
        "items": {"type": "string", "pattern": "[a-z]{2,4}-[0-9]{1,3}"},
        "minItems": 2,
        "maxItems": 4,
    },
    {  # $defs and $ref, anyOf
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/point"},
            "q": {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/point"}]},
        },
        "required": ["p", "q"],
    },
]

PROMPTS = ["Write JSON:", "The answer is", "Hello there, here is some data", "1 2 3"]


def json_params(schema: dict[str, Any], **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        **{"max_tokens": 200, "temperature": 1.0, **kwargs},
    )


@pytest.fixture(scope="module")
def llm(structured_model_dir: str) -> LLM:
    return LLM(structured_model_dir, dtype="float32", max_model_len=512, num_blocks=256)


def texts(outputs) -> list[tuple[str, str | None]]:  # type: ignore[no-untyped-def]
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def token_ids(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def test_json_schema_outputs_always_validate(llm: LLM) -> None:
    params = [json_params(schema, seed=100 + i, n=2) for i, schema in enumerate(SCHEMAS) for _ in PROMPTS]
    prompts = [prompt for _ in SCHEMAS for prompt in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, output in enumerate(outputs):
        schema = SCHEMAS[i // len(PROMPTS)]
        assert len(output.outputs) == 2
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice(llm: LLM) -> None:
    # json_object is tested with SmolLM2 (tests/e2e): a random model never closes its free-form keys.
    regex = r"(\+1 )?[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,3})?"
    choices = ["yes", "no", "maybe not", "ça va", "a.b (c)"]
    kinds = [
        StructuredOutputsParams(regex=regex),
        StructuredOutputsParams(choice=choices),
    ]
    params = [
        SamplingParams(structured_outputs=kind, seed=seed, max_tokens=150, n=3)
        for kind in kinds
        for seed in range(3)
    ]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            if i < 3:
                assert re.fullmatch(regex, completion.text), completion.text
            else:
                assert completion.text in choices
    # Seeded siblings each have their own matcher and their own stream: they do not all agree.
    assert len({c.text for o in outputs[3:6] for c in o.outputs}) > 1


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm: LLM) -> None:
    free = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(seed=5, max_tokens=12),
    ]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS[:2] + PROMPTS[2:],
        free
        + [
            json_params(SCHEMAS[0], seed=1),
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
        ],
        use_tqdm=False,
    )
    assert token_ids(mixed[:2]) == token_ids(alone)


def test_jump_forward_on_and_off_give_identical_outputs(structured_model_dir: str, llm: LLM) -> None:
    off = LLM(structured_model_dir, dtype="float32", max_model_len=512, num_blocks=256, jump_forward=False)
    params = [json_params(schema, temperature=0.0) for schema in SCHEMAS] + [
        json_params(schema, seed=7 + i) for i, schema in enumerate(SCHEMAS)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    forced_before = llm.engine.scheduler.num_forced_tokens_total
    with_jump = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_forced_tokens_total > forced_before
    without = off.generate(prompts, params, use_tqdm=False)
    assert off.engine.scheduler.num_forced_tokens_total == 0
    assert texts(with_jump) == texts(without)
    assert token_ids(with_jump) == token_ids(without)


def test_logprobs_are_reported_for_every_token(llm: LLM) -> None:
    params = json_params(SCHEMAS[1], seed=3, logprobs=2)
    (output,) = llm.generate(["Tags:"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position
    jsonschema.validate(json.loads(completion.text), SCHEMAS[1])


def test_preemption_and_prefix_caching_keep_matchers_consistent(structured_model_dir: str, llm: LLM) -> None:
    shared = "A long shared system preamble that many requests start with, "
    prompts = [shared + p for p in PROMPTS]
    params = [
        json_params(SCHEMAS[i % len(SCHEMAS)], seed=20 + i, n=2, max_tokens=120) for i in range(len(prompts))
    ]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(structured_model_dir, dtype="float32", max_model_len=512, num_blocks=12, block_size=16)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert tight.engine.kv_manager.prefix_hit_tokens > 0
    assert texts(squeezed) == texts(roomy)
    for i, output in enumerate(squeezed):
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMAS[i % len(SCHEMAS)])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(json="{not json"), "invalid JSON schema: not valid JSON"),
        (StructuredOutputsParams(json='{"type": "strin"}'), 'invalid JSON schema: Unsupported type "strin"'),
        (
            StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'),
            "keyword 'uniqueItems' at '/uniqueItems'",
        ),
        (
            StructuredOutputsParams(json='{"type": "string", "format": "iri"}'),
            "format 'iri' at '/format' cannot be enforced",
        ),
        (
            StructuredOutputsParams(regex="a(?=b)"),
            "invalid regex: Regex parsing error at position 4: Lookahead",
        ),
        (
            StructuredOutputsParams(grammar="root ::= item"),
            'invalid grammar: EBNF parser error at line 1, column 10: Rule "item" is not defined',
        ),
        (StructuredOutputsParams(choice=["a", ""]), "choice must not contain an empty string"),
        (StructuredOutputsParams(grammar='root ::= "ça"'), "grammar must be ASCII"),
    ],
)
def test_bad_constraints_are_value_errors(
    llm: LLM, constraint: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)


def test_combinations_that_cannot_work_are_rejected(llm: LLM) -> None:
    choice = StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs=choice, ignore_eos=True), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs=choice, min_tokens=2), use_tqdm=False)


def test_a_grammar_that_fails_in_the_engine_finishes_only_its_request(llm: LLM) -> None:
    # Sent straight to the engine core, past the frontend's checks: the compile fails on the worker.
    from tokenmill.protocol import EngineCoreRequest

    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("x")
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(["), max_tokens=5)
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(
        EngineCoreRequest(request_id="bad", prompt_token_ids=prompt, sampling_params=bad, eos_token_ids=[2])
    )
    engine.add_request(
        EngineCoreRequest(request_id="good", prompt_token_ids=prompt, sampling_params=good, eos_token_ids=[2])
    )
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finish_reason is not None:
                finished[output.request_id] = output
    assert finished["bad"].finish_reason == "error"
    assert finished["bad"].error == "invalid regex: Regex parsing error at position 3: Unclosed '['"
    assert finished["good"].finish_reason == "length"


def test_token_bitmask_touches_only_the_given_rows() -> None:
    from tokenmill.sample.logits_processors import apply_token_bitmask

    logits = torch.randn(3, 40)  # [rows, vocab]
    original = logits.clone()
    bitmask = torch.zeros(1, 2, dtype=torch.int32)  # [1, words]: allow tokens 0, 31 and 33
    bitmask[0, 0] = (1 | (1 << 31)) - (1 << 32)  # bit 31 is the int32 sign bit
    bitmask[0, 1] = 1 << 1
    out = apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(out[0], original[0]) and torch.equal(out[2], original[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [0, 31, 33]
    assert torch.equal(out[1, allowed], original[1, allowed])
