"""A tool-using agent: ``gen(..., tools=[...])`` runs the model's calls on Python functions.

SmolLM2's chat template has no tool format, so the tools are described in the system turn and calls
are read as Hermes ``<tool_call>`` markup; ``tool_choice="required"`` makes the first round a call by
a JSON-schema grammar (a 135M model rarely calls on its own). A tool that raises is reported to the
model as an error message, and the loop continues.

    python examples/lang/tool_agent.py
"""

from __future__ import annotations

import time

from common import backend_from_args

from tokenmill.lang import assistant, function, gen, system, user

PRICES = {"apple": 0.5, "bread": 2.25, "milk": 1.1}


def get_price(item: str) -> float:
    """The price of one item in euros."""
    if item not in PRICES:
        raise KeyError(f"no price for {item!r}; known items: {', '.join(PRICES)}")
    return PRICES[item]


def multiply(a: float, b: float) -> float:
    """a times b."""
    return a * b


@function
def shopping_agent(s, request):
    s += system("You are a shopping assistant. Use the tools to look up prices, then answer briefly.")
    s += user(request)
    s += assistant(
        gen(
            "answer",
            tools=[get_price, multiply],
            tool_choice="required",
            tool_parser="hermes",
            max_tool_steps=3,
            max_tokens=80,
            temperature=0,
        )
    )


def main() -> None:
    backend, args = backend_from_args(__doc__ or "")
    started = time.perf_counter()
    state = shopping_agent.run(request="How much does bread cost?", backend=backend)
    for call in state.get_meta_info("answer")["tool_calls"]:
        print(f"called {call['name']}({call['arguments']}) -> {call['result']}")
    print(f"answer: {state['answer'].strip()}")
    print(f"{time.perf_counter() - started:.1f} s, {len(state.trace.records)} model calls")
    if args.trace:
        state.trace.save_html(args.trace)
    backend.close()


if __name__ == "__main__":
    main()
