"""Which x86 instruction-set path the CPU kernels (and torch's own CPU kernels) run: ``amx``,
``avx512_bf16``, ``avx512`` or ``avx2`` (``TOKENMILL_CPU_ISA``, read by ``config.cpu_isa_choice``).

The default is the best path this CPU has. A lower path is for measuring and testing the kernels an
AVX2 laptop or a Zen 4 would run, on a bigger machine: the C++ kernels are compiled for the CPU minus
the features above the path (``-march=native -mno-...``: their ``#if`` blocks pick the vector code
from the compiler's feature macros), into their own cache folder; torch's ATen kernels and oneDNN
are held to the same level (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, set for the process
when unset); and the Python-side choices (``--dtype auto``, float32 panels, the bfloat16 weight
packing) follow :func:`cpu_isa`. A path the CPU cannot run is a ``ValueError`` naming what it lacks.

What each path uses (the kernels' own ``#if`` blocks decide; this table is their summary):

- ``amx``: AMX tiles for prefill attention, decode attention's scores and int4 products from 16 rows
  up; AVX-512 BF16 vectors elsewhere.
- ``avx512_bf16``: the same kernels on AVX-512 vectors with ``vdpbf16ps`` bfloat16 dot products.
- ``avx512``: AVX-512 vectors, no bfloat16 instructions: the bfloat16-only kernels (prefill
  attention, the int4 and 8-bit group products' vector paths) are not built, so ``--dtype auto`` is
  float32 (:func:`bfloat16_kernels`), whose int4 rows take the AVX2/FMA float32 kernels; an explicit
  bfloat16 runs the portable loops (a quantized SmolLM2 decodes at ~8 tok/s that way, ~135 in
  float32, measured on a Zen 4 held to this path).
- ``avx2``: 8-lane AVX2/FMA vectors; ``--dtype auto`` is float32 (oneDNN has no bfloat16 there),
  float32 panel products and the float32 prefill attention kernel.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from tokenmill.config import CPU_ISAS, cpu_isa_choice

# /proc/cpuinfo flags each path needs.
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "amx": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "fma", "f16c"),
}
# Compiler switches that take the features above each path away from ``-march=native``.
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_REMOVE_FLAGS: dict[str, tuple[str, ...]] = {
    "amx": (),
    "avx512_bf16": _NO_AMX,
    "avx512": (*_NO_AMX, "-mno-avx512bf16"),
    "avx2": (*_NO_AMX, "-mno-avx512f"),  # -mno-avx512f takes every AVX-512 extension with it
}
# The levels torch's own kernels are held to on each path (read when torch first needs them).
_ATEN_CAPABILITY = {"amx": "avx512", "avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2"}
_ONEDNN_ISA = {
    "amx": "AVX512_CORE_AMX",
    "avx512_bf16": "AVX512_CORE_BF16",
    "avx512": "AVX512_CORE_VNNI",
    "avx2": "AVX2",
}


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas(flags: frozenset[str]) -> list[str]:
    """The paths a CPU with ``flags`` can run, best first (empty off x86 or below AVX2)."""
    return [isa for isa in CPU_ISAS if all(flag in flags for flag in REQUIRED_FLAGS[isa])]


def resolve_isa(choice: str | None, flags: frozenset[str]) -> str | None:
    """``choice`` checked against ``flags``, or the best path when None; None when the CPU has no path
    (not x86, or below AVX2: the kernels' portable loops). ValueError for a path the CPU lacks."""
    runnable = supported_isas(flags)
    if choice is None:
        return runnable[0] if runnable else None
    if choice not in runnable:
        missing = [flag for flag in REQUIRED_FLAGS[choice] if flag not in flags]
        raise ValueError(
            f"TOKENMILL_CPU_ISA={choice} needs the CPU features {', '.join(missing)}, which this CPU "
            f"({cpu_model_name()}) lacks; it can run: {', '.join(runnable) or 'none of ' + str(CPU_ISAS)}"
        )
    return choice


@functools.cache
def cpu_isa() -> str | None:
    """The path this process runs (``TOKENMILL_CPU_ISA`` or the best this CPU has; None off x86)."""
    return resolve_isa(cpu_isa_choice(), cpu_flags())


def compile_flags() -> tuple[str, ...]:
    """The ``-march`` switches the CPU kernels are compiled with for :func:`cpu_isa`. The best path is
    plain ``-march=native`` (the build every default start shares)."""
    isa = cpu_isa()
    best = resolve_isa(None, cpu_flags())
    if isa is None or isa == best:
        return ("-march=native",)
    return ("-march=native", *_REMOVE_FLAGS[isa])


def torch_environment() -> dict[str, str]:
    """The environment variables that hold torch's ATen kernels and oneDNN to :func:`cpu_isa` (empty
    on the default path: torch picks the best itself)."""
    isa = cpu_isa()
    if isa is None or cpu_isa_choice() is None:
        return {}
    return {"ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[isa], "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[isa]}


def apply_torch_environment() -> None:
    """Set :func:`torch_environment` in this process where unset. It holds only if it runs before
    torch's first CPU kernel and oneDNN's first primitive (torch reads both once); model loading and
    the kernel build call it early."""
    for name, value in torch_environment().items():
        os.environ.setdefault(name, value)


def bfloat16_instructions() -> bool:
    """Whether the path computes bfloat16 in hardware for oneDNN (every AVX-512 path; AMX): False on
    ``avx2``, where ``--dtype auto`` is float32."""
    return cpu_isa() in ("amx", "avx512_bf16", "avx512")


def bfloat16_kernels() -> bool:
    """Whether tokenmill's own bfloat16 vector kernels (int4 and 8-bit group products, prefill
    attention) are built on this path: ``amx`` and ``avx512_bf16`` (and off x86, where torch's own
    kernels decide); not ``avx512`` or ``avx2``, where ``--dtype auto`` is float32."""
    return cpu_isa() in (None, "amx", "avx512_bf16")


def cpu_model_name() -> str:
    """``lscpu``'s model name (from /proc/cpuinfo), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
