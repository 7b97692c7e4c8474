"""The Hadamard transform's butterflies: two buffers without autograd, new tensors with it."""

from __future__ import annotations

import torch

from llmpress.transforms.hadamard import Rotation, _butterflies


def test_the_butterflies_give_the_same_bits_with_and_without_autograd():
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    kept = x.clone()
    fast = _butterflies(x, 6)
    tracked = x.clone().requires_grad_(True)
    slow = _butterflies(tracked, 6)
    assert torch.equal(fast, slow.detach()) and torch.equal(x, kept)  # the input is left as it was
    slow.sum().backward()
    assert tracked.grad is not None and tracked.grad.abs().sum() > 0
    assert torch.equal(_butterflies(x, 0), x)


def test_a_rotation_by_butterflies_is_the_dense_sylvester_matrix():
    rotation = Rotation(64)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(6):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    torch.testing.assert_close(rotation.matrix(), h / 8, rtol=0, atol=1e-15)
    rows = torch.randn(7, 64, dtype=torch.float32)
    torch.testing.assert_close(rotation.rows(rows), rows @ (h / 8).float(), rtol=1e-5, atol=1e-5)
