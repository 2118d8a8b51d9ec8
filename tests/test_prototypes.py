"""The engine's self-distillation over prototypes (losses/prototype_targets.py), one process,
float64, against the formulas as DINOv2 writes them on the whole rows x K logits:
Sinkhorn-Knopp (its order of normalisations, 0 to 5 iterations) and the centred
softmax targets, the cross-entropy with the student's log-softmax, every gradient of
the student's rows and prototypes; blocks of prototypes of 1, 7 and K; rows and
prototypes normalised or as given."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashcl.losses import prototype_targets as prototypes
from flashcl.losses.prototype_loss import prototype_cross_entropy
from flashcl.losses.prototype_targets import (
    Prototypes,
    RowsJoin,
    logit_sums,
    paired_targets,
    sinkhorn_targets,
    softmax_targets,
    unit_rows,
)
from helpers import assert_close

TOL = (1e-12, 1e-10)


def sinkhorn_as_dinov2(teacher_output: torch.Tensor, teacher_temp: float, n_iterations: int) -> torch.Tensor:
    """DINOv2's sinkhorn_knopp_teacher on one process, written out (K x B, then back)."""
    q = torch.exp(teacher_output / teacher_temp).t()
    b, k = q.shape[1], q.shape[0]
    q = q / q.sum()
    for _ in range(n_iterations):
        q = q / q.sum(dim=1, keepdim=True) / k
        q = q / q.sum(dim=0, keepdim=True) / b
    return (q * b).t()


def _data(b: int = 11, k: int = 19, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(b, d), r(k, d), r(b, d), r(k, d), r(k)


@pytest.mark.parametrize("block", [1, 7, 19])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(
    "targets",
    ["sinkhorn-0", "sinkhorn-3", "sinkhorn-5", "sinkhorn-3-logs", "softmax", "softmax-centred", "softmax-logs"],
)
def test_fused_loss_equals_the_dense_formula(block: int, normalize: bool, targets: str, monkeypatch) -> None:
    """Per row (blocks of prototypes, recomputed in the backward). ``-logs``: every sum a
    logsumexp, as for logits wider than the exponent's range."""
    if targets.endswith("-logs"):
        monkeypatch.setitem(prototypes.EXP_RANGE, torch.float64, 0.0)
    x, w, y, wt, center = _data()
    ts, tt = 0.1, 0.04 if normalize else 0.5
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    xs, ws = (F.normalize(v, dim=1) for v in leaves) if normalize else leaves
    ys, wts = (F.normalize(y, dim=1), F.normalize(wt, dim=1)) if normalize else (y, wt)
    t = ys @ wts.T
    if targets.startswith("sinkhorn"):
        p = sinkhorn_as_dinov2(t, tt, int(targets.split("-")[1]))
    else:
        c = center if targets == "softmax-centred" else torch.zeros_like(center)
        p = F.softmax((t - c) / tt, dim=-1)
    want = -(p * F.log_softmax(xs @ ws.T / ts, dim=-1)).sum(-1)
    up = torch.arange(1.0, want.numel() + 1, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, leaves, up)

    mine = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    yh, _ = unit_rows(y, normalize)
    teacher = Prototypes(wt, normalize)
    if targets.startswith("sinkhorn"):
        fn = sinkhorn_targets(yh, teacher, 1.0 / tt, int(targets.split("-")[1]), block)
    else:
        fn = softmax_targets(yh, teacher, center if targets == "softmax-centred" else None, 1.0 / tt, block)
    got = prototype_cross_entropy(*mine, fn, 1.0 / ts, normalize, rows_block=block)
    assert_close(got, want.detach(), f"{targets}: rows", *TOL)
    for a, e, name in zip(torch.autograd.grad(got, mine, up), want_grads, ("rows", "prototypes")):
        assert_close(a, e, f"{targets}: {name}' gradient", *TOL)
    # the targets themselves, block by block
    blocks = [
        fn.rows(r0, min(r0 + block, 11), torch.empty(min(block, 11 - r0), 19, dtype=torch.float64))
        for r0 in range(0, 11, block)
    ]
    assert_close(torch.cat(blocks), p, "targets", *TOL)
    assert_close(logit_sums(yh, teacher) / yh.shape[0], t.mean(0), "the center", *TOL)


@pytest.mark.parametrize("rows_block", [1, 4, None])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("targets", ["sinkhorn-0", "sinkhorn-3", "softmax-centred", "sinkhorn-3-logs", "softmax-logs"])
def test_weighted_scalar_by_blocks_of_rows_equals_the_dense_formula(
    rows_block, normalize: bool, targets: str, monkeypatch
) -> None:
    """A scalar (row weights given) visits blocks of rows against every prototype and
    forms its gradients in that pass; a second backward (retain_graph) recomputes them
    by blocks of prototypes. Both equal the formula, and so do gradients of the rows or
    of the prototypes alone. ``-logs``: each row shifted by its maximum and every sum a
    logsumexp, as for logits wider than the exponent's range."""
    if targets.endswith("-logs"):
        monkeypatch.setitem(prototypes.EXP_RANGE, torch.float64, 0.0)
    x, w, y, wt, center = _data()
    ts, tt = 0.1, 0.04 if normalize else 0.5
    weights = torch.linspace(0.5, 2.0, 11, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    xs, ws = (F.normalize(v, dim=1) for v in leaves) if normalize else leaves
    ys, wts = (F.normalize(y, dim=1), F.normalize(wt, dim=1)) if normalize else (y, wt)
    t = ys @ wts.T
    if targets.startswith("sinkhorn"):
        p = sinkhorn_as_dinov2(t, tt, int(targets.split("-")[1]))
    else:
        p = F.softmax((t - center) / tt, dim=-1)
    want = (weights * -(p * F.log_softmax(xs @ ws.T / ts, dim=-1)).sum(-1)).sum()
    want_grads = torch.autograd.grad(want, leaves)

    yh, _ = unit_rows(y, normalize)
    teacher = Prototypes(wt, normalize)
    if targets.startswith("sinkhorn"):
        fn = sinkhorn_targets(yh, teacher, 1.0 / tt, int(targets.split("-")[1]), 7)
    else:
        fn = softmax_targets(yh, teacher, center, 1.0 / tt, 7)
    mine = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    got = prototype_cross_entropy(*mine, fn, 1.0 / ts, normalize, weights, rows_block)
    assert_close(got, want.detach(), f"{targets}: the scalar", *TOL)
    got.backward(torch.tensor(3.0, dtype=torch.float64), retain_graph=True)
    for a, e, name in zip(mine, want_grads, ("rows", "prototypes")):
        assert_close(a.grad, 3.0 * e, f"{targets}: {name}' gradient", *TOL)
        a.grad = None
    got.backward()  # recomputed by blocks of prototypes
    for a, e, name in zip(mine, want_grads, ("rows", "prototypes")):
        assert_close(a.grad, e, f"{targets}: {name}' gradient, second backward", *TOL)
    for i in range(2):  # one leaf alone
        alone = [x.clone(), w.clone()]
        alone[i].requires_grad_(True)
        (g,) = torch.autograd.grad(
            prototype_cross_entropy(*alone, fn, 1.0 / ts, normalize, weights, rows_block), alone[i]
        )
        assert_close(g, want_grads[i], f"{targets}: leaf {i} alone", *TOL)


@pytest.mark.parametrize("rows_block", [1, 2, None])
@pytest.mark.parametrize(
    "pairs",
    [
        [[1], [0], [0, 1], [0, 1]],  # DINO's crops: two global views, each against the other, locals against both
        [[], [0, 1], [1], [0, 1]],  # a view with no teacher view (targets of zero), a sum shared by two views
        [[0, 1, 1], [0]],  # a teacher view counted twice
    ],
)
@pytest.mark.parametrize("targets", ["softmax-centred", "sinkhorn-3", "softmax-logs"])
def test_stacked_views_by_blocks_of_images_equal_the_dense_formula(
    rows_block, pairs, targets: str, monkeypatch
) -> None:
    """A scalar over stacked student views visits blocks of images, every view's rows of
    them in one GEMM, each distinct sum of teacher views' targets formed once for the
    views that take it; the value and both gradients equal the formula, and so does the
    recomputation by blocks of prototypes (a second backward)."""
    if targets.endswith("-logs"):
        monkeypatch.setitem(prototypes.EXP_RANGE, torch.float64, 0.0)
    b, k, d, views = 5, 13, 4, len(pairs)
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, w, ys, wt, center = r(views * b, d), r(k, d), r(2, b, d), r(k, d), r(k)
    weights = torch.linspace(0.5, 2.0, views * b, dtype=torch.float64)
    ts, tt = 0.1, 0.04
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    xs, ws = (F.normalize(v, dim=1) for v in leaves)
    t = [F.normalize(y, dim=1) @ F.normalize(wt, dim=1).T for y in ys]
    if targets.startswith("sinkhorn"):
        p = [sinkhorn_as_dinov2(ti, tt, 3) for ti in t]
    else:
        p = [F.softmax((ti - center) / tt, dim=-1) for ti in t]
    summed = torch.cat([sum((p[j] for j in ts_), torch.zeros(b, k, dtype=torch.float64)) for ts_ in pairs])
    want = (weights * -(summed * F.log_softmax(xs @ ws.T / ts, dim=-1)).sum(-1)).sum()
    want_grads = torch.autograd.grad(want, leaves)

    teacher = Prototypes(wt, True)
    per_view = []
    for y in ys:
        yh, _ = unit_rows(y, True)
        if targets.startswith("sinkhorn"):
            per_view.append(sinkhorn_targets(yh, teacher, 1.0 / tt, 3, 7))
        else:
            per_view.append(softmax_targets(yh, teacher, center, 1.0 / tt, 7))
    fn = paired_targets(per_view, pairs, b)
    mine = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    got = prototype_cross_entropy(*mine, fn, 1.0 / ts, True, weights, rows_block)
    assert_close(got, want.detach(), f"{pairs}: the scalar", *TOL)
    got.backward(retain_graph=True)
    for a, e, name in zip(mine, want_grads, ("rows", "prototypes")):
        assert_close(a.grad, e, f"{pairs}: {name}' gradient", *TOL)
        a.grad = None
    got.backward()  # recomputed by blocks of prototypes
    for a, e, name in zip(mine, want_grads, ("rows", "prototypes")):
        assert_close(a.grad, e, f"{pairs}: {name}' gradient, second backward", *TOL)
    assert torch.equal(mine[0].detach(), x) and torch.equal(mine[1].detach(), w)


def koleo_as_dinov2(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """DINOv2's KoLeoLoss, written out: the B x B products, the diagonal at -1, argmax."""
    x = F.normalize(x, eps=eps, p=2, dim=-1)
    dots = x @ x.t()
    dots.view(-1)[:: x.shape[0] + 1].fill_(-1)
    nn = dots.max(dim=1).indices
    return -torch.log(torch.nn.PairwiseDistance(2, eps=eps)(x, x[nn]) + eps).mean()


@pytest.mark.parametrize("tiles", [(1, 1), (3, 5), (64, 64)])
def test_koleo_neighbours_in_tiles_equal_dinov2(tiles) -> None:
    from flashcl.losses.koleo import nearest_neighbours

    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 5, dtype=torch.float64, generator=g)
    x[30] = x[3]  # a duplicate: distance 0, the eps keeps the log finite
    x[31] = 2 * x[7]  # the same direction: a tie of products between 7 and 31's neighbours
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = koleo_as_dinov2(xa)
    unit = F.normalize(xb, eps=1e-8, p=2, dim=-1)
    nn = nearest_neighbours(unit, rows=tiles[0], cols=tiles[1])
    got = -torch.log(torch.nn.PairwiseDistance(2, eps=1e-8)(unit, unit[nn]) + 1e-8).mean()
    assert_close(got, want.detach(), "KoLeo", *TOL)
    assert_close(torch.autograd.grad(got, xb)[0], torch.autograd.grad(want, xa)[0], "KoLeo gradient", *TOL)


class _GlooJoin(RowsJoin):
    """The sums over the rows joined over a gloo group (the engine's hook; the public
    loss's own join belongs to flashcl.parallel)."""

    def lse(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        top = x.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        total = torch.exp(x - top)
        dist.all_reduce(total)
        return top + total.log()

    def total_rows(self, b: int) -> int:
        import torch.distributed as dist

        n = torch.tensor([b])
        dist.all_reduce(n)
        return int(n)


SIZES = {2: [4, 9], 3: [5, 1, 7]}


def _sinkhorn_worker(rank: int, world: int, out_dir: str, logs: bool) -> None:
    import os

    from helpers import close_group, init_gloo

    if logs:  # every sum a logsumexp, as for logits wider than the exponent's range
        prototypes.EXP_RANGE[torch.float64] = 0.0
    init_gloo(rank, world, out_dir)
    x, w, y, wt, _ = _data(b=sum(SIZES[world]), seed=world)
    rows = slice(sum(SIZES[world][:rank]), sum(SIZES[world][: rank + 1]))
    yh = unit_rows(y[rows], True)[0]
    fn = sinkhorn_targets(yh, Prototypes(wt, True), 1 / 0.04, 3, 7, _GlooJoin())
    mine = [x[rows].clone().requires_grad_(True), w.clone().requires_grad_(True)]
    loss = prototype_cross_entropy(*mine, fn, 10.0, True).sum()
    grads = torch.autograd.grad(loss, mine)
    p = fn.rows(0, yh.shape[0], torch.empty(yh.shape[0], 19, dtype=torch.float64))
    torch.save((p, loss.detach(), grads), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world,logs", [(2, False), (3, False), (3, True)])
def test_sinkhorn_across_processes_equals_dinov2_on_the_concatenated_batch(world: int, logs: bool, tmp_path) -> None:
    """Uneven batches (a rank with one row): each rank's targets are its rows of DINOv2's
    Sinkhorn-Knopp on the whole batch; the ranks' summed losses and their rows' gradients
    are one process's, the prototypes' gradients add up to one process's. Both ways of
    summing: in the exponential domain with one shift, and by logsumexps."""
    from helpers import spawn

    spawn(_sinkhorn_worker, args=(world, str(tmp_path), logs), nprocs=world)
    x, w, y, wt, _ = _data(b=sum(SIZES[world]), seed=world)
    p = sinkhorn_as_dinov2(F.normalize(y, dim=1) @ F.normalize(wt, dim=1).T, 0.04, 3)
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    want = -(p * F.log_softmax(F.normalize(leaves[0], dim=1) @ F.normalize(leaves[1], dim=1).T / 0.1, -1)).sum()
    gx, gw = torch.autograd.grad(want, leaves)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    bounds = [sum(SIZES[world][:r]) for r in range(world + 1)]
    assert_close(torch.cat([r[0] for r in ranks]), p, "targets", *TOL)
    assert_close(sum(r[1] for r in ranks), want.detach(), "the summed losses", *TOL)
    assert_close(torch.cat([r[2][0] for r in ranks]), gx, "rows' gradients", *TOL)
    assert_close(sum(r[2][1] for r in ranks), gw, "prototypes' gradients, summed", *TOL)
    assert all(bounds[r + 1] - bounds[r] == r_[0].shape[0] for r, r_ in enumerate(ranks))


def dino_as_lightly(teacher_logits, student_logits, center, teacher_temp, student_temp):
    """lightly's DINOLoss on stacked views' logits, written out: every teacher view
    against every student view but the same crop, the mean over those pairs and the batch."""
    t = F.softmax((torch.stack(teacher_logits) - center) / teacher_temp, dim=-1)
    s = F.log_softmax(torch.stack(student_logits) / student_temp, dim=-1)
    loss = -torch.einsum("tbd,sbd->ts", t, s)
    loss = loss.masked_fill(torch.eye(*loss.shape, dtype=torch.bool), 0.0)  # the same crop left out
    n_terms = loss.numel() - min(loss.shape)
    return loss.sum() / (n_terms * t.shape[1])


@pytest.mark.parametrize("block", [4, 19])
def test_crop_pairs_by_paired_targets_equal_lightly(block: int) -> None:
    """Two global teacher views, two global and two local student views: each student
    view's cross-entropy against the sum of the other crops' teacher targets is
    lightly's DINOLoss (values, every student view's and the prototypes' gradients)."""
    from flashcl.losses.prototype_targets import paired_targets

    g = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b, k, d = 7, 19, 6
    teacher_rows, student_rows, w, wt, center = (
        [r(b, d) for _ in range(2)],
        [r(b, d) for _ in range(4)],
        r(k, d),
        r(k, d),
        r(k),
    )
    leaves = [x.clone().requires_grad_(True) for x in [*student_rows, w]]
    unit = lambda v: F.normalize(v, dim=1)  # noqa: E731
    t_logits = [unit(y) @ unit(wt).T for y in teacher_rows]
    s_logits = [unit(x) @ unit(leaves[-1]).T for x in leaves[:-1]]
    want = dino_as_lightly(t_logits, s_logits, center, 0.04, 0.1)
    want_grads = torch.autograd.grad(want, leaves)

    mine = [x.clone().requires_grad_(True) for x in [*student_rows, w]]
    teacher = Prototypes(wt, True)
    per_view = [softmax_targets(unit_rows(y, True)[0], teacher, center, 1 / 0.04, block) for y in teacher_rows]
    pairs = [[i for i in range(2) if i != j] for j in range(4)]
    stacked = torch.cat(mine[:-1])
    rows = prototype_cross_entropy(stacked, mine[-1], paired_targets(per_view, pairs, b), 10.0, True, rows_block=block)
    total = rows.sum() / (sum(map(len, pairs)) * b)
    mine = [stacked, mine[-1]]
    want_grads = [torch.cat(want_grads[:-1]), want_grads[-1]]
    assert_close(total, want.detach(), "lightly's DINOLoss", *TOL)
    for i, (a, e) in enumerate(zip(torch.autograd.grad(total, mine), want_grads)):
        assert_close(a, e, f"gradient {i}", *TOL)


@pytest.mark.parametrize("targets", ["softmax", "sinkhorn"])
def test_logits_wider_than_float32s_exponent_range_stay_exact(targets: str) -> None:
    """Rows and prototypes as given (``normalize=False``) whose logits span thousands:
    no fixed shift fits float32's exponent, so each row is shifted by its maximum and
    Sinkhorn-Knopp sums by logsumexps; the float32 loss and gradients equal the float64
    formula (log-domain, so that it does not overflow either)."""
    x, w, y, wt, _ = _data()
    x, y = x * 30, y * 30
    ts, tt = 0.1, 0.04
    weights = torch.ones(11, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    t = (y @ wt.T) / tt
    if targets == "softmax":
        p = F.softmax(t, dim=-1)
    else:  # DINOv2's normalisations, in the log domain
        lq = t - torch.logsumexp(t.flatten(), 0)
        for _ in range(3):
            lq = lq - torch.logsumexp(lq, 0, keepdim=True) - math.log(19)
            lq = lq - torch.logsumexp(lq, 1, keepdim=True) - math.log(11)
        p = (lq + math.log(11)).exp()
    want = -(p * F.log_softmax(leaves[0] @ leaves[1].T / ts, dim=-1)).sum()
    want_grads = torch.autograd.grad(want, leaves)
    yh = y.float()
    teacher = Prototypes(wt.float(), False)
    fn = (
        softmax_targets(yh, teacher, None, 1 / tt, 7)
        if targets == "softmax"
        else sinkhorn_targets(yh, teacher, 1 / tt, 3, 7)
    )
    mine = [x.float().requires_grad_(True), w.float().requires_grad_(True)]
    got = prototype_cross_entropy(*mine, fn, 1 / ts, False, weights.float())
    assert torch.isfinite(got), got
    assert_close(got.double(), want.detach(), f"{targets}: the loss", 1e-4, 1e-3)
    got.backward()
    for a, e, name in zip(mine, want_grads, ("rows", "prototypes")):
        assert_close(a.grad.double(), e, f"{targets}: {name}' gradient", 1e-4 * float(e.abs().max()), 1e-3)
