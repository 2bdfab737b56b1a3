"""Few-shot sentiment classification with ``select``: the model scores each label, generating nothing.

Every review shares the same few-shot prefix, so ``run_batch`` computes it once (one priming call)
and each program then only computes its own review and the labels.

    python examples/lang/few_shot_select.py
"""

from __future__ import annotations

import time

from common import backend_from_args

from tokenmill.lang import function, select

EXAMPLES = [
    ("The battery lasts two days and the screen is gorgeous.", "positive"),
    ("It broke after a week and support never answered.", "negative"),
    ("Fast shipping, works exactly as described.", "positive"),
    ("The sound is tinny and the app keeps crashing.", "negative"),
    ("Comfortable, light and the colours are great.", "positive"),
    ("Way too expensive for what you get, I returned it.", "negative"),
]
REVIEWS = [
    ("I love how quiet this fan is.", "positive"),
    ("Terrible fit, the seams came apart.", "negative"),
    ("Setup took two minutes and it just works.", "positive"),
    ("The charger stopped working after three days.", "negative"),
    ("Great value, I bought a second one.", "positive"),
    ("Arrived scratched and the manual is useless.", "negative"),
]


@function
def classify(s, review):
    s += "Classify the sentiment of each product review as positive or negative.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: "
    s += select("label", choices=["positive", "negative"])


def main() -> None:
    backend, args = backend_from_args(__doc__ or "")
    started = time.perf_counter()
    states = classify.run_batch([{"review": r} for r, _ in REVIEWS], backend=backend, progress_bar=True)
    correct = 0
    for (review, expected), state in zip(REVIEWS, states):
        scores = state.get_meta_info("label")["normalized_logprobs"]
        correct += state["label"] == expected
        print(
            f"{state['label']:>8}  (expected {expected}; scores {scores[0]:.2f} / {scores[1]:.2f})  {review}"
        )
    totals = states[0].trace.totals()
    print(
        f"{correct}/{len(REVIEWS)} correct in {time.perf_counter() - started:.1f} s; "
        f"{totals['calls']} calls, {100 * totals['cached_share']:.0f}% of prompt tokens cached"
    )
    if args.trace:
        states[0].trace.save_html(args.trace)
    backend.close()


if __name__ == "__main__":
    main()
