from contextlib import nullcontext

import pytest
import torch

import profkit


@pytest.mark.parametrize("precision", [None, "fp32", "float32", torch.float32])
def test_full_precision_is_a_null_context(precision):
    assert isinstance(profkit.autocast(precision, "cpu"), nullcontext)


@pytest.mark.parametrize("precision", ["bf16", "BF16", "bfloat16", torch.bfloat16])
def test_bf16_autocasts_matmuls(precision):
    x = torch.randn(4, 4)
    with profkit.autocast(precision, "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    assert (x @ x).dtype == torch.float32


def test_device_given_as_torch_device():
    with profkit.autocast("bf16", torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_fp16_dtype_and_bad_names():
    assert profkit.autocast_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="precision='fp8'"):
        profkit.autocast("fp8", "cpu")
    with pytest.raises(ValueError, match="precision=torch.int8"):
        profkit.autocast(torch.int8, "cpu")
