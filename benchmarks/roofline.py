"""How close tokenmill runs to this machine's limits on SmolLM2-135M (one ``TOKENMILL_CPU_ISA`` path).

Measures the memory bandwidth (the best of a few reads of a 512 MiB buffer: a sum, which streams it
once) and the matrix-product rate of the path's compute dtype (bfloat16 on the AVX-512 paths, float32
on avx2; a 1024-row product with SmolLM2's MLP shape), then for each workload of
``vs_llamacpp.py`` (single-stream decode, 64-sequence decode, prefill; 128-token prompts and outputs)
prints the two bounds and the achieved fraction of each:

- memory bound: tokens per step x bandwidth / bytes a step reads (every weight once in the format
  that workload's products read it, plus each sequence's cached keys and values at the mean context)
- compute bound: product rate / FLOPs per token (2 per weight, plus attention's 4 per head_dim and
  cached position; the LM head once per sequence)

The weight formats are those the engine picks on the path: on the bfloat16 paths the bundled GGUF's
exactly 4-bit layers use the int4 kernel and its tied embedding the 8-bit LM head up to a few rows
(``layers/int4.py``, ``layers/q8.py``), the packed bfloat16 weight above; on avx2 the same copies
on float32 rows up to a few rows, float32 weights above.

    .venv/bin/python benchmarks/roofline.py --isa avx2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
PROMPT_LEN = 128
OUTPUT_LEN = 128
# Bytes per weight of each storage format (int4: 16 bytes of nibbles + float16 scale and minimum per
# 32; q8: 32 int8 + a float16 scale per 32).
FORMAT_BYTES = {"int4": 20 / 32, "q8": 34 / 32, "bfloat16": 2.0, "float32": 4.0}
# Rows up to which the int4 / 8-bit kernels run on the paths without AMX (layers/int4.py INT4_MAX_ROWS;
# the bfloat16 LM head's bound is 1 row, a difference of 1/20 of a step's bytes); above it the packed
# bfloat16 (or float32) weight.
SMALL_STEP_ROWS = 8


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def layer_params(self) -> int:
        """Weights of the linear layers of one decoder layer (q, k, v, o, gate, up, down)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_position(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes

    def attention_flops_per_position(self) -> int:
        return 4 * self.layers * self.heads * self.head_dim


def smollm2_shape() -> Shape:
    from tokenmill.loader.source import resolve_model

    config = resolve_model("smollm2-135m").hf_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Shape(
        config.num_hidden_layers,
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        config.vocab_size,
    )


def measure_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of the best full read of a 512 MiB buffer."""
    import torch

    buffer = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # [elements] 512 MiB
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def measure_matmul(dtype_name: str, repeats: int = 5) -> float:
    """FLOP/s of the best of a few [1024, 576] x [576, 1536] products in ``dtype_name``."""
    import torch

    dtype = getattr(torch, dtype_name)
    x = torch.randn(1024, 576).to(dtype)  # [rows, hidden]
    w = torch.randn(1536, 576).to(dtype)  # [intermediate, hidden]
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * 1024 * 576 * 1536 / best


def step_costs(shape: Shape, isa: str, sequences: int, prefill: bool) -> tuple[float, float, float]:
    """(bytes read per step, FLOPs per step, tokens per step) of one workload step."""
    compute = "float32" if isa == "avx2" else "bfloat16"
    element = FORMAT_BYTES[compute]
    rows = sequences * (PROMPT_LEN if prefill else 1)
    if rows <= SMALL_STEP_ROWS:  # float32 rows too (csrc/group_gemm_f32_cpu.cpp)
        layer_format, head_format = "int4", "q8"
    else:
        layer_format = head_format = compute
    weights = shape.layers * shape.layer_params * FORMAT_BYTES[layer_format]
    weights += shape.head_params * FORMAT_BYTES[head_format]
    if prefill:  # each prompt's tokens attend causally to the prompt so far: mean context half of it
        context, kv = PROMPT_LEN / 2, 0.0
    else:
        context = PROMPT_LEN + OUTPUT_LEN / 2
        kv = sequences * context * shape.kv_bytes_per_position(int(element))
    flops = rows * (2 * shape.layers * shape.layer_params + shape.attention_flops_per_position() * context)
    flops += sequences * 2 * shape.head_params  # logits of each sequence's last token
    return weights + kv, flops, rows


def measured_rates(isa: str, repeats: int) -> tuple[str, dict[str, float]]:
    """tokenmill's rates on the path, from vs_llamacpp.py's offline workloads (a child process)."""
    env = {**os.environ, "TOKENMILL_CPU_ISA": isa}
    command = [
        sys.executable,
        str(BENCHMARKS / "vs_llamacpp.py"),
        "--offline-json",
        "--repeats",
        str(repeats),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"tokenmill on path {isa} failed:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return str(report["isa"]), report["rates"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--isa", default="auto", help="TOKENMILL_CPU_ISA path (auto: the CPU's best)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bounds-only", action="store_true", help="measure the machine, not tokenmill")
    args = parser.parse_args()

    os.environ["TOKENMILL_CPU_ISA"] = args.isa
    from tokenmill.layers.cpu_isa import apply_torch_environment, cpu_isa, cpu_model_name

    apply_torch_environment()  # before torch's first kernel: the matmul runs on the path's ISA
    isa = cpu_isa() or "avx2"
    compute = "float32" if isa == "avx2" else "bfloat16"
    bandwidth = measure_bandwidth()
    peak = measure_matmul(compute)
    print(f"{cpu_model_name()}, {os.cpu_count()} cores, path {isa}, load average {os.getloadavg()[0]:.1f}")
    print(f"memory read {bandwidth / 1e9:.1f} GB/s; {compute} matmul {peak / 1e9:.0f} GFLOP/s")
    rates: dict[str, float] = {}
    if not args.bounds_only:
        _, rates = measured_rates(args.isa, args.repeats)
    shape = smollm2_shape()
    print(
        f"\n{'workload':22}{'tok/s':>9}{'MB/step':>9}{'mem bound':>11}{'of it':>7}{'GFLOP/tok':>11}{'compute bound':>15}{'of it':>7}"
    )
    for name, sequences, prefill in (
        ("single-stream decode", 1, False),
        ("64-seq decode", 64, False),
        ("prefill", 64, True),
    ):
        step_bytes, step_flops, tokens = step_costs(shape, isa, sequences, prefill)
        memory_bound = tokens * bandwidth / step_bytes
        compute_bound = tokens * peak / step_flops
        rate = rates.get(name)
        shown = f"{rate:9.1f}" if rate else f"{'-':>9}"
        memory_share = f"{rate / memory_bound:6.0%}" if rate else f"{'-':>6}"
        compute_share = f"{rate / compute_bound:6.0%}" if rate else f"{'-':>6}"
        print(
            f"{name:22}{shown}{step_bytes / 1e6:9.1f}{memory_bound:11.0f} {memory_share}"
            f"{step_flops / tokens / 1e9:11.3f}{compute_bound:15.0f} {compute_share}"
        )


if __name__ == "__main__":
    main()
