import torch

from attribution.perturbation._regions import reached, read


def test_reached_and_read_agree_with_a_real_convolution() -> None:
    """Perturbing inputs in a span changes exactly the reached outputs, and those read only the read span."""
    torch.manual_seed(0)
    for kernel, stride, padding, dilation, n, span in [
        (3, 2, 1, 1, 13, (4, 7)),
        (5, 3, 2, 2, 17, (0, 2)),
        (1, 1, 0, 1, 5, (4, 5)),
    ]:
        conv = torch.nn.Conv1d(1, 1, kernel, stride, padding, dilation, bias=False).double()
        torch.nn.init.uniform_(conv.weight, 0.5, 1.0)  # positive weights: every read input changes the output
        x = torch.rand(1, 1, n, dtype=torch.float64)
        y = x.clone()
        y[..., span[0] : span[1]] += 1.0
        changed = (conv(x) != conv(y)).flatten().nonzero().flatten().tolist()
        size = conv(x).shape[-1]
        lo, hi = reached(span, kernel, stride, padding, dilation, size)
        assert changed == list(range(lo, hi))
        a, b = read((lo, hi), kernel, stride, padding, dilation)
        assert a <= span[0] and b >= span[1]  # the outputs reached read the whole changed span
        assert (
            b - a - dilation * (kernel - 1) - 1
        ) // stride + 1 == hi - lo  # the read span gives the outputs, no more
