"""Builds, caches and loads the C++ CPU kernels (``tokenmill/csrc``): paged decode attention and the
KV write (used by ``layers/attention/cpu_paged.py``), the fused norm / rotary / activation /
argmax ops that ``tokenmill.layers.fused_cpu`` dispatches to, the int4 linear layer of
``tokenmill.layers.int4`` and the float32 panel linear of ``tokenmill.layers.cpu_gemm``.

The kernels are compiled with ``torch.utils.cpp_extension`` on first use, for the machine it runs on
(``-march=native``, less the features above ``TOKENMILL_CPU_ISA``'s path: ``layers/cpu_isa.py``), into
``extension_cache_dir()/paged_attention_cpu-<key>``. The key hashes the sources, the flags (so each
path has its own build), the torch version and the CPU's feature flags, so an edit, a torch upgrade or a
different CPU gets its own build while every later start loads the cached library in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

from tokenmill.config import extension_cache_dir
from tokenmill.layers.cpu_isa import apply_torch_environment, compile_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = [
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "fused_ops_cpu.cpp",
    CSRC / "gemma_ops_cpu.cpp",
    CSRC / "int4_gemm_cpu.cpp",
    CSRC / "int4_pairs_cpu.cpp",
    CSRC / "int4_blocked_cpu.cpp",
    CSRC / "int4_blocked_f32_cpu.cpp",
    CSRC / "int4_wide_cpu.cpp",
    CSRC / "decoder_layer_cpu.cpp",
    CSRC / "gemma_decoder_cpu.cpp",
    CSRC / "q8_gemm_cpu.cpp",
    CSRC / "q8_blocked_f32_cpu.cpp",
    CSRC / "prefill_attention_cpu.cpp",
    CSRC / "prefill_attention_f32_cpu.cpp",
    CSRC / "f32_gemm_cpu.cpp",
    CSRC / "group_gemm_f32_cpu.cpp",
    CSRC / "batch_invariant_gemm_cpu.cpp",
]
HEADERS = [
    CSRC / "vec16.h",
    CSRC / "cpu_ops.h",
    CSRC / "group_gemm.h",
    CSRC / "int4_blocked_layout.h",
    CSRC / "f32_lanes.h",
    CSRC / "amx_tiles.h",
    CSRC / "tile_layout.h",
    CSRC / "online_softmax.h",
    CSRC / "rows_grain.h",
]
NAME = "tokenmill_paged_attention_cpu"
# Tuples: cpp_extension.load appends to the lists it is given, which would change the cache key.
LDFLAGS = ("-fopenmp",)
MAX_HEAD_DIM = 1024  # the decode kernel's widest head (MLA's latent: 576 for DeepSeek-V3)
# torch's extension build holds a lock file in the build folder while it compiles, and a later build
# waits for it to go: one left by a process killed mid-build would make every start wait for ever. A
# build takes about a minute on 2 cores; a lock older than this is stale.
STALE_BUILD_LOCK_SECONDS = 900.0


def cflags() -> tuple[str, ...]:
    """The compile flags: ``-O3 -fopenmp`` and ``-march=native`` less the features above the
    ``TOKENMILL_CPU_ISA`` path (``layers/cpu_isa.py``; plain ``-march=native`` on the default path)."""
    return ("-O3", *compile_flags(), "-fopenmp")


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build_directory() -> Path:
    """The cache folder of the build matching these sources, these flags, this torch and this CPU."""
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.read_bytes())
    for part in (" ".join((*cflags(), *LDFLAGS)), torch.__version__):
        digest.update(part.encode())
    digest.update(_cpu_flags().encode())
    return Path(extension_cache_dir()) / f"paged_attention_cpu-{digest.hexdigest()[:16]}"


def stage_sources(folder: Path, paths: list[Path]) -> list[str]:
    """Copy ``paths`` into ``folder/src`` (a file whose content is already there is left untouched, so
    its time stamp does not trigger a rebuild) and return the copies' paths, in order.

    Builds compile these copies, not the package's files: ninja records absolute source paths, so a
    build from another checkout of the same sources (a worktree, a second venv) would otherwise see a
    different build file and recompile the shared folder while holding its lock."""
    staged_dir = folder / "src"
    staged_dir.mkdir(parents=True, exist_ok=True)
    staged = []
    for path in paths:
        target = staged_dir / path.name
        content = path.read_bytes()
        if not target.exists() or target.read_bytes() != content:
            partial = staged_dir / f".{path.name}.{os.getpid()}.partial"
            partial.write_bytes(content)
            os.replace(partial, target)  # atomic: a concurrent build never reads half a file
        staged.append(str(target))
    return staged


def remove_stale_build_lock(folder: Path, max_age_s: float = STALE_BUILD_LOCK_SECONDS) -> bool:
    """Remove ``folder``'s build lock when it is older than ``max_age_s`` (its build was killed); True
    when it did. A younger lock belongs to a build under way and is left to it."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    logger.warning("removing a kernel build lock %.0f s old (a build that never finished): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def library_build_directory(prefix: str, paths: list[Path], extra_flags: tuple[str, ...] = ()) -> Path:
    """The cache folder ``<prefix>-<hash>`` of a kernel library of its own (``layers/lora_kernel.py``,
    ``layers/recurrent_kernel.py``), keyed by its source ``paths``, the flags (``cflags`` plus
    ``extra_flags``), torch and the CPU."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    for part in (" ".join((*cflags(), *extra_flags, *LDFLAGS)), torch.__version__, _cpu_flags()):
        digest.update(part.encode())
    return Path(extension_cache_dir()) / f"{prefix}-{digest.hexdigest()[:16]}"


def build_library(
    name: str, prefix: str, source: Path, headers: list[Path], extra_flags: tuple[str, ...]
) -> str | None:
    """Build (first time) and load the op library ``name`` from one C++ ``source`` (including
    ``headers``) into ``library_build_directory(prefix, ...)``; None when loaded, else why not.

    Never raises: a missing compiler or a bad build is returned, so the caller uses its torch
    reference. Not cached here: callers cache per library (``functools.cache``)."""
    try:
        from torch.utils import cpp_extension

        folder = library_build_directory(prefix, [source, *headers], extra_flags)
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_build_lock(folder)
        cpp_extension.load(
            name=name,
            sources=stage_sources(folder, [source, *headers])[:1],
            extra_cflags=[*cflags(), *extra_flags],
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a bad build: the caller's torch reference is used
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.cache
def load_error() -> str | None:
    """Builds (first time) and loads the kernel; None when ``torch.ops.tokenmill`` has it, else why not.

    Cached: a failed build is reported once per process, not once per layer.
    """
    try:
        from torch.utils import cpp_extension

        apply_torch_environment()
        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_build_lock(folder)
        built = (folder / f"{NAME}.so").exists()
        if not built:
            # A warning so that the one slow start (about 10 s) is explained even with logging unset.
            logger.warning("compiling the CPU kernels (once) into %s ...", folder)
        start = time.perf_counter()
        cpp_extension.load(
            name=NAME,
            sources=stage_sources(folder, [*SOURCES, *HEADERS])[: len(SOURCES)],
            extra_cflags=list(cflags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        if not built:
            logger.info("CPU kernels compiled in %.1f s", time.perf_counter() - start)
        _register_fake()
    except Exception as exc:  # any failure (no compiler, no ninja, a bad build) means "use the reference"
        return f"{type(exc).__name__}: {exc}"
    return None


def _register_fake() -> None:
    """Shape-only implementation so the op can be traced by ``torch.compile``."""

    @torch.library.register_fake("tokenmill::paged_attention_decode")
    def _(query, key_cache, value_cache, block_tables, seq_lens, scale, window, tiles=True, sinks=None):  # type: ignore[no-untyped-def]
        return query.new_empty(query.shape)

    @torch.library.register_fake("tokenmill::paged_prefill_attention")
    def _prefill(query, key_cache, value_cache, block_table, start, scale, tiles=True):  # type: ignore[no-untyped-def]
        return query.new_empty(query.shape)

    @torch.library.register_fake("tokenmill::rms_norm")
    def _rms(x, weight, eps):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape)

    @torch.library.register_fake("tokenmill::silu_and_mul")
    def _silu(x):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("tokenmill::gemma_rms_norm")
    def _gemma_rms(x, scale, eps):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape)

    @torch.library.register_fake("tokenmill::gelu_tanh_and_mul")
    def _gelu(x):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("tokenmill::int4_linear")
    def _int4_linear(x, packed, scales, mins, method=0):  # type: ignore[no-untyped-def]
        return x.new_empty((x.shape[0], packed.shape[0]))

    @torch.library.register_fake("tokenmill::int4_dequantize")
    def _int4_dequantize(packed, scales, mins):  # type: ignore[no-untyped-def]
        return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.bfloat16)


def paged_attention_decode(
    query: torch.Tensor,  # [S, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [S] int32/int64, same dtype as block_tables
    scale: float,
    window: int | None = None,
    tiles: bool = True,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """One query token per sequence attending to its cached keys/values, read through its block table.

    Sequence ``s`` attends to positions ``[max(0, seq_lens[s] - window), seq_lens[s])``; query head
    ``h`` uses KV head ``h // (num_heads // kv_heads)``. Float32 accumulation; returns
    ``[S, num_heads, head_dim]`` in the query dtype. The caches have the query's dtype, or are bfloat16
    or float16 under a float32 query (widened to float32 as they are read: the same bits as a float32
    cache holding those values). ``tiles`` lets bfloat16 caches of 16-slot blocks
    with head_dim 64 or 128 use AMX tile products where the CPU and the OS allow them (the
    probabilities then meet the values in bfloat16, as in flash attention); False keeps the vector
    path. ``sinks`` (gpt-oss's attention sinks) adds ``exp(sinks[h])`` to head ``h``'s softmax
    denominator, a key without a value. Builds the kernel on first use; raises ``RuntimeError`` when it
    cannot.
    """
    return _op()(
        query, key_cache, value_cache, block_tables, seq_lens, float(scale), int(window or 0), tiles, sinks
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] bfloat16 or float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous: see below
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] key_cache's dtype
    block_table: torch.Tensor,  # [max_blocks] int64: one sequence's blocks
    start: int,
    scale: float,
    tiles: bool = True,
) -> torch.Tensor:
    """One sequence's chunk of ``T`` new tokens at positions ``start .. start + T - 1`` attending to its
    cached keys/values (this step's already stored), causally: token ``t`` sees positions
    ``[0, start + t]``. Reads the cache blocks in place. bfloat16 (``csrc/prefill_attention_cpu.cpp``):
    AMX tile products where :func:`attention_tiles_available` and ``tiles``, else the same products on
    AVX512-BF16 vectors; 16-slot blocks, head_dim 64 or 128. float32
    (``csrc/prefill_attention_f32_cpu.cpp``, ``tiles`` unused): AVX2 vectors, any block size, head_dim
    a multiple of 8 up to 256, over a float32, bfloat16 or float16 cache. Only where :func:`prefill_kernel_available` for the dtype. Returns
    ``[T, num_heads, head_dim]`` in the query's dtype; RuntimeError otherwise."""
    _op()  # builds the kernels, or raises
    return torch.ops.tokenmill.paged_prefill_attention(
        query, key_cache, value_cache, block_table, start, scale, tiles
    )


@functools.cache
def attention_tiles_available() -> bool:
    """Whether the attention kernels' AMX tile paths run here (``paged_prefill_attention``, and
    ``paged_attention_decode`` with ``tiles``): the kernels built, and the CPU and the OS grant AMX."""
    return load_error() is None and bool(torch.ops.tokenmill.attention_tiles_available())


@functools.cache
def prefill_kernel_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`paged_prefill_attention` runs here for ``dtype``: bfloat16 on CPUs with
    AVX512-BF16 (AMX tiles on top where granted), float32 on CPUs with AVX2 and FMA but no AVX-512
    (``csrc/prefill_attention_f32_cpu.cpp``); no other dtype."""
    if load_error() is not None:
        return False
    if dtype == torch.float32:
        return bool(torch.ops.tokenmill.prefill_attention_f32_available())
    return dtype == torch.bfloat16 and bool(torch.ops.tokenmill.prefill_attention_available())


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim], rows contiguous
    value: torch.Tensor,  # [T, kv_heads, head_dim], rows contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Store token ``t``'s key and value rows at slot ``slot_mapping[t]`` of the caches (as
    ``index_copy_`` into the caches viewed as ``[num_slots, kv_heads, head_dim]``, with the cache-line
    misses of the scattered slots overlapped). The rows have the caches' dtype, or are float32 rows
    rounded into bfloat16 or float16 caches as ``.to()`` rounds them. RuntimeError on a slot outside
    the cache."""
    _op()  # builds the kernels, or raises
    torch.ops.tokenmill.write_kv(key, value, key_cache, value_cache, slot_mapping)


@functools.cache
def _op():  # type: ignore[no-untyped-def]
    error = load_error()
    if error is not None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {error}")
    return torch.ops.tokenmill.paged_attention_decode


def main() -> None:
    """``python -m tokenmill.layers.cpu_kernels``: build the kernel now (``make install`` does,
    so the first start does not pay the ~15 s compile). Exits 0 either way: the kernel is optional."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    error = load_error()
    if error is None:
        print(f"CPU attention kernel ready in {build_directory()}")
    else:
        print(f"CPU attention kernel unavailable, the torch reference backend will be used: {error}")


if __name__ == "__main__":
    main()
