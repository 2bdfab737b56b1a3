"""Service tiers and fairness under overload: per-tier and per-user TTFT / TPOT, alone vs loaded.

One tokenmill server (``--policy vtc``, standard tiers, a TTFT target on the ``priority`` tier:
``--tier-slo priority:ttft=0.1`` by default, which keeps the other tiers' steps within a third of it
and within the priority tier's own first-token steps, cuts the step in flight short when a priority
request arrives, and gives its prefill a step of its own; the configuration used is printed). Three
phases, all streaming completions:

1. alone: a ``priority`` probe client (one request at a time) on an idle server, after 3 s of
   uncounted warm-up requests;
2. capacity: a saturating closed loop of the load's request shape measures requests/s;
3. loaded: open-loop load at ``--overload`` x that capacity from a heavy user (half ``default``,
   half ``flex``), a light user keeping ``--light-concurrency`` ``default`` requests outstanding
   (more than its fair share of the ``--max-num-seqs`` seats, so it stays backlogged), and the
   same ``priority`` probe client as in phase 1. At the end the heavy user's backlog is aborted.

Prints TTFT and TPOT p50/p99 per class and two targets: the priority tier's p99 TTFT loaded
within 2x of alone, and the light user's share of the heavy+light service (VTC cost: prompt
tokens + 2 x output tokens) within 10% of its fair share (one half). Refused requests (429) are
counted, not timed.

    .venv/bin/python benchmarks/tiers.py [--duration 60] [--overload 4] [--priority-ttft 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from peers import cpu_name, git_describe
from peers import tokenmill_server as tokenmill

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import RequestResult, percentile, tpot
from tokenmill.bench.serve import BenchConfig, send_request


@dataclass
class ClassStats:
    """What one class of requests (a tier, a user, a phase) measured."""

    results: list[RequestResult] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)  # time.perf_counter() when each result came

    def add(self, result: RequestResult) -> None:
        self.results.append(result)
        self.ended.append(time.perf_counter())

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.success]

    def refused(self) -> int:
        return sum(1 for r in self.results if r.error is not None and "429" in r.error)

    def ttft(self, q: float) -> float:
        values = [r.ttft for r in self.ok if r.ttft is not None]
        return percentile(values, q) if values else float("nan")

    def tpot(self, q: float) -> float:
        values = [
            v
            for r in self.ok
            if r.ttft is not None and r.e2e is not None
            for v in [tpot(r.e2e, r.ttft, r.output_tokens)]
            if v is not None
        ]
        return percentile(values, q) if values else float("nan")

    def service(self, until: float, output_weight: float = 2.0) -> float:
        """VTC cost of the requests completed by ``until``: prompt + ``output_weight`` x output tokens."""
        return sum(
            r.prompt_len + output_weight * r.output_tokens
            for r, ended in zip(self.results, self.ended)
            if r.success and ended <= until
        )


def make_request(rng: random.Random, prompt_len: int, output_len: int) -> BenchRequest:
    # Random words: the bundled tokenizer makes roughly one token of each.
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(prompt_len))
    return BenchRequest(prompt=words, prompt_len=prompt_len, output_len=output_len)


def config_for(url: str, model: str, tier: str, user: str) -> BenchConfig:
    return BenchConfig(
        base_url=url,
        model=model,
        ignore_eos=True,
        extra_body={"service_tier": tier, "user": user},
        progress=False,
    )


async def closed_loop(
    client: httpx.AsyncClient,
    config: BenchConfig,
    stats: ClassStats,
    concurrency: int,
    shape: tuple[int, int],
    until: float,
    seed: int,
) -> None:
    """``concurrency`` workers, each sending the next request as soon as the last one ends."""
    rng = random.Random(seed)
    start = time.perf_counter()

    async def worker() -> None:
        while time.perf_counter() < until:
            stats.add(await send_request(client, config, make_request(rng, *shape), start))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    client: httpx.AsyncClient,
    configs: list[tuple[BenchConfig, ClassStats]],
    rate: float,
    shape: tuple[int, int],
    until: float,
    seed: int,
) -> None:
    """Poisson arrivals at ``rate`` requests/s, alternating between ``configs``, until ``until``."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    k = 0

    async def one(config: BenchConfig, stats: ClassStats, request: BenchRequest) -> None:
        stats.add(await send_request(client, config, request, start))

    while time.perf_counter() < until:
        config, stats = configs[k % len(configs)]
        tasks.append(asyncio.create_task(one(config, stats, make_request(rng, *shape))))
        k += 1
        await asyncio.sleep(rng.expovariate(rate))
    # The overload's backlog is not drained: closing its streams aborts it in the server.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run(args: argparse.Namespace, url: str) -> tuple[dict[str, ClassStats], float]:
    model = "tokenmill"
    stats: dict[str, ClassStats] = {}
    probe_shape = (args.probe_prompt_len, args.probe_output_len)
    load_shape = (args.load_prompt_len, args.load_output_len)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        probe = config_for(url, model, "priority", "vip")
        # Warm-up, not counted: a fresh server's first requests pay one-time costs (first use of
        # each code path, allocator growth, the step-time model's first observations).
        await closed_loop(client, probe, ClassStats(), 1, probe_shape, time.perf_counter() + 3, seed=0)
        stats["priority alone"] = ClassStats()
        until = time.perf_counter() + args.duration / 3
        await closed_loop(client, probe, stats["priority alone"], 1, probe_shape, until, seed=1)

        capacity = ClassStats()
        start = time.perf_counter()
        until = start + args.duration / 3
        saturating = config_for(url, model, "default", "heavy")
        await closed_loop(client, saturating, capacity, args.capacity_concurrency, load_shape, until, seed=2)
        rate = len(capacity.ok) / (time.perf_counter() - start)
        print(f"capacity: {rate:.2f} requests/s of {load_shape[0]} + {load_shape[1]} tokens")

        for name in ("priority loaded", "heavy default", "heavy flex", "light default"):
            stats[name] = ClassStats()
        until = time.perf_counter() + args.duration
        heavy = [
            (config_for(url, model, "default", "heavy"), stats["heavy default"]),
            (config_for(url, model, "flex", "heavy"), stats["heavy flex"]),
        ]
        light = config_for(url, model, "default", "light")
        await asyncio.gather(
            open_loop(client, heavy, args.overload * rate, load_shape, until, seed=3),
            closed_loop(
                client, light, stats["light default"], args.light_concurrency, load_shape, until, seed=4
            ),
            closed_loop(client, probe, stats["priority loaded"], 1, probe_shape, until, seed=5),
        )
    return stats, until


def report(stats: dict[str, ClassStats], until: float) -> None:
    header = (
        f"{'class':<18}{'done':>6}{'429':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
    )
    print(header)
    for name, s in stats.items():
        print(
            f"{name:<18}{len(s.ok):>6}{s.refused():>6}{s.ttft(50) * 1e3:>8.0f}ms{s.ttft(99) * 1e3:>8.0f}ms"
            f"{s.tpot(50) * 1e3:>8.1f}ms{s.tpot(99) * 1e3:>8.1f}ms"
        )
    alone, loaded = stats["priority alone"].ttft(99), stats["priority loaded"].ttft(99)
    print(f"priority p99 TTFT loaded / alone: {loaded / alone:.2f}x (target <= 2x)")
    heavy = stats["heavy default"].service(until) + stats["heavy flex"].service(until)
    light = stats["light default"].service(until)
    share = light / (heavy + light) if heavy + light else float("nan")
    print(f"light user's share of heavy+light service: {share:.3f} (fair share 0.5, target within 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the loaded phase")
    parser.add_argument("--overload", type=float, default=4.0, help="offered load over measured capacity")
    parser.add_argument("--probe-prompt-len", type=int, default=32)
    parser.add_argument("--probe-output-len", type=int, default=16)
    parser.add_argument("--load-prompt-len", type=int, default=256)
    parser.add_argument("--load-output-len", type=int, default=64)
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="the server's seats: fairness decides who waits for them"
    )
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument(
        "--light-concurrency",
        type=int,
        default=16,
        help="requests the light user keeps outstanding (backlogged)",
    )
    parser.add_argument(
        "--priority-ttft",
        type=float,
        default=0.1,
        help="the priority tier's TTFT target in seconds (--tier-slo); 0 sets none",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra tokenmill serve argument")
    args = parser.parse_args()
    print(
        f"tiers: {args.overload}x overload for {args.duration:.0f} s; {cpu_name()}; tokenmill {git_describe()}"
    )
    server_args: list[Any] = [
        "--policy",
        "vtc",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if args.priority_ttft > 0:
        server_args += ["--tier-slo", f"priority:ttft={args.priority_ttft:g}"]
    server_args += args.server_arg
    print(f"server: tokenmill serve {args.model} {' '.join(map(str, server_args))}")
    with tokenmill(args.model, server_args) as url:
        stats, until = asyncio.run(run(args, url))
    report(stats, until)


if __name__ == "__main__":
    main()
