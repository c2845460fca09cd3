"""``--dtype auto`` follows the hardware; bf16 weights are packed only where oneDNN has a bf16 path,
and packed matmuls run padded row counts."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from epdserve import config
from epdserve.config import EngineArgs, cpu_has_fast_bf16, cpu_has_onednn_bf16, resolve_dtype_name
from epdserve.errors import ConfigError
from epdserve.models.layers import packed_linear


class _Packable(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16).to(dtype), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None


@pytest.mark.parametrize("fast_bf16,expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cpu_follows_bf16_support(monkeypatch, fast_bf16: bool, expected: str) -> None:
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert resolve_dtype_name("auto", "cpu") == expected
    assert resolve_dtype_name("auto") == expected  # the device defaults to cpu
    # a CUDA device takes bf16 whatever the host CPU does; explicit dtypes are kept as asked
    assert resolve_dtype_name("auto", "cuda") == "bfloat16"
    assert resolve_dtype_name("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype_name("bf16", "cpu") == "bfloat16"
    assert resolve_dtype_name("fp32", "cuda") == "float32"
    assert EngineArgs(device="cpu").resolve(1024, 1 << 20).dtype == expected


def test_fast_bf16_is_in_hardware_and_onednn_path(monkeypatch) -> None:
    assert cpu_has_onednn_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    # This host's answer: oneDNN's path, and AVX512-BF16 or AMX tiles.
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_has_fast_bf16() == (cpu_has_onednn_bf16() and native)
    # An AVX-512 CPU without them: oneDNN packs and emulates bf16, which does not count as fast.
    for avx512_bf16, amx, expected in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(config, "cpu_has_onednn_bf16", lambda: True)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        config.cpu_has_fast_bf16.cache_clear()
        assert config.cpu_has_fast_bf16() is expected
    monkeypatch.setattr(config, "cpu_has_onednn_bf16", lambda: False)
    config.cpu_has_fast_bf16.cache_clear()
    assert not config.cpu_has_fast_bf16()  # no oneDNN path at all
    monkeypatch.undo()
    config.cpu_has_fast_bf16.cache_clear()


def test_bad_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dtype must be auto or one of"):
        resolve_dtype_name("int3", "cpu")


def test_no_packing_and_no_warning_without_bf16_support(monkeypatch, caplog) -> None:
    monkeypatch.setattr(packed_linear, "cpu_has_onednn_bf16", lambda: False)
    model = nn.Sequential(_Packable(torch.bfloat16), _Packable(torch.bfloat16))
    with caplog.at_level(logging.WARNING):
        assert packed_linear.prepack_model(model) == 0
    assert all(m.packed_weight is None for m in model)
    assert not caplog.records
    x = torch.randn(4, 16).to(torch.bfloat16)
    torch.testing.assert_close(packed_linear.linear(x, model[0].weight, None, None), x @ model[0].weight.T)


@pytest.mark.skipif(not cpu_has_onednn_bf16(), reason="this CPU has no bf16 matmul path in oneDNN")
def test_bf16_weights_packed_where_supported() -> None:
    model = nn.Sequential(_Packable(torch.bfloat16), _Packable(torch.float32))
    assert packed_linear.prepack_model(model) == 1  # float32 weights stay with F.linear
    x = torch.randn(4, 16).to(torch.bfloat16)
    out = packed_linear.linear(x, model[0].weight, None, model[0].packed_weight)
    torch.testing.assert_close(out, x @ model[0].weight.T, rtol=2e-2, atol=2e-2)


def test_padded_rows_bounds_the_shapes_and_the_waste() -> None:
    sizes = [packed_linear.padded_rows(n) for n in range(1, 2049)]
    assert sizes[:packed_linear.EXACT_ROWS] == [max(n, packed_linear.MIN_ROWS) for n in range(1, packed_linear.EXACT_ROWS + 1)]
    for n, rows in enumerate(sizes, start=1):
        assert n <= rows < n * 1.125 or n <= packed_linear.EXACT_ROWS
    assert sizes == sorted(sizes) and len(set(sizes)) <= 110
    assert packed_linear.padded_rows(2048) == 2048 and packed_linear.padded_rows(2049) == 2304


@pytest.mark.parametrize("num_rows", [1, 64, 65, 130, 300])
def test_packed_linear_with_padded_rows_matches_f_linear(num_rows: int) -> None:
    """Through oneDNN's packed matmul (float32 packs on every x86 CPU) with rows padded and cut."""
    gen = torch.Generator().manual_seed(num_rows)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, packed_linear.DEFAULT_BATCH_HINT)
    except (RuntimeError, AttributeError):
        pytest.skip("this torch build cannot pack float32 weights for oneDNN")
    x = torch.randn(num_rows, 32, generator=gen)
    out = packed_linear.linear(x, weight, bias, packed)
    assert out.shape == (num_rows, 48)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
