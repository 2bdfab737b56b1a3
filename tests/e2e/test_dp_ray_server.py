"""``tokenmill serve --data-parallel-size 2 --data-parallel-backend ray``: the server starts a local
Ray cluster (this machine's two CPUs) and runs its two replicas as Ray actors. Greedy outputs equal
a one-engine server's, both replicas serve, and a replica actor's death is an engine fault: 503s,
then the server exits with status 1."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from server_process import TINY_ARGS, ServerProcess, process_gone, wait_until
from test_data_parallel import PROMPTS, complete, replica_metric

pytest.importorskip("ray", reason="Ray is the optional extra tokenmill[ray] (make install adds it)")


@pytest.fixture(scope="module")
def ray_dp_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    args = [*TINY_ARGS, "--served-model-name", "tiny", "--data-parallel-size", "2"]
    args += ["--data-parallel-backend", "ray", "--engine-death-exit-delay", "5"]
    server = ServerProcess(tiny_model_dir, args)
    yield server
    server.stop()


def test_ray_replicas_serve_like_one_engine_and_their_death_fails_the_server(
    ray_dp_server: ServerProcess, tiny_server: ServerProcess
) -> None:
    expected = [complete(tiny_server, prompt) for prompt in PROMPTS]
    assert [complete(ray_dp_server, prompt) for prompt in PROMPTS] == expected
    assert all(count > 0 for count in replica_metric(ray_dp_server, "dp_replica_dispatched_total"))
    with ray_dp_server.http() as http:
        pids = http.get("/v1/admin/engine").json()["pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    os.kill(pids[1], signal.SIGKILL)  # the replica actor's worker process
    wait_until(lambda: process_gone(pids[1]))
    with ray_dp_server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 503, timeout=30)
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert "data-parallel engine 1" in response.json()["error"]["message"]
    assert ray_dp_server.process.wait(60) == 1
