"""Corners of the newer features where an answer could be silently wrong: each test
here failed before its fix."""
from __future__ import annotations

from typing import Any, Callable, List

import pytest
import torch

import flashcl


def _matryoshka_inputs(b: int, d: int) -> List[torch.Tensor]:
    """Rows whose first coordinates are tiny: the worst case for narrow prefixes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    x[: b // 8, :2] *= 1e-4
    y = torch.randn(b, d, generator=g, dtype=torch.float64)
    y[b // 2: b // 2 + b // 8, :2] *= 1e-4
    return [x, y]


_MATRYOSHKA_LOSSES: List[Any] = [
    ("supcon", lambda x, y, **kw: flashcl.supcon_loss(x, torch.arange(x.shape[0]) % 7, **kw)),
    ("info_nce", lambda x, y, **kw: flashcl.info_nce_loss(x, y, temperature=0.05, **kw)),
    ("clip", lambda x, y, **kw: flashcl.clip_loss(x, y, logit_scale=20.0, **kw)),
]


@pytest.mark.parametrize("dims", [[1, 8], [2, 8], [1, 2, 8, 32]])
@pytest.mark.parametrize("name,fn", _MATRYOSHKA_LOSSES, ids=[n for n, _ in _MATRYOSHKA_LOSSES])
def test_matryoshka_narrow_width_gradient_float32(name: str, fn: Callable[..., torch.Tensor], dims: List[int]
                                                  ) -> None:
    """Every width's gradient in float32 no worse than the dense backend's (a width of
    1 is the sign of a coordinate: its gradient is zero, not float32 noise)."""
    inputs = _matryoshka_inputs(512, 32)

    def grads(dtype: torch.dtype, backend: str) -> torch.Tensor:
        xs = [t.detach().to(dtype).clone().requires_grad_(True) for t in inputs]
        fn(*xs, matryoshka_dims=dims, backend=backend).backward()
        return torch.cat([t.grad for t in xs if t.grad is not None]).double()

    exact = grads(torch.float64, "dense")
    err_dense = float((grads(torch.float32, "dense") - exact).abs().max())
    for backend in ("tiled", "auto"):
        err = float((grads(torch.float32, backend) - exact).abs().max())
        assert err <= err_dense + 1e-6 * float(exact.abs().max()), (backend, err, err_dense)
