"""Small instruments the chapters and the tests share to check claims about attnlib."""

import torch
from torch.overrides import TorchFunctionMode


class CountMatmuls(TorchFunctionMode):
    """Counts the `@` products (torch.matmul) run inside the `with` block, in `.count`."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
        return func(*args, **(kwargs or {}))


def labelled(tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """[1, T, H*Dh] whose entry (t, f) is 100 t + f, so every misplaced feature shows."""
    t = torch.arange(tokens)[:, None]  # [T, 1]
    f = torch.arange(heads * head_dim)[None, :]  # [1, H*Dh]
    return (100 * t + f).float()[None]  # [1, T, H*Dh]


def wrong_split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The classic bug: reshape [B, T, H*Dh] straight to [B, H, T, Dh], with no transpose."""
    batch, tokens, features = x.shape
    return x.reshape(batch, heads, tokens, features // heads)


def assert_heads_in_place(split, x: torch.Tensor, heads: int) -> None:
    """Assert head h of token t holds features h*Dh .. (h+1)*Dh - 1 of token t, for every h, t."""
    parts = split(x, heads)  # [B, H, T, Dh]
    head_dim = x.shape[-1] // heads
    assert parts.shape == (x.shape[0], heads, x.shape[1], head_dim), f"shape {list(parts.shape)}"
    for h in range(heads):
        for t in range(x.shape[1]):
            expected = x[:, t, h * head_dim : (h + 1) * head_dim]  # [B, Dh]
            assert torch.equal(parts[:, h, t], expected), f"head {h}, token {t} is misplaced"
