"""A small GRPO loop on CPU: tokenmill generates the rollouts, a plain PyTorch trainer learns.

The setting RL frameworks (verl, slime, OpenRLHF) use, in one file: a ``tokenmill serve`` process
is the rollout engine; the trainer holds the same model (the bundled SmolLM2-135M-Instruct in
Hugging Face form, float32) and after every step pushes its new weights into the running engine
over a torch.distributed group (gloo), with ``/update_weights_from_distributed``. No restart, no
checkpoint on disk, and the engine's prefix cache never serves keys computed by older weights.

Task (a verifiable reward): get to the point. A completion whose first sentence ends (a token
with ``.``, ``!`` or ``?``, or EOS) after ``k`` tokens earns ``1 - k / max_new_tokens``; one with
no sentence end earns 0. Each step
samples ``--group`` completions of each of ``--prompts`` prompts through ``/generate`` with their
logprobs, scores them, normalizes the rewards within each prompt's group (GRPO's advantage),
and takes one policy-gradient step with PPO's clipped ratio against the engine's logprobs. The
engine runs with ``--rl-exact-logprobs``, so those equal the trainer's own: the script prints
their largest difference each step. Only the last ``--train-layers`` decoder layers train (and so
only they are broadcast): enough to move the reward in ~20 steps on two cores.

    PYTHONPATH=. .venv/bin/python examples/rl_grpo_tiny.py [--steps 20] [--group 8] [--prompts 2]
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import torch
import transformers

from tokenmill.loader import resolve_model
from tokenmill.worker.weight_update import open_weight_group

PROMPTS = [
    "What is the capital of France?",
    "Name a color of the sky.",
    "What do bees make?",
    "How many legs does a cat have?",
    "What is frozen water called?",
    "Which planet do we live on?",
    "What animal says moo?",
    "What is two plus two?",
]
GROUP_NAME = "grpo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, port: int, threads: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tokenmill.server", model, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--rl-exact-logprobs", "--num-threads", str(threads), "--log-level", "warning"]
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start")


def rollouts(http: httpx.Client, prompts: list[list[int]], group: int, max_new: int) -> list[dict[str, Any]]:
    """``group`` sampled completions of each prompt, with the engine's logprobs of every token."""
    body = {
        "input_ids": [p for p in prompts for _ in range(group)],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new},
        "return_logprob": True,
    }
    response = http.post("/generate", json=body)
    if response.status_code != 200:
        raise SystemExit(f"/generate answered {response.status_code}: {response.text}")
    return response.json()  # type: ignore[no-any-return]


def reward(output: dict[str, Any], tokenizer: Any, max_new: int) -> float:
    """Get to the point: ``1 - k / max_new`` where the first sentence ends (a token with ``.``,
    ``!`` or ``?``, or the end of the answer) after ``k`` tokens; 0 when no sentence ends."""
    ids = output["output_ids"]
    for k, token in enumerate(ids):
        if any(mark in tokenizer.decode([token]) for mark in ".!?"):
            return 1.0 - (k + 1) / max_new
    if output["meta_info"]["finish_reason"]["type"] == "stop":
        return 1.0 - len(ids) / max_new
    return 0.0


def token_logprobs(
    model: transformers.PreTrainedModel, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """The trainer's logprob of each completion token given what precedes it, ``[len(completion)]``."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(completion), vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def push_weights(http: httpx.Client, group: Any, named: list[tuple[str, torch.Tensor]], version: str) -> None:
    """Broadcast ``named`` (rank 0) while the engine receives them through its HTTP call."""
    body = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": GROUP_NAME,
        "weight_version": version,
    }
    answer: list[httpx.Response] = []
    call = threading.Thread(
        target=lambda: answer.append(http.post("/update_weights_from_distributed", json=body))
    )
    call.start()
    for _, tensor in named:
        group.broadcast(tensor.detach().contiguous(), 0).wait()
    call.join()
    answer[0].raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--train-layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for each of engine and trainer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(args.threads)

    source = resolve_model(args.model)
    tokenizer = source.load_tokenizer()
    policy = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    layers = policy.model.layers
    trained = {f"model.layers.{len(layers) - 1 - i}." for i in range(args.train_layers)}
    named = [(n, p) for n, p in policy.named_parameters() if any(n.startswith(t) for t in trained)]
    for name, parameter in policy.named_parameters():
        parameter.requires_grad_(any(name.startswith(t) for t in trained))
    optimizer = torch.optim.Adam([p for _, p in named], lr=args.lr)

    port = free_port()
    server = start_server(args.model, port, args.threads)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            group_port = free_port()
            joined: list[httpx.Response] = []
            init = {
                "master_address": "127.0.0.1",
                "master_port": group_port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": GROUP_NAME,
                "backend": "gloo",
            }
            call = threading.Thread(
                target=lambda: joined.append(http.post("/init_weights_update_group", json=init))
            )
            call.start()
            group = open_weight_group("127.0.0.1", group_port, 0, 2, GROUP_NAME, "gloo")
            call.join()
            joined[0].raise_for_status()
            train(args, http, group, policy, tokenizer, named, optimizer, rng)
    finally:
        server.terminate()
        server.wait(30)


def train(
    args: argparse.Namespace,
    http: httpx.Client,
    group: Any,
    policy: Any,
    tokenizer: Any,
    named: Any,
    optimizer: Any,
    rng: random.Random,
) -> None:
    history = []
    print(f"{'step':>4} {'reward':>7} {'tokens':>7} {'max|Δlp|':>9} {'version':>8} {'s':>5}")
    for step in range(args.steps):
        started = time.perf_counter()
        questions = rng.sample(PROMPTS, args.prompts)
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            for q in questions
        ]
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = rollouts(http, prompts, args.group, args.max_new_tokens)
        rewards = torch.tensor(
            [reward(o, tokenizer, args.max_new_tokens) for o in outputs]
        )  # [prompts * group]
        grouped = rewards.view(args.prompts, args.group)
        advantages = (
            (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        ).flatten()
        optimizer.zero_grad()
        worst_mismatch = 0.0
        for index, output in enumerate(outputs):
            completion = output["output_ids"]
            if not completion or advantages[index] == 0:
                continue
            old = torch.tensor([entry[0] for entry in output["meta_info"]["output_token_logprobs"]])
            new = token_logprobs(policy, prompts[index // args.group], completion)
            worst_mismatch = max(worst_mismatch, (new.detach() - old).abs().max().item())
            ratio = torch.exp(new - old)
            clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
            surrogate = torch.minimum(ratio * advantages[index], clipped * advantages[index])
            loss = -surrogate.mean() / len(outputs)
            loss.backward()
        optimizer.step()
        push_weights(http, group, named, version=f"step-{step + 1}")
        mean_tokens = sum(len(o["output_ids"]) for o in outputs) / len(outputs)
        history.append(rewards.mean().item())
        seconds = time.perf_counter() - started
        version = outputs[0]["meta_info"]["weight_version"]
        print(
            f"{step:>4} {history[-1]:>7.3f} {mean_tokens:>7.1f} {worst_mismatch:>9.1e} {version:>8} {seconds:>5.1f}",
            flush=True,
        )
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")


if __name__ == "__main__":
    main()
