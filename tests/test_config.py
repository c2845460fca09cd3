"""``--dtype auto`` follows the hardware; bf16 weights are packed only where oneDNN has a bf16 path."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from epdserve import config
from epdserve.config import EngineArgs, cpu_has_fast_bf16, resolve_dtype_name
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


def test_bf16_support_is_onednn_own_check() -> None:
    assert cpu_has_fast_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_bad_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dtype must be auto or one of"):
        resolve_dtype_name("int3", "cpu")


def test_no_packing_and_no_warning_without_bf16_support(monkeypatch, caplog) -> None:
    monkeypatch.setattr(packed_linear, "cpu_has_fast_bf16", lambda: False)
    model = nn.Sequential(_Packable(torch.bfloat16), _Packable(torch.bfloat16))
    with caplog.at_level(logging.WARNING):
        assert packed_linear.prepack_model(model) == 0
    assert all(m.packed_weight is None for m in model)
    assert not caplog.records
    x = torch.randn(4, 16).to(torch.bfloat16)
    torch.testing.assert_close(packed_linear.linear(x, model[0].weight, None, None), x @ model[0].weight.T)


@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="this CPU has no bf16 matmul path in oneDNN")
def test_bf16_weights_packed_where_supported() -> None:
    model = nn.Sequential(_Packable(torch.bfloat16), _Packable(torch.float32))
    assert packed_linear.prepack_model(model) == 1  # float32 weights stay with F.linear
    x = torch.randn(4, 16).to(torch.bfloat16)
    out = packed_linear.linear(x, model[0].weight, None, model[0].packed_weight)
    torch.testing.assert_close(out, x @ model[0].weight.T, rtol=2e-2, atol=2e-2)
