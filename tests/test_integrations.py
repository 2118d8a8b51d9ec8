"""The drop-in adapters against the originals they replace."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from flashcl.integrations.pytorch_metric_learning import NTXentLoss, SupConLoss

pml_losses = pytest.importorskip("pytorch_metric_learning.losses", reason="pytorch-metric-learning not installed")


@pytest.mark.parametrize("b,classes,block", [(40, 5, 7), (33, 3, 100), (20, 20, 1), (16, 2, 5)])
@pytest.mark.parametrize("name", ["NTXentLoss", "SupConLoss"])
def test_pml_call_convention_equals_pml(name: str, b: int, classes: int, block: int) -> None:
    g = torch.Generator().manual_seed(b + classes)
    emb = torch.randn(b, 8, dtype=torch.float64, generator=g)
    labels = torch.randint(0, classes, (b,), generator=g)
    e1, e2 = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    expected = getattr(pml_losses, name)(temperature=0.1)(e1, labels)
    (expected * 1.7).backward()
    ours = NTXentLoss(temperature=0.1, block_size=block) if name == "NTXentLoss" else SupConLoss(temperature=0.1)
    got = ours(e2, labels)
    (got * 1.7).backward()
    assert_close(got, expected, f"{name} vs PML", 1e-10, 1e-10)
    assert_close(e2.grad, e1.grad, f"{name} grad vs PML", 1e-10, 1e-10)


def test_pml_ntxent_without_any_pair_is_zero() -> None:
    emb = torch.randn(5, 3, requires_grad=True)
    loss = NTXentLoss()(emb, torch.arange(5))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(emb.grad, torch.zeros_like(emb))


def test_miners_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="indices_tuple"):
        NTXentLoss()(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), indices_tuple=(torch.tensor([0]),) * 4)
