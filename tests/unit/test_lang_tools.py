"""The tool loop of ``gen(..., tools=[...])``: parsing calls, running functions, errors, the step bound.

A scripted backend plays the model (the tiny random models cannot write tool calls); the chat
template is a real one, and the calls are read by the real Hermes parser.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from transformers import PreTrainedTokenizerBase

from tokenmill.lang import assistant, function, gen, system, user
from tokenmill.lang.backend import Backend, CallResult, ChatTurns, ChoiceScores, TextCallback
from tokenmill.lang.chat_roles import ChatRoles
from tokenmill.lang.expr import Gen
from tokenmill.lang.tools import tool_schema

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}|end|{% endfor %}"
    "{% if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ScriptedBackend(Backend):
    """Answers each generate with the next scripted text and records the prompts it was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[str] = []
        self.params: list[Gen] = []
        self._roles = ChatRoles(lambda m: self._render(m, False, None))

    def _render(self, messages, add_generation_prompt, tools):  # type: ignore[no-untyped-def]
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=TEMPLATE,
        )

    def generate(self, prompt: str, gen: Gen, on_text: TextCallback | None = None) -> CallResult:
        self.prompts.append(prompt)
        self.params.append(gen)
        return CallResult(self.replies.pop(0), len(prompt), 1, 0, "stop")

    def score_choices(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        raise AssertionError("not used")

    def prime(self, prompt: str) -> CallResult:
        return CallResult("", 0, 0, 0)

    def chat_roles(self) -> ChatRoles:
        return self._roles

    def render_chat(self, turns: ChatTurns) -> str:
        return str(self._render(turns.messages, True, turns.tools or None))

    def chat_template_source(self) -> str:
        return TEMPLATE

    def tool_parser_name(self) -> str:
        return "hermes"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama").path)


def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


def call(name: str, **arguments: object) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


@function
def agent(s, question, steps=4):  # type: ignore[no-untyped-def]
    s += system("Use tools.")
    s += user(question)
    s += assistant(gen("answer", tools=[divide], max_tool_steps=steps, max_tokens=64))


def test_a_failing_tool_becomes_an_error_message_and_the_loop_continues(tokenizer) -> None:  # type: ignore[no-untyped-def]
    backend = ScriptedBackend(tokenizer, [call("divide", a=1, b=0), call("divide", a=6, b=3), "It is 2."])
    state = agent.run(question="6/3?", backend=backend)
    assert state["answer"] == "It is 2."
    calls = state.get_meta_info("answer")["tool_calls"]
    assert [c["result"] for c in calls] == ["error: ZeroDivisionError: division by zero", "2.0"]
    messages = state.messages()
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "divide", "arguments": {"a": 1, "b": 0}}
    assert messages[3]["content"] == "error: ZeroDivisionError: division by zero"
    assert messages[-1] == {"role": "assistant", "content": "It is 2."}
    # Every round sees the tools and everything before it; the second round sees the error.
    assert all("[tools:divide;]" in prompt for prompt in backend.prompts)
    assert "<|tool|>error: ZeroDivisionError" in backend.prompts[1]
    assert state.text() == backend.prompts[-1] + "It is 2.|end|"
    assert [r.kind for r in state.trace.records] == ["tool", "tool", "tool"]


def test_the_loop_is_bounded_and_the_last_round_answers_without_tools(tokenizer) -> None:  # type: ignore[no-untyped-def]
    backend = ScriptedBackend(tokenizer, [call("divide", a=1, b=1), call("divide", a=2, b=1), "done"])
    state = agent.run(question="loop", steps=2, backend=backend)
    assert state["answer"] == "done"
    assert len(state.get_meta_info("answer")["tool_calls"]) == 2
    assert "[tools:" not in backend.prompts[-1]


def test_unknown_tools_and_bad_arguments_are_reported_to_the_model(tokenizer) -> None:  # type: ignore[no-untyped-def]
    replies = ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', call("divide", a=1), "ok"]
    state = agent.run(question="q", backend=ScriptedBackend(tokenizer, replies))
    results = [c["result"] for c in state.get_meta_info("answer")["tool_calls"]]
    assert results[0] == "error: there is no tool named 'nope'; tools are divide"
    assert results[1].startswith("error: TypeError:") and "'b'" in results[1]


def test_required_tool_choice_forces_a_call_with_a_json_schema(tokenizer) -> None:  # type: ignore[no-untyped-def]
    @function
    def forced(s):  # type: ignore[no-untyped-def]
        s += user("q")
        s += assistant(gen("answer", tools=[divide], tool_choice="required"))

    backend = ScriptedBackend(tokenizer, ['[{"name": "divide", "parameters": {"a": 4, "b": 2}}]', "two"])
    state = forced.run(backend=backend)
    assert state["answer"] == "two"
    schema = json.loads(backend.params[0].json_schema or "")
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["divide"]
    assert backend.params[1].json_schema is None
    assert state.get_meta_info("answer")["tool_calls"][0]["result"] == "2.0"


def test_tools_outside_an_assistant_block_are_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    @function
    def misplaced(s):  # type: ignore[no-untyped-def]
        s += user("q")
        s += gen("answer", tools=[divide])

    from tokenmill.lang import ProgramError

    with pytest.raises(ProgramError, match="first thing in an assistant block"):
        misplaced.run(backend=ScriptedBackend(tokenizer, []))


def test_tool_schema_reads_the_signature() -> None:
    schema = tool_schema(divide)["function"]
    assert schema["name"] == "divide" and schema["description"] == "Divide a by b."
    assert schema["parameters"] == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
