"""``plan_generate`` without a server: how a ``/generate`` body becomes prompts, request ids, samples
and ``SamplingParams``, and which 400 a bad body gets; ``finish_reason_json``'s shapes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.frontend.output_processor import SampleState
from tokenmill.frontend.stop_checker import StopStringChecker
from tokenmill.server.errors import APIError
from tokenmill.server.native_output import finish_reason_json
from tokenmill.server.native_protocol import GenerateRequest
from tokenmill.server.serving_generate import GeneratePlan, plan_generate


def fake_context() -> Any:
    """Just what ``plan_generate`` reads: a tokenizer that maps ``"a b"`` to one id per word."""
    processor = SimpleNamespace(tokenize=lambda text: [len(word) for word in text.split()])
    return SimpleNamespace(engine=SimpleNamespace(input_processor=processor))


def plan(**body: Any) -> GeneratePlan:
    return plan_generate(fake_context(), GenerateRequest(**body))


def error_of(**body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        plan(**body)
    assert info.value.status == 400
    return info.value


def test_single_prompt_keeps_its_rid_and_sglang_defaults() -> None:
    p = plan(text="aa bbb", rid="r1")
    assert not p.is_batch and p.n == 1 and p.prompt_param == "text"
    [item] = p.items
    assert item.rid == "r1" and item.token_ids == [2, 3] and item.text == "aa bbb"
    assert item.params.max_tokens == 128  # SGLang's default max_new_tokens
    assert item.params.logprobs is None and item.params.prompt_logprobs is None
    assert p.output_id(0, 0) == "r1"


def test_an_explicit_null_max_new_tokens_means_up_to_the_window() -> None:
    [item] = plan(input_ids=[5, 6], sampling_params={"max_new_tokens": None}).items
    assert item.params.max_tokens is None


def test_batches_name_their_items_and_n_orders_outputs_sample_major() -> None:
    p = plan(input_ids=[[1, 2], [3]], rid="b", sampling_params={"n": 2, "temperature": 0.5})
    assert p.is_batch and p.n == 2 and [i.rid for i in p.items] == ["b_0", "b_1"]
    assert [p.output_index(i, j) for j in range(2) for i in range(2)] == [0, 1, 2, 3]
    assert p.output_id(1, 1) == "b_1_1"
    assert all(item.params.n == 2 and item.params.temperature == 0.5 for item in p.items)
    one_with_n = plan(text="a", sampling_params={"n": 3})
    assert one_with_n.is_batch and len(one_with_n.items) == 1


def test_native_names_map_onto_sampling_params() -> None:
    [item] = plan(
        text="a",
        sampling_params={
            "max_new_tokens": 7,
            "min_new_tokens": 2,
            "stop": "x",
            "no_stop_trim": True,
            "sampling_seed": 9,
            "json_schema": {"type": "object"},
            "logit_bias": {"3": 1.5},
        },
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    ).items
    params = item.params
    assert (params.max_tokens, params.min_tokens, params.stop, params.seed) == (7, 2, ["x"], 9)
    assert params.include_stop_str_in_output and params.logit_bias == {3: 1.5}
    assert params.logprobs == 3 and params.prompt_logprobs == 3
    assert params.structured_outputs is not None and params.structured_outputs.json == '{"type": "object"}'


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -2}},
            "sampling_params.max_new_tokens",
            "max_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 1}},
            "sampling_params.min_new_tokens",
            "max_new_tokens=1",
        ),
        (
            {"text": "a", "sampling_params": {"structural_tag": "x"}},
            "sampling_params.structural_tag",
            "not supported",
        ),
        ({"text": "a", "lora_path": "adapter"}, "lora_path", "not supported"),
        ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob", "1 entries for 2 prompts"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", ">= -1"),
        ({"text": "a"}, None, None),
    ],
)
def test_bad_bodies_name_the_native_field(body: dict[str, Any], param: str | None, words: str | None) -> None:
    if param is None:
        plan(**body)  # the control: a good body plans fine
        return
    error = error_of(**body)
    assert error.param == param and words in error.message


def sample(finish: str | None, token_ids: list[int], stop_reason: int | str | None = None) -> SampleState:
    state = SampleState(0, "r", None, StopStringChecker([], False), token_ids=token_ids)
    state.finish_reason, state.stop_reason = finish, stop_reason
    return state


def test_finish_reason_shapes() -> None:
    assert finish_reason_json(sample(None, [4])) is None
    assert finish_reason_json(sample("stop", [4, 1])) == {"type": "stop", "matched": 1}  # EOS
    assert finish_reason_json(sample("stop", [4, 9], 9)) == {"type": "stop", "matched": 9}
    assert finish_reason_json(sample("stop", [4], "END")) == {"type": "stop", "matched": "END"}
    assert finish_reason_json(sample("length", [4, 5])) == {"type": "length", "length": 2}
    assert finish_reason_json(sample("abort", [4]))["type"] == "abort"  # type: ignore[index]
