"""Small-batch linear layers on CPU: our int4 kernels vs oneDNN's packed bfloat16 vs torch's int8.

For SmolLM2-135M's shapes and 1..128 input rows, prints microseconds per call and the rate at which
each kernel streams its own weight format (GB/s of packed int4 with its scales, of bfloat16, of int8
with its row scales). int4 is measured up to three times: the row kernel (one dot product per row and group), on CPUs with
AVX512-BF16 the level-sums kernel (two groups per vector; up to its 8 rows), there without AMX the
blocked kernel (16 outputs per vector over the weight's blocked copy; above ``INT4_BLOCKED_MAX_ROWS`` rows the
same op runs the wide kernel over that copy, ``csrc/int4_wide_cpu.cpp``) and, where the CPU grants
AMX, the tile kernel (16 rows per tile product). Each shape is measured over enough DISTINCT weights that the int4 copies alone
exceed ``--working-set-mb`` (a single weight reused in a loop stays in the caches and overstates the
rate), cycling through them like a model's layers. The rows at which the tiles overtake the row kernel
set ``kTilesFromRows`` in csrc/int4_gemm_cpu.cpp, and those at which oneDNN overtakes the int4 kernels
``INT4_MAX_ROWS`` / ``INT4_BLOCKED_MAX_ROWS`` / ``INT4_MAX_ROWS_WITH_TILES`` in tokenmill/layers/int4.py.

    .venv/bin/python benchmarks/int4_gemv.py [--rows 1 2 4 8 16 32 64 128] [--threads 2]

With ``--float32`` the rows are float32 (a float32 model: the avx2 and avx512 paths) and the kernels
the row kernel (``csrc/group_gemm_f32_cpu.cpp``), the blocked kernel for float32 rows
(``csrc/int4_blocked_f32_cpu.cpp``, where it is built) and the float32 weight's product (our panels on
the avx2 path, else oneDNN), which set ``INT4_FLOAT32_MAX_ROWS`` and ``INT4_BLOCKED_F32_MAX_ROWS``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from tokenmill.layers.cpu_gemm import pack_weight, packed_linear
from tokenmill.layers.int4 import (
    INT4_PAIRS_MAX_ROWS,
    METHOD_PAIRS,
    METHOD_ROWS,
    METHOD_TILES,
    block_int4_layout,
    dequantize_int4_float32,
    int4_blocked_available,
    int4_blocked_f32_lanes,
    int4_has_tiles,
    int4_linear,
    int4_pairs_available,
    quantize_int4,
)

SHAPES = {
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm head 576->49152": (49152, 576),
}


def time_per_call(calls: list[Callable[[], torch.Tensor]], repeats: int) -> float:
    """Best over ``repeats`` passes of the mean seconds per call of one pass through ``calls``."""
    for call in calls[: min(len(calls), 8)]:
        call()  # warm-up (first-call allocations)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def float32_rows(args: argparse.Namespace) -> None:
    """The ``--float32`` table: per shape and row count, microseconds and GB/s of each kernel's format."""
    lanes = int4_blocked_f32_lanes()
    blocked = lanes > 0 and all(SHAPES[name][0] % 16 == 0 for name in args.shapes)
    columns = ["int4 rows", *([f"int4 blocked x{lanes}"] if blocked else []), "float32 weight"]
    print(f"{'shape':<20} {'rows':>4}  " + "  ".join(f"{c:>18}" for c in columns))
    for name in args.shapes:
        out_features, in_features = SHAPES[name]
        int4_bytes = out_features * in_features * (0.5 + 4 / 32)
        copies = max(2, math.ceil(args.working_set_mb * 1e6 / int4_bytes))
        triples = [quantize_int4(torch.randn(out_features, in_features) * 0.05) for _ in range(copies)]
        layouts = [block_int4_layout(*t) for t in triples] if blocked else []
        packed = [pack_weight(dequantize_int4_float32(*t)) for t in triples]
        for rows in args.rows:
            x = torch.randn(rows, in_features)  # [rows, in_features] float32
            kernels: list[tuple[list[Callable[[], torch.Tensor]], float]] = [
                ([lambda t=t, x=x: torch.ops.tokenmill.int4_linear(x, *t) for t in triples], int4_bytes)
            ]
            if blocked:
                kernels.append(
                    ([lambda t=t, x=x: torch.ops.tokenmill.int4_linear(x, *t) for t in layouts], int4_bytes)
                )
            kernels.append(
                ([lambda p=p, x=x: packed_linear(x, p, None) for p in packed], out_features * in_features * 4)
            )
            cells = []
            for calls, size in kernels:
                seconds = time_per_call(calls, args.repeats)
                cells.append(f"{seconds * 1e6:7.1f} us {size / seconds / 1e9:5.1f}")
            print(f"{name:<20} {rows:>4}  " + "  ".join(f"{cell:>18}" for cell in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--working-set-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--float32", action="store_true", help="float32 rows (the avx2 and avx512 paths)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(f"{args.threads} threads; per call: microseconds, GB/s of the kernel's own weight format")
    if args.float32:
        float32_rows(args)
        return
    tiles = int4_has_tiles()
    pairs = int4_pairs_available()
    blocked = int4_blocked_available() and all(SHAPES[name][0] % 16 == 0 for name in args.shapes)
    columns = ["int4 rows", *(["int4 sums"] if pairs else []), *(["int4 blocked"] if blocked else [])]
    columns += ["int4 tiles"] if tiles else []
    columns += ["oneDNN bf16", "int8pack_mm"]
    print(f"{'shape':<20} {'rows':>4}  " + "  ".join(f"{c:>16}" for c in columns))
    for name in args.shapes:
        out_features, in_features = SHAPES[name]
        int4_bytes = out_features * in_features * (0.5 + 4 / 32)  # nibbles + f16 scale and min per 32
        copies = max(2, math.ceil(args.working_set_mb * 1e6 / int4_bytes))
        int4_weights, blocked_weights, bf16_packed, int8_weights = [], [], [], []
        for _ in range(copies):
            weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.05
            int4_weights.append(quantize_int4(weight))
            if blocked:
                blocked_weights.append(block_int4_layout(*int4_weights[-1]))
            bf16_packed.append(pack_weight(weight))
            scales = (weight.float().abs().amax(dim=1) / 127).to(torch.bfloat16)  # [out_features]
            qweight = torch.round(weight.float() / scales.float()[:, None]).to(torch.int8)  # [out, in]
            int8_weights.append((qweight, scales))
        sizes = {
            "int4 rows": int4_bytes,
            "int4 tiles": int4_bytes,
            "int4 sums": int4_bytes,
            "int4 blocked": int4_bytes,
            "bf16": out_features * in_features * 2,
            "int8": out_features * (in_features + 2),
        }
        for rows in args.rows:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)  # [rows, in_features]
            kernels: dict[str, list[Callable[[], torch.Tensor]]] = {
                "int4 rows": [lambda q=q, x=x: int4_linear(x, *q, None, METHOD_ROWS) for q in int4_weights],
                "int4 sums": [lambda q=q, x=x: int4_linear(x, *q, None, METHOD_PAIRS) for q in int4_weights],
                "int4 blocked": [
                    lambda q=q, x=x: torch.ops.tokenmill.int4_linear(x, *q) for q in blocked_weights
                ],
                "int4 tiles": [lambda q=q, x=x: int4_linear(x, *q, None, METHOD_TILES) for q in int4_weights],
                "bf16": [lambda p=p, x=x: packed_linear(x, p, None) for p in bf16_packed],
                "int8": [lambda w=w, x=x: torch._weight_int8pack_mm(x, *w) for w in int8_weights],
            }
            if not tiles:
                del kernels["int4 tiles"]
            if not pairs:
                del kernels["int4 sums"]
            if not blocked:
                del kernels["int4 blocked"]
            cells = []
            for kind, calls in kernels.items():
                if kind == "int4 sums" and rows > INT4_PAIRS_MAX_ROWS:
                    cells.append("-")
                    continue
                seconds = time_per_call(calls, args.repeats)
                cells.append(f"{seconds * 1e6:7.1f} us {sizes[kind] / seconds / 1e9:4.1f}")
            print(f"{name:<20} {rows:>4}  " + "  ".join(f"{cell:>16}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
