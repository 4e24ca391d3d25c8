import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import softmax, softmax_jacobian


def test_matches_float64_reference_for_huge_scores():
    z = torch.tensor([[1000.0, 1001.0, 999.0], [-1e4, 0.0, 1e4]])
    expected = torch.exp(z.double() - z.double().max(-1, keepdim=True).values)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.isnan(torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)).any()  # naive fails
    assert torch.allclose(softmax(z).double(), expected, atol=1e-7)


def test_all_masked_row_is_zeros_not_nan():
    z = torch.tensor([[float("-inf")] * 4, [0.0, float("-inf"), 1.0, float("-inf")]])
    a = softmax(z)
    assert torch.equal(a[0], torch.zeros(4))
    assert torch.isnan(torch.softmax(z, -1)[0]).all()  # what torch itself returns
    assert torch.allclose(a[1], torch.softmax(z[1], -1))


def test_six_token_weights():
    from attnlib import SIX_TOKENS

    weights = softmax(SIX_TOKENS @ SIX_TOKENS[1])
    expected = torch.tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    assert torch.allclose(weights, expected, atol=5e-5)
    assert torch.allclose(weights @ SIX_TOKENS, torch.tensor([0.4419, 0.6515, 0.5683]), atol=5e-5)


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 7),
    temperature=st.floats(0.01, 30.0),
    seed=st.integers(0, 2**16),
    dim=st.sampled_from([0, 1]),
)
def test_jacobian_equals_autograd(length, temperature, seed, dim):
    z = torch.randn(3, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = z * temperature
    z = z if dim == 1 else z.T.contiguous()
    for row in range(3):
        vector = z[row] if dim == 1 else z[:, row]
        expected = torch.autograd.functional.jacobian(lambda t: softmax(t), vector)
        got = softmax_jacobian(softmax(vector))
        assert torch.allclose(got, expected, atol=1e-12)
        assert torch.allclose(got, got.T)  # symmetric
        assert torch.allclose(got.sum(-1), torch.zeros(length, dtype=torch.float64), atol=1e-12)


def test_jacobian_batched_shape():
    a = softmax(torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0)))
    assert softmax_jacobian(a).shape == (2, 5, 4, 4)
    assert torch.allclose(
        softmax_jacobian(a)[1, 3], torch.diag(a[1, 3]) - torch.outer(a[1, 3], a[1, 3])
    )
