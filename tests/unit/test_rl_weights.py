"""Weight updates in place (RL): from a folder, from safetensors bytes, from a trainer's broadcast.

Two weight sets of the same tiny Llama: the engine starts on A, is updated to B, and must then
generate exactly what transformers generates with B (and what a fresh engine on B does). Bad updates
(unknown names, wrong shapes, a missing group) fail with a clear error and leave A serving. The
prefix cache is keyed by the weights' generation: a prompt cached under A is recomputed under B.
"""

from __future__ import annotations

import multiprocessing
import re
import socket

import pytest
import torch

from tests.conftest import TinyModel
from tests.unit.rl_helpers import (  # noqa: F401
    PROMPT,
    fixture_weights_a,
    fixture_weights_b,
    greedy,
    hf_state,
    make_llm,
    run,
)
from tokenmill.core.client import UtilityCallError
from tokenmill.worker.weight_update import open_weight_group, serialize_named_tensors


def test_the_two_weight_sets_differ(weights_a: TinyModel, weights_b: TinyModel) -> None:
    assert weights_a.greedy(PROMPT, 6) != weights_b.greedy(PROMPT, 6)


def test_update_from_disk_equals_a_fresh_engine_and_transformers(
    weights_a: TinyModel, weights_b: TinyModel
) -> None:
    llm = make_llm(weights_a)
    assert run(llm)[0] == weights_a.greedy(PROMPT, 6)
    assert llm.get_weight_version() == "default"
    result = llm.update_weights_from_disk(weights_b.path, weight_version="step-1")
    assert result["success"] is True and result["weight_version"] == "step-1"
    assert llm.get_weight_version() == "step-1"
    tokens, cached = run(llm)
    assert cached == 0  # cached under A: never reused under B
    assert tokens == weights_b.greedy(PROMPT, 6)
    assert tokens == run(make_llm(weights_b))[0]
    # Back to A through the same call: the version is bumped to the update count when not given.
    llm.update_weights(weights_a.path)
    assert llm.get_weight_version() == "2"
    assert run(llm)[0] == weights_a.greedy(PROMPT, 6)


def test_update_from_tensor_bytes_partial_and_whole(weights_a: TinyModel, weights_b: TinyModel) -> None:
    llm = make_llm(weights_a)
    state_b = hf_state(weights_b)
    # A subset first (one layer's MLP): the rest stays A, so the output is neither A's nor B's.
    subset = {n: t for n, t in state_b.items() if n.startswith("model.layers.1.mlp.")}
    assert llm.update_weights_from_tensor(subset)["num_tensors"] == 3
    mixed = run(llm)[0]
    llm.update_weights_from_tensor(serialize_named_tensors(state_b), weight_version="b")
    assert run(llm)[0] == weights_b.greedy(PROMPT, 6)
    assert mixed != weights_b.greedy(PROMPT, 6)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}, "has shape [64, 32]"),
        ({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}, "unknown weight name"),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "floating point"),
    ],
)
def test_bad_updates_fail_and_keep_the_old_weights(
    weights_a: TinyModel, weights_b: TinyModel, tensors: dict[str, torch.Tensor], message: str
) -> None:
    llm = make_llm(weights_a)
    # A good tensor first in the same update: it must not be loaded either.
    good = {"model.layers.0.mlp.up_proj.weight": hf_state(weights_b)["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(UtilityCallError, match=re.escape(message)):
        llm.update_weights_from_tensor({**good, **tensors})
    assert llm.get_weight_version() == "default"
    assert run(llm)[0] == weights_a.greedy(PROMPT, 6)


def test_bad_sources_fail_clearly(weights_a: TinyModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(weights_a)
    with pytest.raises(UtilityCallError, match="no such model folder"):
        llm.update_weights_from_disk(str(tmp_path / "missing"))
    with pytest.raises(UtilityCallError, match="not a safetensors blob"):
        llm.update_weights_from_tensor(b"not safetensors at all")
    with pytest.raises(UtilityCallError, match="call init_weights_update_group first"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
    with pytest.raises(UtilityCallError, match="holds no tensors"):
        llm.update_weights_from_tensor({})
    with pytest.raises(UtilityCallError, match="needs model_path"):
        llm.call_utility("update_weights_from_disk")
    assert run(llm)[0] == weights_a.greedy(PROMPT, 6)


def test_cached_prefix_is_never_reused_across_versions(weights_a: TinyModel, weights_b: TinyModel) -> None:
    """The stale-KV bug: a prompt cached under A, reused under B, would continue from A's keys and
    values. With the generation in the namespace it is recomputed, and A's blocks are freed."""
    llm = make_llm(weights_a)
    run(llm)
    assert run(llm)[1] == 8  # warm under A
    cached_before = llm.kv_stats()["cached_blocks"]
    assert isinstance(cached_before, int) and cached_before > 0
    result = llm.update_weights_from_tensor(hf_state(weights_b))
    assert result["num_freed_cache_blocks"] == cached_before
    assert llm.kv_stats()["cached_blocks"] == 0
    tokens, cached = run(llm)
    assert (tokens, cached) == (weights_b.greedy(PROMPT, 6), 0)
    assert run(llm)[1] == 8  # warm again, now under B
    llm.engine.kv_manager.check_integrity()


def test_update_with_a_request_in_flight_detaches_it(weights_a: TinyModel, weights_b: TinyModel) -> None:
    """A request running across an update goes on under B from its next token and publishes nothing
    (its blocks hold A's and B's keys); each of its tokens records the version that produced it."""
    llm = make_llm(weights_a)
    [request] = llm.input_processor.make_requests("r", PROMPT, greedy(6))
    state = llm.output_processor.add_request("r", None, PROMPT, greedy(6))
    llm.engine.add_request(request)
    for _ in range(3):
        llm.output_processor.process(llm.engine.step().outputs)
    llm.update_weights_from_tensor(hf_state(weights_b), weight_version="b")
    while not state.finished:
        llm.output_processor.process(llm.engine.step().outputs)
    sample = state.samples[0]
    assert sample.token_ids[:3] == weights_a.greedy(PROMPT, 3)
    assert sample.weight_versions == ["default"] * 3 + ["b"] * 3
    # Its blocks (A's keys for the prompt and first tokens) were never published: the same tokens
    # as a new prompt are computed from scratch under B.
    assert llm.kv_stats()["cached_blocks"] == 0
    extended = PROMPT + sample.token_ids[:3]
    assert run(llm, extended, 3) == (weights_b.greedy(extended, 3), 0)
    llm.engine.kv_manager.check_integrity()


def test_int8_serving_requantizes_on_update(weights_a: TinyModel, weights_b: TinyModel) -> None:
    """Quantized layers take the new weights' quantization, not a stale copy: an int8 engine updated
    to B generates what an int8 engine started on B does."""
    llm = make_llm(weights_a, quantization="int8", dtype="bfloat16")
    llm.update_weights_from_disk(weights_b.path)
    fresh = make_llm(weights_b, quantization="int8", dtype="bfloat16")
    assert run(llm, n=8)[0] == run(fresh, n=8)[0]
    updated = dict(llm.engine.executor.runner.model.named_modules())  # type: ignore[attr-defined]
    started = dict(fresh.engine.executor.runner.model.named_modules())  # type: ignore[attr-defined]
    name = next(n for n in updated if n.endswith("mlp.gate_up_proj"))
    assert torch.equal(updated[name].int8_weight, started[name].int8_weight)


def _trainer(port: int, state: dict[str, torch.Tensor], done: multiprocessing.synchronize.Event) -> None:
    """Rank 0: open the group, then broadcast every tensor in order (what a trainer does)."""
    group = open_weight_group("127.0.0.1", port, 0, 2, "rl-test", "gloo", timeout_s=60)
    for tensor in state.values():
        group.broadcast(tensor, 0).wait()
    done.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_update_from_distributed_two_processes(weights_a: TinyModel, weights_b: TinyModel) -> None:
    llm = make_llm(weights_a)
    state = hf_state(weights_b)
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    trainer = context.Process(target=_trainer, args=(port, state, done), daemon=True)
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "rl-test", "gloo")
        result = llm.update_weights_from_distributed(
            list(state),
            [str(t.dtype) for t in state.values()],
            [list(t.shape) for t in state.values()],
            weight_version="dist-1",
        )
        assert result["weight_version"] == "dist-1"
    finally:
        done.set()
        trainer.join(30)
    assert trainer.exitcode == 0
    assert run(llm)[0] == weights_b.greedy(PROMPT, 6)
    # The group stays: a second update must name what it sends; wrong shapes fail before any receive.
    with pytest.raises(UtilityCallError, match="has shape"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[3]], group_name="rl-test")
    assert run(llm)[0] == weights_b.greedy(PROMPT, 6)


def test_updates_reach_a_worker_process(weights_a: TinyModel, weights_b: TinyModel) -> None:
    """Through the multi-process executor: the safetensors bytes cross to the worker as msgpack
    ``bin`` (no pickle), a worker's ValueError comes back as the same message, and a retracted
    pause recomputes there under the new weights."""
    llm = make_llm(weights_a, executor_backend="mp")
    try:
        with pytest.raises(UtilityCallError, match=re.escape("has shape [3], but the model's is [64]")):
            llm.update_weights_from_tensor({"model.norm.weight": torch.zeros(3)})
        assert run(llm)[0] == weights_a.greedy(PROMPT, 6)
        llm.update_weights_from_tensor(hf_state(weights_b), weight_version="b")
        assert run(llm) == (weights_b.greedy(PROMPT, 6), 0)
        llm.pause_generation("retract")
        llm.release_memory_occupation(["kv_cache"])
        llm.resume_memory_occupation(["kv_cache"])
        llm.continue_generation()
        assert run(llm) == (weights_b.greedy(PROMPT, 6), 0)
    finally:
        llm.engine.shutdown()
