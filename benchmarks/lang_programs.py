"""Multi-call programs through tokenmill.lang vs the same calls as naive sequential chat requests.

Three programs, each written twice over the same conversations:

- fork: a long passage and a question, then ``--branches`` approaches, each generated and judged
  (yes/no). lang: one fork (the prefix primed once), the branches in parallel, the judge as a
  ``select``. Naive: two chat calls per branch, one after another.
- few-shot: ``--queries`` reviews classified after a long few-shot prefix. lang: ``run_batch`` with
  ``select`` (the prefix primed once). Naive: one chat call per review generating the label.
- agent: ``--agents`` conversations of ``--turns`` turns. lang: ``run_batch``, each turn continuing
  its state. Naive: one chat call per turn with the whole history, one after another.

lang runs against a tokenmill server with its prefix cache (through ``/generate``, or
``--lang-api openai``); the naive calls against one started with ``--no-prefix-cache``. One run;
prints each program's seconds, the speed-up and the share of lang's prompt tokens that were cached.

    flock /tmp/tokenmill-bench.lock .venv/bin/python benchmarks/lang_programs.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import httpx
from peers import cpu_name, git_describe
from peers import tokenmill_server as tokenmill

from tokenmill.lang import (
    Backend,
    Endpoint,
    OpenAIEndpoint,
    Trace,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)

SYSTEM = "You are a careful assistant. Answer briefly."
PASSAGE = (
    "The town of Millbrook has one bakery, two cafes and a weekly farmers market. Most residents commute "
    "to the city by train, leaving at seven and returning after six. The bakery opens at eight, after the "
    "commuters have left, and closes at five, before they return. Its sales are strong on weekends, when "
    "families visit the market, but weak on weekdays. The owner has a small budget, one oven and two "
    "employees, and the shop sits next to the train station. Rent is due at the start of each month and "
    "flour prices rose last year. The cafes sell coffee but no bread, and the market runs on Saturdays. "
) * 3
QUESTION = "How could the bakery increase its weekday sales?"
EXAMPLES = [
    ("The battery lasts two days and the screen is gorgeous.", "positive"),
    ("It broke after a week and support never answered.", "negative"),
    ("Fast shipping, works exactly as described.", "positive"),
    ("The sound is tinny and the app keeps crashing.", "negative"),
    ("Comfortable, light and the colours are great.", "positive"),
    ("Way too expensive for what you get, I returned it.", "negative"),
    ("My kids use it every day, sturdy and fun.", "positive"),
    ("The lid does not close and it leaks everywhere.", "negative"),
    ("Bright, quiet and easy to clean.", "positive"),
    ("Stopped charging after the first month.", "negative"),
    ("Exactly the colour in the pictures, very happy.", "positive"),
    ("Smells of plastic and the straps tore.", "negative"),
] * 3
REVIEWS = [
    "I love how quiet this fan is.",
    "Terrible fit, the seams came apart.",
    "Setup took two minutes and it just works.",
    "The charger stopped working after three days.",
    "Great value, I bought a second one.",
    "Arrived scratched and the manual is useless.",
    "Keeps my coffee hot all morning.",
    "The buttons stick and the screen flickers.",
]
AGENT_QUESTIONS = [
    ["Plan a one-day trip to a lake.", "What should I pack?", "What if it rains?", "Summarise the plan."],
    ["Help me start running.", "How often per week?", "What shoes?", "Summarise the advice."],
    ["I want to learn to cook.", "What is a first dish?", "What tools do I need?", "Summarise the steps."],
    ["Suggest a small garden.", "Which vegetables first?", "How much water?", "Summarise the plan."],
]
FEW_SHOT = "Classify each review as positive or negative.\n\n" + "".join(
    f"Review: {text}\nSentiment: {label}\n\n" for text, label in EXAMPLES
)
BRANCH_TOKENS = 24
TURN_TOKENS = 24


def approach_prompt(i: int) -> str:
    return f"Describe approach number {i + 1} in one sentence."


JUDGE = "Is that approach practical? Answer yes or no."


# ---------------------------------------------------------------- the programs in tokenmill.lang


@function
def fork_program(s, branches):
    s += system(SYSTEM)
    s += user(PASSAGE + QUESTION)
    s += assistant("I will think of several approaches.")
    forks = s.fork(branches)
    for i, branch in enumerate(forks):
        branch += user(approach_prompt(i))
        branch += assistant(gen("approach", max_tokens=BRANCH_TOKENS, temperature=0, ignore_eos=True))
        branch += user(JUDGE)
        branch += assistant(select("verdict", choices=["yes", "no"]))
    forks.join()


@function
def few_shot_program(s, review):
    s += system(SYSTEM)
    s += user(FEW_SHOT + f"Review: {review}\nSentiment:")
    s += assistant(select("label", choices=["positive", "negative"]))


@function
def agent_program(s, questions):
    s += system(SYSTEM)
    for question in questions:
        s += user(question)
        s += assistant(gen(max_tokens=TURN_TOKENS, temperature=0, ignore_eos=True))


# ---------------------------------------------------------------- the same calls, naively


class NaiveChat:
    """Sequential ``/v1/chat/completions`` calls; counts prompt and cached tokens."""

    def __init__(self, base_url: str, model: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=600)
        self.model = model
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def __call__(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if max_tokens > 1:
            body["ignore_eos"] = True
        reply = self.http.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        data = reply.json()
        self.prompt_tokens += data["usage"]["prompt_tokens"]
        self.cached_tokens += (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return str(data["choices"][0]["message"]["content"])


def naive_fork(chat: NaiveChat, branches: int) -> None:
    base = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PASSAGE + QUESTION},
        {"role": "assistant", "content": "I will think of several approaches."},
    ]
    for i in range(branches):
        messages = [*base, {"role": "user", "content": approach_prompt(i)}]
        approach = chat(messages, BRANCH_TOKENS)
        chat([*messages, {"role": "assistant", "content": approach}, {"role": "user", "content": JUDGE}], 1)


def naive_few_shot(chat: NaiveChat, reviews: list[str]) -> None:
    for review in reviews:
        content = FEW_SHOT + f"Review: {review}\nSentiment:"
        chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], 2)


def naive_agents(chat: NaiveChat, conversations: list[list[str]]) -> None:
    for questions in conversations:
        messages = [{"role": "system", "content": SYSTEM}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": chat(messages, TURN_TOKENS)})


# ---------------------------------------------------------------- running


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def lang_traces(result: Any) -> Trace:
    states = result if isinstance(result, list) else [result]
    return states[0].trace


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--lang-api", choices=["native", "openai"], default="native")
    parser.add_argument("--server-args", default="--max-model-len 2048", help="extra args for both servers")
    args = parser.parse_args()
    extra = args.server_args.split()
    reviews = (REVIEWS * ((args.queries + len(REVIEWS) - 1) // len(REVIEWS)))[: args.queries]
    conversations = [AGENT_QUESTIONS[i % len(AGENT_QUESTIONS)][: args.turns] for i in range(args.agents)]
    print(f"tokenmill.lang programs vs naive chat calls; {args.model}; {cpu_name()}; git {git_describe()}")
    rows: list[tuple[str, float, float, float]] = []
    with (
        tokenmill(args.model, extra) as cached_url,
        tokenmill(args.model, [*extra, "--no-prefix-cache"]) as plain_url,
    ):
        backend: Backend = (
            Endpoint(cached_url, tokenizer=args.model)
            if args.lang_api == "native"
            else OpenAIEndpoint(cached_url + "/v1", model=args.model, tokenizer=args.model)
        )
        chat = NaiveChat(plain_url, args.model)
        fork_program.run(branches=2, backend=backend)  # warm both servers and the local tokenizer
        naive_fork(chat, 1)
        programs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
            (
                "fork",
                lambda: fork_program.run(branches=args.branches, backend=backend),
                lambda: naive_fork(chat, args.branches),
            ),
            (
                "few-shot",
                lambda: few_shot_program.run_batch([{"review": r} for r in reviews], backend=backend),
                lambda: naive_few_shot(chat, reviews),
            ),
            (
                "agent",
                lambda: agent_program.run_batch([{"questions": q} for q in conversations], backend=backend),
                lambda: naive_agents(chat, conversations),
            ),
        ]
        for name, lang_run, naive_run in programs:
            lang_seconds, result = timed(lang_run)
            naive_seconds, _ = timed(naive_run)
            share = lang_traces(result).totals()["cached_share"]
            rows.append((name, lang_seconds, naive_seconds, share))
            print(f"  {name}: lang {lang_seconds:.2f} s, naive {naive_seconds:.2f} s", flush=True)
    print(f"\n{'program':<10} {'lang s':>8} {'naive s':>8} {'speed-up':>9} {'cached share':>13}")
    for name, lang_seconds, naive_seconds, share in rows:
        print(
            f"{name:<10} {lang_seconds:>8.2f} {naive_seconds:>8.2f} {naive_seconds / lang_seconds:>8.2f}x {100 * share:>12.0f}%"
        )


if __name__ == "__main__":
    main()
