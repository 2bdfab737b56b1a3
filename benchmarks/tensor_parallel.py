"""Tensor parallelism's throughput against one process, side by side in one run.

Runs the same offline workload (``--batch`` prompts of ``--prompt-len`` tokens, ``--new`` tokens each,
greedy) on three engines over the same model: one process with all ``--threads``; one worker process
(``executor_backend="mp"``, the same threads: the cost of the process boundary alone); and
``--tp`` ranks with ``--threads // --tp`` threads each. Prints tokens per second (prefill and decode
together) and the ratios. Each engine is warmed with one short request first; the start-up is not
timed. Take the numbers on a quiet machine (``flock /tmp/tokenmill-bench.lock``) and say what the
CPU is: on a machine with few cores the all-reduce after every row-parallel layer is paid in
latency while each rank gets fewer cores, so tensor parallelism may lose there; it pays off where
one rank's cores (or GPU) cannot hold or feed the model alone.

    .venv/bin/python benchmarks/tensor_parallel.py [--model smollm2-135m] [--tp 2] [--threads 2]

``--model deepseek-v3-shaped`` builds ``deepseek_mla.py``'s random ~94M-parameter DeepSeek-V3-shaped
model in a temporary folder (``--expert-parallel``: its routed experts whole per rank).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from deepseek_mla import build_model

from tokenmill import LLM, SamplingParams


def throughput(llm: LLM, batch: int, prompt_len: int, new: int) -> float:
    """Generated plus prompt tokens per second over one ``generate`` of ``batch`` prompts."""
    prompts = [
        {"prompt_token_ids": [100 + (7 * i + j) % 5000 for j in range(prompt_len)]} for i in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(output.outputs[0].token_ids) == new for output in outputs)
    return batch * (prompt_len + new) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank: nccl)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--expert-parallel", action="store_true", help="whole experts per rank")
    args = parser.parse_args()
    if args.model == "deepseek-v3-shaped":
        with tempfile.TemporaryDirectory() as folder:
            build_model(folder)
            args.model = folder
            compare(args)
    else:
        compare(args)


def compare(args: argparse.Namespace) -> None:
    """The three engines over ``args.model``, one after the other; prints tokens/s and ratios."""
    common = {"dtype": args.dtype, "max_model_len": 1024, "num_threads": args.threads, "device": args.device}
    engines = {
        "one process": {},
        "one worker process (mp)": {"executor_backend": "mp"},
        f"tensor parallel {args.tp}": {
            "tensor_parallel_size": args.tp,
            "enable_expert_parallel": args.expert_parallel,
        },
    }
    results: dict[str, float] = {}
    for name, settings in engines.items():
        llm = LLM(args.model, **common, **settings)  # type: ignore[arg-type]
        try:
            results[name] = throughput(llm, args.batch, args.prompt_len, args.new)
        finally:
            llm.engine.executor.shutdown()
        print(f"{name:28s} {results[name]:8.1f} tokens/s", flush=True)
    base = results["one process"]
    for name, value in results.items():
        print(f"{name:28s} {value / base:6.2f}x of one process")


if __name__ == "__main__":
    main()
