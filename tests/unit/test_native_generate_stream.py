"""A streamed ``/generate`` without a server: the events ``_stream_generate`` makes of a request's
states as the engine client delivers them (the same ``RequestState`` object, changed between items).

Over HTTP the number of events depends on timing: the handler sends the state as it stands when it
gets to run, so a fast engine may finish before the first event. Here the test decides when the
state changes, so each rule is checked: one event per change, cumulative text and ids, nothing for an
item that changed nothing, the finish reason on the last event only, ``[DONE]`` at the end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from test_native_generate_plan import plan

from tokenmill.frontend.output_processor import RequestState, SampleState
from tokenmill.frontend.stop_checker import StopStringChecker
from tokenmill.server.native_output import OutputShaper
from tokenmill.server.serving_generate import _stream_generate

Change = Callable[[RequestState], None]


def new_state(request_id: str) -> RequestState:
    sample = SampleState(
        index=0, core_request_id=request_id, detokenizer=None, stop_checker=StopStringChecker([])
    )
    return RequestState(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[5, 6],
        params=plan(input_ids=[5, 6]).items[0].params,
        samples=[sample],
        arrival_time=0.0,
    )


def add_tokens(*ids: int, finish: str | None = None) -> Change:
    def change(state: RequestState) -> None:
        sample = state.samples[0]
        sample.token_ids.extend(ids)
        sample.text += "".join(f"<{i}>" for i in ids)
        sample.weight_versions.extend("0" for _ in ids)
        sample.finish_reason = finish

    return change


async def scripted(state: RequestState, items: list[list[Change]]) -> AsyncGenerator[RequestState, None]:
    """Yields ``state`` once per item, after applying that item's changes (none: an unchanged yield)."""
    for changes in items:
        for change in changes:
            change(state)
        yield state


def run_stream(body: dict[str, Any], items_per_prompt: list[list[list[Change]]]) -> list[Any]:
    generate_plan = plan(**body)
    states = [new_state(item.rid) for item in generate_plan.items]
    streams = [scripted(s, items) for s, items in zip(states, items_per_prompt)]
    shaper = OutputShaper(token_text=lambda token_id: f"<{token_id}>", weight_version="0")

    async def collect() -> list[str]:
        return [event async for event in _stream_generate(generate_plan, streams, states, shaper)]

    events = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    payloads = [e.removeprefix("data: ").strip() for e in events]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_each_change_sends_the_whole_answer_so_far_and_the_finish_comes_last() -> None:
    events = run_stream(
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}},
        [[[add_tokens(7)], [], [add_tokens(8, 9)], [add_tokens(10, finish="length")]]],
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # Three events for four items: the unchanged one sent nothing.
    assert [c["output_ids"] for c in chunks] == [[7], [7, 8, 9], [7, 8, 9, 10]]
    assert [c["text"] for c in chunks] == ["<7>", "<7><8><9>", "<7><8><9><10>"]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, None, {"type": "length", "length": 4}]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 3, 4]
    assert all("index" not in c for c in chunks)


def test_changes_that_land_before_the_handler_runs_go_out_as_one_event() -> None:
    both = [add_tokens(7), add_tokens(8, finish="length")]
    events = run_stream({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, [[both]])
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["output_ids"] == [7, 8]
    assert events[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_a_batch_stream_names_each_output_by_its_index() -> None:
    events = run_stream(
        {"input_ids": [[5, 6], [5, 6]], "sampling_params": {"max_new_tokens": 1}},
        [[[add_tokens(7, finish="length")]], [[add_tokens(8, finish="length")]]],
    )
    assert events[-1] == "[DONE]"
    assert sorted((c["index"], c["output_ids"]) for c in events[:-1]) == [(0, [7]), (1, [8])]
