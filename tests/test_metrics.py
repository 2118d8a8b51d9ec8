"""flashcl.metrics against Wang & Isola (2020)'s align_loss / uniform_loss (their
code: a pdist over every pair) and a dense argsort for the retrieval metrics; on
one process and across 2 gloo processes."""

from __future__ import annotations

import datetime
import os
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashcl import metrics
from helpers import assert_close, close_group, spawn

TOL = (1e-10, 1e-9)


def align_loss(x: torch.Tensor, y: torch.Tensor, alpha: float = 2) -> torch.Tensor:  # Wang & Isola's code
    return (x - y).norm(p=2, dim=1).pow(alpha).mean()


def uniform_loss(x: torch.Tensor, t: float = 2) -> torch.Tensor:  # Wang & Isola's code
    return torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log()


@pytest.mark.parametrize("t", [0.5, 2.0, 7.0])
@pytest.mark.parametrize("normalized", [True, False])
@pytest.mark.parametrize("block_size", [None, 5])
def test_uniformity_equals_pdist_form(t: float, normalized: bool, block_size: Optional[int]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 6, dtype=torch.float64, generator=g)
    x = (F.normalize(x, dim=1) if normalized else 0.5 * x).requires_grad_(True)
    got = metrics.uniformity(x, t, block_size=block_size)
    want = uniform_loss(x, t)
    assert_close(got, want, "value", *TOL)
    assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0], "gradient", *TOL)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 3.5])
def test_alignment_equals_their_code(alpha: float) -> None:
    g = torch.Generator().manual_seed(1)
    x = F.normalize(torch.randn(9, 4, dtype=torch.float64, generator=g), dim=1).requires_grad_(True)
    y = F.normalize(torch.randn(9, 4, dtype=torch.float64, generator=g), dim=1)
    got, want = metrics.alignment(x, y, alpha), align_loss(x, y, alpha)
    assert_close(got, want, "value", *TOL)
    assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0], "gradient", *TOL)


def _dense_retrieval(s, relevant, topk) -> Dict[str, float]:
    """Every query's keys sorted by score ``s`` (ties: relevant keys first): the first relevant's rank."""
    hits = {kk: 0 for kk in topk}
    rr, n = 0.0, 0
    for i in range(s.shape[0]):
        if not relevant[i].any():
            continue
        order = sorted(range(s.shape[1]), key=lambda j: (-float(s[i, j]), not bool(relevant[i, j])))
        rank = 1 + next(pos for pos, j in enumerate(order) if relevant[i, j])
        n += 1
        rr += 1.0 / rank
        for kk in topk:
            hits[kk] += rank <= kk
    out = {f"top{kk}": hits[kk] / max(n, 1) for kk in topk}
    out["mrr"], out["queries"] = rr / max(n, 1), float(n)
    return out


def _ints(n: int, d: int, seed: int) -> torch.Tensor:
    """Small integer rows: many tied scores."""
    return torch.randint(-1, 2, (n, d), generator=torch.Generator().manual_seed(seed)).double()


def test_retrieval_with_positive_index_and_ties() -> None:
    q, k = _ints(30, 3, 0), _ints(40, 3, 1)
    pos = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(2))
    relevant = torch.zeros(30, 40, dtype=torch.bool)
    relevant[torch.arange(30), pos] = True
    got = metrics.retrieval(q, k, pos, topk=(1, 3, 10), normalize=False, block_size=7)
    assert got == pytest.approx(_dense_retrieval(q @ k.T, relevant, (1, 3, 10)))


def test_retrieval_with_labels_and_the_query_itself_left_out() -> None:
    x = _ints(25, 3, 3)
    labels = torch.randint(0, 6, (25,), generator=torch.Generator().manual_seed(4))
    relevant = (labels.unsqueeze(1) == labels.unsqueeze(0)) & ~torch.eye(25, dtype=torch.bool)
    got = metrics.retrieval(x, x, labels=labels, key_labels=labels, topk=(1, 5), normalize=False, block_size=4)
    s = x @ x.T
    s.fill_diagonal_(float("-inf"))  # the query itself: below every key, and not relevant
    assert got == pytest.approx(_dense_retrieval(s, relevant, (1, 5)))


@pytest.mark.parametrize("where", ["query", "relevant key", "other key", "every row", "inf"])
@pytest.mark.parametrize("normalize", [True, False])
def test_retrieval_with_nan_scores_is_nan_never_perfect(where: str, normalize: bool) -> None:
    """A NaN score of a counted query (NaN in it or in a key it is scored against)
    makes every metric NaN: no comparison with NaN is true, so it would rank first."""
    q = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    k = q + 0.01 * torch.randn(6, 4, generator=torch.Generator().manual_seed(6))
    assert metrics.retrieval(q, k, topk=(1,))["top1"] == 1.0
    q, k = q.clone(), k.clone()
    if where == "query":
        q[2, 1] = float("nan")
    elif where == "relevant key":
        k[2] = float("nan")
    elif where == "other key":
        k[4, 0] = float("nan")
    elif where == "inf":
        q[2, 1] = float("inf")
    else:
        q[:] = float("nan")
    got = metrics.retrieval(q, k, topk=(1, 5), normalize=normalize, block_size=4)
    if where == "inf" and not normalize:  # an inf score is a score: the key ranks first or last
        assert not any(v != v for v in got.values())
        return
    assert all(got[name] != got[name] for name in ("top1", "top5", "mrr")), got
    assert got["queries"] == 6.0


def test_retrieval_nan_query_left_out_changes_nothing() -> None:
    """With labels, a query without any relevant key is left out of the means: its
    NaN changes nothing."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(7, 4, generator=g), torch.randn(9, 4, generator=g)
    labels, key_labels = torch.tensor([0, 0, 1, 1, 2, 2, 3]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0])
    want = metrics.retrieval(q, k, labels=labels, key_labels=key_labels, topk=(1, 3))
    q_nan = torch.cat([q, torch.full((1, 4), float("nan"))])
    got = metrics.retrieval(q_nan, k, labels=torch.cat([labels, torch.tensor([9])]), key_labels=key_labels, topk=(1, 3))
    assert got == want and want["top1"] == want["top1"]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: metrics.retrieval(torch.randn(4, 3), torch.randn(4, 3), topk=(1, 5)), "topk"),
        (lambda: metrics.retrieval(torch.randn(4, 3), torch.randn(4, 3), topk=(0,)), "topk"),
        (lambda: metrics.retrieval(torch.randn(4, 3), torch.randn(4, 3), labels=torch.arange(4)), "key_labels"),
        (
            lambda: metrics.retrieval(
                torch.randn(4, 3),
                torch.randn(4, 3),
                labels=torch.zeros(4, 2, dtype=torch.long),
                key_labels=torch.arange(4),
            ),
            "labels",
        ),
        (lambda: metrics.uniformity(torch.randn(1, 3)), "2 rows"),
        (lambda: metrics.uniformity(torch.randn(4, 3), t=0.0), "t must"),
        (lambda: metrics.alignment(torch.randn(4, 3), torch.randn(5, 3)), "shape"),
    ],
)
def test_bad_input_is_a_clear_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


SIZES = [7, 4]


def _data():
    g = torch.Generator().manual_seed(5)
    n = sum(SIZES)
    return (
        F.normalize(torch.randn(n, 5, dtype=torch.float64, generator=g), dim=1),
        F.normalize(torch.randn(n, 5, dtype=torch.float64, generator=g), dim=1),
        torch.randint(0, 3, (n,), generator=g),
    )


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    x, y, labels = _data()
    start = sum(SIZES[:rank])
    sl = slice(start, start + SIZES[rank])
    xl = x[sl].clone().requires_grad_(True)
    group = dist.group.WORLD
    u = metrics.uniformity(xl, 2.0, process_group=group, block_size=3)
    a = metrics.alignment(xl, y[sl], process_group=group)
    out: List = [u.detach(), torch.autograd.grad(u, xl)[0], a.detach(), torch.autograd.grad(a, xl)[0]]
    out.append(metrics.retrieval(x[sl], y[sl], topk=(1, 3), process_group=group))
    out.append(
        metrics.retrieval(x[sl], y[sl], labels=labels[sl], key_labels=labels[sl], topk=(1, 3), process_group=group)
    )
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_across_processes_equals_one_process(tmp_path) -> None:
    world = len(SIZES)
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    x, y, labels = _data()
    x = x.clone().requires_grad_(True)
    u, a = uniform_loss(x), align_loss(x, y)
    gu, ga = torch.autograd.grad(u, x)[0], torch.autograd.grad(a, x)[0]
    top = metrics.retrieval(x, y, topk=(1, 3))
    top_labels = metrics.retrieval(x, y, labels=labels, key_labels=labels, topk=(1, 3))
    for r in range(world):
        sl = slice(sum(SIZES[:r]), sum(SIZES[: r + 1]))
        assert_close(ranks[r][0], u, f"rank {r}: uniformity", *TOL)
        assert_close(ranks[r][1], world * gu[sl], f"rank {r}: uniformity grad (ddp convention)", *TOL)
        assert_close(ranks[r][2], a, f"rank {r}: alignment", *TOL)
        assert_close(ranks[r][3], world * ga[sl], f"rank {r}: alignment grad (ddp convention)", *TOL)
        assert ranks[r][4] == pytest.approx(top)
        assert ranks[r][5] == pytest.approx(top_labels)
