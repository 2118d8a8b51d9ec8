"""The positives' log-sum-exp (``positives="lse"``): flex losses and SupCon's ``L_in``
(``supcon_loss(positives="lse")``) against their formulas written out (Khosla et al. 2020,
eq. 3, as pair loops) in float64 on every backend, values and gradients; near a loss of 0
in float32; 2 and 3 gloo processes; the options it cannot take, refused by name."""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

F64 = torch.float64
TOL = (1e-10, 1e-9)
BACKENDS = [("reference", None), ("dense", None), ("tiled", 4), ("tiled", None)]


def _lse_rows(s: torch.Tensor, den: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``LSE_{den} s - LSE_{pos} s`` of each row, the rows without a positive 0."""
    a = torch.logsumexp(s.masked_fill(~den, float("-inf")), 1)
    p = torch.logsumexp(s.masked_fill(~pos, float("-inf")), 1)
    has = pos.any(1)
    return torch.where(has, a - torch.where(has, p, torch.zeros_like(p)), torch.zeros_like(a))


def _data(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(19, 6, generator=g, dtype=F64),
        "k": torch.randn(23, 6, generator=g, dtype=F64),
        "y": torch.randint(0, 4, (19,), generator=g),
        "ky": torch.randint(0, 4, (23,), generator=g),
        "doc": torch.randint(0, 6, (23,), generator=g),
    }


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend,block", BACKENDS)
def test_flex_two_towers_with_weights_and_exclusions(backend: str, block: Any, reduction: str) -> None:
    d = _data(1)
    q, k = d["x"], d["k"]
    t = 0.4
    a, b = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    got = flashcl.flex_loss(
        a, b, rows={"y": d["y"]}, cols={"ky": d["ky"], "doc": d["doc"]}, positive=lambda u, v: u.y == v.ky,
        exclude=lambda u, v: v.doc == 0, weight=lambda u, v: 1.0 + 0.5 * (v.doc == 1),
        score_mod=lambda s, u, v: s - 0.1, positives="lse", temperature=t, reduction=reduction, backend=backend,
        block_size=block,
    )  # fmt: skip
    a2, b2 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    s = F.normalize(a2, dim=-1) @ F.normalize(b2, dim=-1).T / t - 0.1
    s = s + torch.log(1.0 + 0.5 * (d["doc"] == 1).to(F64))[None, :]
    keep = (d["doc"] != 0)[None, :].expand_as(s)
    pos = (d["y"][:, None] == d["ky"][None, :]) & keep
    rows = _lse_rows(s, keep, pos)
    valid = pos.any(1)
    want = rows if reduction == "none" else rows.sum() / (valid.sum() if reduction == "mean" else 1)
    up = torch.linspace(0.5, 1.5, got.numel(), dtype=F64).reshape(got.shape)
    assert_close(got, want, f"{backend}/{reduction}: value", *TOL)
    g1 = torch.autograd.grad((got * up).sum(), [a, b])
    g2 = torch.autograd.grad((want * up).sum(), [a2, b2])
    for i, (x, w) in enumerate(zip(g1, g2)):
        assert_close(x, w, f"{backend}/{reduction}: gradient {i}", *TOL)


def supcon_in(x: torch.Tensor, y: torch.Tensor, t: float) -> torch.Tensor:
    """SupCon's L_in (Khosla et al. 2020, eq. 3) as pair loops: the mean over the anchors
    with a positive of -log((1/|P(i)|) sum_p exp(s_ip) / sum_{a != i} exp(s_ia))."""
    z = F.normalize(x, dim=-1)
    s = z @ z.T / t
    out = []
    for i in range(len(y)):
        others = [a for a in range(len(y)) if a != i]
        positives = [p for p in others if y[p] == y[i]]
        if not positives:
            continue
        den = torch.stack([torch.exp(s[i, a]) for a in others]).sum()
        mass = torch.stack([torch.exp(s[i, p]) / den for p in positives]).sum() / len(positives)
        out.append(-torch.log(mass))
    return torch.stack(out).mean()


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_supcon_l_in_equals_the_paper(backend: str, block: Any) -> None:
    d = _data(2)
    a, b = d["x"].clone().requires_grad_(True), d["x"].clone().requires_grad_(True)
    got = flashcl.supcon_loss(a, d["y"], positives="lse", temperature=0.3, backend=backend, block_size=block)
    want = supcon_in(b, d["y"], 0.3)
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, b)[0], f"{backend}: gradient", *TOL)
    views = torch.randn(7, 2, 5, dtype=F64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    y7 = torch.tensor([0, 1, 0, 2, 1, 3, 0])
    flat = views.detach().transpose(0, 1).reshape(14, 5).requires_grad_(True)
    got = flashcl.supcon_loss(views, y7, positives="lse", temperature=0.5, backend=backend, block_size=block)
    want = supcon_in(flat, y7.repeat(2), 0.5)
    assert_close(got, want, f"{backend}: views", *TOL)


def test_exact_near_a_loss_of_zero_in_float32() -> None:
    """Positives that hold all the mass: a loss of about 1e-12 keeps its relative precision
    in float32 (LSE_den - LSE_pos would give 0 or a negative number)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(8, 16, generator=g)
    k = q + 1e-3 * torch.randn(8, 16, generator=g)
    want = flashcl.flex_loss(q.double(), k.double(), positives="lse", temperature=0.02, backend="reference")
    assert 0 < float(want) < 1e-9
    for backend in ("dense", "tiled"):
        got = flashcl.flex_loss(q, k, positives="lse", temperature=0.02, backend=backend)
        assert abs(float(got) - float(want)) <= 1e-4 * float(want), (backend, float(got), float(want))


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda x, y: flashcl.flex_loss(x, rows={"y": y}, positive=lambda a, b: (a.y == b.y) * 0.5, positives="lse"),
            "binary positives",
        ),  # fmt: skip
        (
            lambda x, y: flashcl.flex_loss(
                x, rows={"y": y}, positive=lambda a, b: a.y == b.y, positives="lse", include_self=True
            ),
            "include_self",
        ),  # fmt: skip
        (
            lambda x, y: flashcl.flex_loss(
                x, rows={"y": y}, positive=lambda a, b: a.y == b.y, positives="lse", kind="sigmoid"
            ),
            "softmax kind",
        ),  # fmt: skip
        (lambda x, y: flashcl.supcon_loss(x, y, positives="lse", include_self=True), "L_in"),
        (lambda x, y: flashcl.supcon_loss(x, y, positives="lse", ref=x, ref_labels=y), "L_in"),
    ],
)
def test_what_it_cannot_take_is_refused(call: Any, match: str) -> None:
    d = _data(5)
    with pytest.raises(ValueError, match=match):
        call(d["x"], d["y"])


SIZES = {2: [5, 8], 3: [4, 0, 7]}


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    import torch.distributed as dist

    sizes = SIZES[world]
    g = torch.Generator().manual_seed(world)
    x, y = torch.randn(sum(sizes), 5, generator=g, dtype=F64), torch.randint(0, 3, (sum(sizes),), generator=g)
    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = {}
    for strategy in ("all_gather", "ring"):
        for grad_scale in ("sum", "ddp"):
            xx = x[sl].clone().requires_grad_(True)
            loss = flashcl.supcon_loss(
                xx, y[sl], positives="lse", temperature=0.4, backend="tiled", block_size=3,
                process_group=dist.group.WORLD, strategy=strategy, grad_scale=grad_scale,
            )  # fmt: skip
            out[(strategy, grad_scale)] = (loss.detach(), torch.autograd.grad(loss, xx)[0])
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_supcon_l_in_across_processes(world: int, tmp_path: Any) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    g = torch.Generator().manual_seed(world)
    x, y = torch.randn(sum(sizes), 5, generator=g, dtype=F64), torch.randint(0, 3, (sum(sizes),), generator=g)
    xx = x.clone().requires_grad_(True)
    want = supcon_in(xx, y, 0.4)
    want_grad = torch.autograd.grad(want, xx)[0]
    for key in ranks[0]:
        scale = world if key[1] == "ddp" else 1
        assert_close(sum(r[key][0] for r in ranks) / scale, want, f"{key}: value", *TOL)
        for r in range(world):
            sl = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
            assert_close(ranks[r][key][1] / scale, want_grad[sl], f"{key}: rank {r} gradient", *TOL)
