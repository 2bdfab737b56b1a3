"""Tree of thought with ``fork``: propose several plans in parallel, judge each, expand the best.

The question is computed once (the fork primes it); the branches then run together in the
engine's batches, each starting from the cached prefix.

    python examples/lang/tree_of_thought.py --trace tot.html
"""

from __future__ import annotations

import time

from common import backend_from_args

from tokenmill.lang import assistant, function, gen, select, user

QUESTION = "How can a small bakery attract more customers on weekday mornings?"


@function
def tree_of_thought(s, question, width=3):
    s += user(f"{question} Think step by step.")
    s += assistant("Let me consider a few different approaches.\n")
    plans = s.fork(width)
    for i, plan in enumerate(plans):
        plan += f"Approach {i + 1}:"
        plan += gen("idea", max_tokens=40, temperature=0.8, seed=i, stop="\n")
        plan += "\nIs this approach practical and cheap? Answer: "
        plan += select("verdict", choices=["yes", "no"])
    plans.join()
    scores = [p.get_meta_info("verdict")["normalized_logprobs"][0] for p in plans]
    best = plans[max(range(width), key=lambda i: scores[i])]
    best += "\nIn detail:"
    best += gen("detail", max_tokens=60, temperature=0)
    return [p["idea"] for p in plans], best["idea"], best["detail"]


def main() -> None:
    backend, args = backend_from_args(__doc__ or "")
    started = time.perf_counter()
    state = tree_of_thought.run(question=QUESTION, backend=backend)
    ideas, best, detail = state.ret_value
    for i, idea in enumerate(ideas):
        print(f"approach {i + 1}:{idea}")
    print(f"\nchosen:{best}\n{detail.strip()}")
    totals = state.trace.totals()
    print(
        f"\n{time.perf_counter() - started:.1f} s, {totals['calls']} calls, "
        f"{100 * totals['cached_share']:.0f}% of prompt tokens cached"
    )
    if args.trace:
        state.trace.save_html(args.trace)
    backend.close()


if __name__ == "__main__":
    main()
