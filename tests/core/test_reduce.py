"""bin_sum: per-bin sums added in row order (the reproducible replacement for CUDA's atomic index_add_)."""
import torch

from gearlab.core.reduce import bin_sum


def _in_row_order(values, index, n):
    out = [torch.zeros((), dtype=values.dtype) for _ in range(n)]
    for v, k in zip(values, index.tolist()):
        out[k] = out[k] + v  # one rounding per addition, left to right
    return torch.stack(out)


def test_sums_are_the_row_order_sums_bit_for_bit():
    """Magnitudes spread over 12 decades make a float32 sum depend on its order: the result is the left-to-right
    sum of each bin, exactly, in float32 and float64."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        values = (torch.randn(600, generator=g) * 10.0 ** torch.randint(-6, 6, (600,), generator=g)).to(dtype)
        index = torch.randint(0, 7, (600,), generator=g)
        got = bin_sum(values, index, 9)
        assert got.dtype == dtype and got.shape == (9,)
        assert torch.equal(got, _in_row_order(values, index, 9))
        assert (got[7:] == 0).all()  # bins nobody points at stay 0
        reordered = bin_sum(values.flip(0), index.flip(0), 9)
        assert not torch.equal(reordered, got)  # the order matters at these magnitudes, so the test can fail


def test_gradient_flows_to_every_value():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    bin_sum(values, torch.tensor([1, 0, 1, 1]), 2).mul(torch.tensor([10.0, 100.0])).sum().backward()
    assert values.grad.tolist() == [100.0, 10.0, 100.0, 100.0]
