"""The softmax (eq. 4.1) and its Jacobian (eq. 4.2)."""

import torch


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stable softmax, eq. 4.1: a_i = exp(z_i - max z) / sum_j exp(z_j - max z).

    Subtracting the row maximum changes nothing mathematically and keeps exp() finite.
    A row that is entirely -inf (a query that sees no key) returns zeros, not NaN.
    """
    if x.shape[dim] == 0:  # no keys at all: nothing to weigh
        return torch.zeros_like(x)
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)  # all -inf row: keep exp(-inf)=0
    exps = torch.exp(x - row_max)
    total = exps.sum(dim=dim, keepdim=True)
    return exps / total.masked_fill(total == 0, 1.0)


def softmax_jacobian(a: torch.Tensor) -> torch.Tensor:
    """Jacobian of the softmax from its output, eq. 4.2: da_i/dz_j = a_i (delta_ij - a_j).

    a: probabilities [..., L]. Returns [..., L, L] = diag(a) - a a^T.
    """
    if a.dim() < 1:
        raise ValueError("softmax_jacobian needs probabilities of shape [..., L], got a scalar")
    return torch.diag_embed(a) - a.unsqueeze(-1) * a.unsqueeze(-2)
