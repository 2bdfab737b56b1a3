"""TOKENMILL_CPU_ISA: the path is read, checked against the CPU's flags and turned into compile flags
and torch's environment (layers/cpu_isa.py)."""

from __future__ import annotations

import pytest

from tokenmill.config import cpu_isa_choice
from tokenmill.layers import cpu_isa

ZEN3 = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_choice_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_CPU_ISA", raising=False)
    assert cpu_isa_choice() is None
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "auto")
    assert cpu_isa_choice() is None
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    assert cpu_isa_choice() == "avx2"
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match=r"TOKENMILL_CPU_ISA must be auto or one of .*'sse2'"):
        cpu_isa_choice()


def test_default_is_the_best_path_the_cpu_has() -> None:
    assert cpu_isa.resolve_isa(None, SAPPHIRE_RAPIDS) == "amx"
    assert cpu_isa.resolve_isa(None, ZEN4) == "avx512_bf16"
    assert cpu_isa.resolve_isa(None, ZEN4 - {"avx512_bf16"}) == "avx512"
    assert cpu_isa.resolve_isa(None, ZEN3) == "avx2"
    assert cpu_isa.resolve_isa(None, frozenset({"neon"})) is None
    assert cpu_isa.supported_isas(ZEN4) == ["avx512_bf16", "avx512", "avx2"]


def test_a_path_the_cpu_lacks_is_a_clear_error() -> None:
    assert cpu_isa.resolve_isa("avx2", ZEN4) == "avx2"
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA=amx needs the CPU features amx_tile, amx_bf16"):
        cpu_isa.resolve_isa("amx", ZEN4)
    with pytest.raises(ValueError, match="avx512f, avx512bw, avx512vl, avx512_bf16.*it can run: avx2"):
        cpu_isa.resolve_isa("avx512_bf16", ZEN3)


def test_lower_path_compiles_without_the_features_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    for choice, removed, kept, environment in (
        (None, (), (), {}),
        ("amx", (), (), {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}),
        ("avx512_bf16", ("-mno-amx-tile",), ("-mno-avx512f",), {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
        ("avx512", ("-mno-amx-tile", "-mno-avx512bf16"), ("-mno-avx512f",), {}),
        (
            "avx2",
            ("-mno-amx-tile", "-mno-avx512f"),
            (),
            {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        ),
    ):
        monkeypatch.setattr(cpu_isa, "cpu_isa_choice", lambda choice=choice: choice)
        cpu_isa.cpu_isa.cache_clear()
        flags = cpu_isa.compile_flags()
        assert flags[0] == "-march=native"
        assert all(flag in flags for flag in removed) and not any(flag in flags for flag in kept)
        if not removed:
            assert flags == ("-march=native",)  # the best path shares the default build
        assert environment.items() <= cpu_isa.torch_environment().items()
        assert cpu_isa.bfloat16_instructions() == (choice != "avx2")
        assert cpu_isa.bfloat16_kernels() == (choice in (None, "amx", "avx512_bf16"))
    cpu_isa.cpu_isa.cache_clear()
