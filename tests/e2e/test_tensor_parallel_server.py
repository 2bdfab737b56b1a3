"""``tokenmill serve --tensor-parallel-size 2``: the server answers as with one process, and a rank
that dies is an engine fault: 503 at once, then the server exits with status 1 (no hang)."""

from __future__ import annotations

import os
import signal

from server_process import TINY_ARGS, ServerProcess, process_gone, wait_until
from tiny_model import words

from tokenmill import LLM, SamplingParams

PROMPT: dict = {"prompt": words([5, 6, 7, 8]), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
EXIT_DELAY_S = 2.0


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def test_two_ranks_serve_then_a_dead_rank_is_503_and_the_server_exits(tiny_model_dir: str) -> None:
    single = LLM(tiny_model_dir, dtype="float32", block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=PROMPT["max_tokens"], ignore_eos=True)
    expected = single.generate([PROMPT["prompt"]], params, use_tqdm=False)[0].outputs[0].text
    args = [*TINY_ARGS, "--tensor-parallel-size", "2", "--engine-death-exit-delay", str(EXIT_DELAY_S)]
    server = ServerProcess(tiny_model_dir, args)
    try:
        engine_pid = server.engine_pid()
        with server.http() as http:
            answer = http.post("/v1/completions", json=PROMPT)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["text"] == expected
            ranks = children_of(engine_pid)
            assert len(ranks) == 2
            os.kill(ranks[1], signal.SIGKILL)
            refused = http.post("/v1/completions", json=PROMPT)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "engine_unavailable"
        assert server.process.wait(EXIT_DELAY_S + 30) == 1
        wait_until(lambda: all(process_gone(pid) for pid in [engine_pid, *ranks]), 15)
    finally:
        server.stop()
