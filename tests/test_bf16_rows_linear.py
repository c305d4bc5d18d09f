"""The bf16 linear layer over a few rows (`omnimtp.runtime.kernels.bf16_rows_linear`): a float64 matmul's values
within bf16 rounding, in both weight layouts it reads (a linear layer's or convolution's [N, K], a transposed
convolution's taps: a transposed view), and each row's output the same bits alone as in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnimtp.runtime.kernels import bf16_rows_linear as rl

pytestmark = pytest.mark.skipif(not rl.available(), reason=f"bf16 rows linear: {rl.unavailable_reason()}")


def _weight(num_out, num_in, transposed, generator):
    """A bf16 weight [N, K]: contiguous, or (transposed) a view of a contiguous [K, N]."""
    if transposed:
        return torch.randn(num_in, num_out, generator=generator).to(torch.bfloat16).t()
    return torch.randn(num_out, num_in, generator=generator).to(torch.bfloat16)


def _float64(x, weight, bias):
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


# K past a register's 32 inputs with a tail, and not; N past the tiles (4 weight rows, 64 columns) and short of
# them; rows past the tiles (6) with every remainder
SHAPES = [(1, 64, 8), (5, 100, 37), (13, 1536, 130), (7, 33, 70), (6, 31, 5), (12, 1024, 64), (17, 7, 3)]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(("rows", "num_in", "num_out"), SHAPES)
def test_bf16_rows_linear_is_a_float64_matmul_within_bf16_rounding(rows, num_in, num_out, transposed):
    generator = torch.Generator().manual_seed(rows * 1000 + num_in)
    weight = _weight(num_out, num_in, transposed, generator)
    x = torch.randn(rows, num_in, generator=generator).to(torch.bfloat16)
    bias = torch.randn(num_out, generator=generator)
    for b in (None, bias):
        out = rl.bf16_rows_linear(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, num_out)
        expected = _float64(x, weight, b)
        # the sum's rounding to bf16 (half a step: at most 2^-8 of the value) and fp32 sums of exact products
        bound = 2**-8 * expected.abs() + num_in * 2**-23 * (x.double().abs() @ weight.double().abs().t() + 1)
        assert bool(((out.double() - expected).abs() <= bound).all())
        # its fp32 sums: within fp32 rounding of the float64 matmul, and rounded to bf16 they are the bf16 output
        sums = rl.bf16_rows_linear(x, weight, b, out_dtype=torch.float32)
        assert sums.dtype == torch.float32 and torch.equal(sums.to(torch.bfloat16), out)
        assert bool(((sums.double() - expected).abs() <= bound - 2**-8 * expected.abs()).all())
        # and within a bf16 step of torch's bf16 matmul
        torch_out = F.linear(x, weight, None if b is None else b.to(torch.bfloat16)).double()
        assert float((out.double() - torch_out).abs().max()) <= 2**-6 * float(expected.abs().max())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_is_the_same_bits_alone_as_in_any_batch(transposed, out_dtype):
    """(fp32 output shows every difference in a sum's order, which a bf16 one rounds away nearly always)"""
    generator = torch.Generator().manual_seed(3)
    weight = _weight(200, 385, transposed, generator)
    bias = torch.randn(200, generator=generator).to(torch.bfloat16)
    x = torch.randn(23, 385, generator=generator).to(torch.bfloat16)

    def run(rows):
        return rl.bf16_rows_linear(rows, weight, bias, out_dtype=out_dtype)

    batched = run(x)
    assert torch.equal(batched, torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])]))
    for order in (torch.arange(22, -1, -1), torch.tensor([5, 0, 17, 9, 9, 22, 1])):
        assert torch.equal(run(x[order]), batched[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(x), batched)  # the threads split columns only
    finally:
        torch.set_num_threads(threads)
    # leading dimensions are rows too; a row's input read where it is (a strided view)
    assert torch.equal(run(x[:22].view(2, 11, 385)), batched[:22].view(2, 11, 200))
    wide = torch.randn(23, 400, generator=generator).to(torch.bfloat16)
    wide[:, :385] = x
    assert torch.equal(run(wide[:, :385]), batched)


def test_inputs_it_does_not_take_are_value_errors():
    weight = torch.randn(8, 16).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_rows_linear"):
        rl.bf16_rows_linear(x.float(), weight)
    with pytest.raises(ValueError, match="bf16_rows_linear"):
        rl.bf16_rows_linear(x[:, :8], weight)
    with pytest.raises(ValueError, match="bf16_rows_linear"):
        rl.bf16_rows_linear(x, weight[None])
    with pytest.raises(ValueError, match="bf16_rows_linear"):  # no stride of 1
        rl.bf16_rows_linear(torch.randn(3, 8).to(torch.bfloat16), torch.randn(16, 16).to(torch.bfloat16)[::2, ::2])
    with pytest.raises(ValueError, match="out_dtype"):
        rl.bf16_rows_linear(x, weight, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="bias"):
        rl.bf16_rows_linear(x, weight, torch.zeros(9))
    assert rl.bf16_rows_linear(x[:0], weight).shape == (0, 8)
