"""Late interaction's building blocks: maxsim_scores (every query against every
document, or each query against its own documents) and maxsim_distill_loss (pylate's
Distillation: KL from the teacher's softmax to the student's MaxSim softmax) on every
backend against the token-score einsum, with masks, ties, half precision, bad inputs
and 2 processes."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

BACKENDS = ("reference", "dense", "tiled")


def kd_scores(q: torch.Tensor, d: torch.Tensor, qmask, dmask, smooth: Optional[float] = None) -> torch.Tensor:
    """Each query against its own documents as the peers write it (``colbert_kd_scores``'
    einsum), padding document tokens at -inf, padding query tokens zeroed."""
    s = torch.einsum("ash,abth->abst", q, d)
    if dmask is not None:
        s = s.masked_fill(~dmask[:, :, None, :], float("-inf"))
    m = s.amax(3) if smooth is None else smooth * torch.logsumexp(s / smooth, dim=3)
    if qmask is not None:
        m = m * qmask[:, None, :].to(m.dtype)
    return m.sum(2)


def kd_loss(q, d, teacher, qmask, dmask, t=1.0, tt=1.0, normalize=False, smooth=None, reduction="mean"):
    s = kd_scores(q, d, qmask, dmask, smooth)
    if normalize:
        s = s / qmask.sum(1, keepdim=True).to(s.dtype)
    kl = F.kl_div(F.log_softmax(s / t, 1), F.log_softmax(teacher / tt, 1), log_target=True, reduction="none").sum(1)
    return {"mean": kl.mean(), "sum": kl.sum(), "none": kl}[reduction]


def _data(b: int = 3, n: int = 4, lq: int = 4, ld: int = 6, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, dim, dtype=torch.float64, generator=g)
    d = torch.randn(b, n, ld, dim, dtype=torch.float64, generator=g)
    teacher = 3 * torch.randn(b, n, dtype=torch.float64, generator=g)
    qmask = torch.arange(lq) < torch.randint(1, lq + 1, (b, 1), generator=g)
    dmask = torch.arange(ld) < torch.randint(1, ld + 1, (b, n, 1), generator=g)
    return q, d, teacher, qmask, dmask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smooth", [None, 0.3])
@pytest.mark.parametrize("paired", [True, False], ids=["own-documents", "every-document"])
def test_scores_equal_the_token_score_einsum(backend: str, smooth: Optional[float], paired: bool) -> None:
    q, d, _, qmask, dmask = _data()
    if not paired:  # every query against the 5 documents of the first two queries' candidates
        d, dmask = d.reshape(-1, *d.shape[2:])[:5], dmask.reshape(-1, dmask.shape[-1])[:5]
    leaves = [q.clone().requires_grad_(), d.clone().requires_grad_()]
    if paired:
        want = kd_scores(*leaves, qmask, dmask, smooth)
    else:
        want = kd_scores(leaves[0], leaves[1].expand(3, *d.shape), qmask, dmask.expand(3, *dmask.shape), smooth)
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    got = flashcl.maxsim_scores(
        *mine, query_mask=qmask, doc_mask=dmask, smooth_max=smooth, backend=backend, block_size=2
    )
    assert got.shape == want.shape
    assert_close(got, want, "scores", 1e-12, 1e-10)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for a, b, name in zip(torch.autograd.grad(got, mine, w), torch.autograd.grad(want, leaves, w), "qd"):
        assert_close(a, b, f"grad {name}", 1e-12, 1e-10)


OPTIONS = [
    {},
    {"temperature": 0.5, "teacher_temperature": 2.0},
    {"normalize_scores": True},
    {"smooth_max": 0.3},
    {"reduction": "sum"},
    {"reduction": "none"},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_distill_equals_kl_of_the_einsum_scores(backend: str, options: Dict[str, Any]) -> None:
    q, d, teacher, qmask, dmask = _data()
    t = torch.tensor(options.get("temperature", 1.0), dtype=torch.float64)
    leaves = [q.clone().requires_grad_(), d.clone().requires_grad_(), teacher.clone().requires_grad_()]
    leaves.append(t.clone().requires_grad_())
    want = kd_loss(
        *leaves[:3],
        qmask,
        dmask,
        leaves[3],
        options.get("teacher_temperature", 1.0),
        options.get("normalize_scores", False),
        options.get("smooth_max"),
        options.get("reduction", "mean"),
    )
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    kwargs = {k: v for k, v in options.items() if k != "temperature"}
    got = flashcl.maxsim_distill_loss(
        *mine[:3], query_mask=qmask, doc_mask=dmask, temperature=mine[3], backend=backend, block_size=2, **kwargs
    )
    assert_close(got, want, "value", 1e-12, 1e-10)
    out = torch.ones_like(want)
    for a, b, name in zip(torch.autograd.grad(got, mine, out), torch.autograd.grad(want, leaves, out), "qdTt"):
        assert_close(a, b, f"grad {name}", 1e-12, 1e-10)


def test_distill_module_half_precision_one_query_one_candidate_and_inputs_kept() -> None:
    q, d, teacher, qmask, dmask = _data(b=1, n=1)
    got = flashcl.MaxSimDistillLoss(backend="tiled")(q, d, teacher, qmask, dmask)
    assert float(got) == 0.0  # one candidate: both softmaxes are 1
    q, d, teacher, qmask, dmask = _data(b=4, n=5, dim=16)
    copies = [x.clone() for x in (q, d, teacher, qmask, dmask)]
    want = kd_loss(q, d, teacher, qmask, dmask, 0.5)
    mod = flashcl.MaxSimDistillLoss(temperature=0.5, backend="tiled")(q, d, teacher, qmask, dmask)
    assert_close(mod, want, "module", 1e-12, 1e-10)
    for a, b in zip((q, d, teacher, qmask, dmask), copies):
        assert torch.equal(a, b)
    for dtype, tol in ((torch.float16, 5e-3), (torch.bfloat16, 3e-2)):
        qh, dh = q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
        got = flashcl.maxsim_distill_loss(qh, dh, teacher, query_mask=qmask, doc_mask=dmask, temperature=0.5)
        assert got.dtype == torch.float32
        assert_close(got, want, f"{dtype}", tol, tol)
        got.backward()
        assert qh.grad.dtype == dtype and torch.isfinite(dh.grad.float()).all()


def test_paired_tiles_hold_nan_padding_and_give_ties_equal_shares() -> None:
    q, d, teacher, qmask, dmask = _data(b=2, n=3)
    want = kd_loss(q.requires_grad_(), d.requires_grad_(), teacher, qmask, dmask)
    gq, gd = torch.autograd.grad(want, (q, d))
    q2, d2 = q.detach().clone(), d.detach().clone()
    q2[~qmask], d2[~dmask] = float("nan"), float("inf")
    q2.requires_grad_()
    d2.requires_grad_()
    got = flashcl.maxsim_distill_loss(q2, d2, teacher, query_mask=qmask, doc_mask=dmask, backend="tiled")
    got.backward()
    assert_close(got, want, "value", 1e-12, 1e-10)
    assert_close(d2.grad[dmask], gd[dmask], "real tokens' grad", 1e-12, 1e-10)
    assert float(q2.grad[~qmask].abs().max()) == 0.0 and float(d2.grad[~dmask].abs().max()) == 0.0
    # a tie: two identical document tokens share the gradient equally
    d3 = d.detach().clone()
    d3[:, :, 1] = d3[:, :, 0]
    d3 = d3.requires_grad_()
    flashcl.maxsim_scores(q.detach(), d3, backend="tiled").sum().backward()
    assert_close(d3.grad[:, :, 0], d3.grad[:, :, 1], "equal shares", 0.0, 0.0)


BAD = [
    ("teacher_scores must have shape", lambda q, d, t: flashcl.maxsim_distill_loss(q, d, t[:, :2]), ValueError),
    ("own documents", lambda q, d, t: flashcl.maxsim_distill_loss(q[:2], d, t[:2]), ValueError),
    ("docs", lambda q, d, t: flashcl.maxsim_distill_loss(q, d[0], t), ValueError),
    ("no real token", lambda q, d, t: flashcl.maxsim_scores(q, d, doc_mask=torch.zeros(d.shape[:3])), ValueError),
    ("doc_mask must have shape", lambda q, d, t: flashcl.maxsim_scores(q, d, doc_mask=torch.ones(3, 4)), ValueError),
    ("Triton", lambda q, d, t: flashcl.maxsim_scores(q, d, backend="triton"), ValueError),
    ("Triton", lambda q, d, t: flashcl.maxsim_distill_loss(q, d, t, backend="triton"), ValueError),
    ("teacher_temperature", lambda q, d, t: flashcl.maxsim_distill_loss(q, d, t, teacher_temperature=0), ValueError),
    ("block_size", lambda q, d, t: flashcl.maxsim_scores(q, d, block_size=0), ValueError),
    ("floating", lambda q, d, t: flashcl.maxsim_distill_loss(q, d, t.long()), TypeError),
]


def test_paired_blocks_second_derivatives_equal_the_einsum() -> None:
    """A Hessian-vector product through each query's own documents, block by block
    (create_graph=True through the checkpointed blocks), against the einsum's."""
    q, d, teacher, qmask, dmask = _data()
    v = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    hvps = []
    for loss_of in (
        lambda x: flashcl.maxsim_distill_loss(
            x, d, teacher, query_mask=qmask, doc_mask=dmask, smooth_max=0.3, backend="tiled", block_size=2
        ),
        lambda x: kd_loss(x, d, teacher, qmask, dmask, smooth=0.3),
    ):
        x = q.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss_of(x), x, create_graph=True)
        hvps.append(torch.autograd.grad((g * v).sum(), x)[0])
    assert_close(hvps[0], hvps[1], "Hessian-vector product", 1e-10, 1e-8)


@pytest.mark.parametrize("match, call, error", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_inputs_are_clear_errors(match: str, call: Any, error: type) -> None:
    q, d, t, _, _ = _data()
    with pytest.raises(error, match=match):
        call(q, d, t)


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    q, d, teacher, qmask, dmask = _data(b=5, seed=world)
    rows = [slice(0, 2), slice(2, 5)] if world == 2 else [slice(0, 2), slice(2, 3), slice(3, 5)]
    r = rows[rank]
    qq, dd = q[r].clone().requires_grad_(), d[r].clone().requires_grad_()
    loss = flashcl.maxsim_distill_loss(
        qq, dd, teacher[r], query_mask=qmask[r], doc_mask=dmask[r], process_group=dist.group.WORLD, grad_scale="sum"
    )
    loss.backward()
    torch.save((loss.detach(), qq.grad, dd.grad, (r.start, r.stop)), os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_distill_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    q, d, teacher, qmask, dmask = _data(b=5, seed=world)
    q.requires_grad_()
    d.requires_grad_()
    want = kd_loss(q, d, teacher, qmask, dmask)
    gq, gd = torch.autograd.grad(want, (q, d))
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(world):
        value, grad_q, grad_d, (start, stop) = torch.load(tmp_path / f"rank{rank}.pt")
        r = slice(start, stop)
        total = total + value  # each rank's share of the global mean
        assert_close(grad_q, gq[r], f"rank {rank}: query grad", 1e-12, 1e-10)
        assert_close(grad_d, gd[r], f"rank {rank}: docs grad", 1e-12, 1e-10)
    assert_close(total, want, "the global mean", 1e-12, 1e-10)


def _ruled_out_oracle(q, d, teacher, qmask, dmask, t, tt):
    """KL per query written from the formula: the teacher's softmax over its candidates
    with a finite score, the student's log-softmax over every candidate, the ruled-out
    candidates' target probability 0 (``0 log 0 = 0``)."""
    s = kd_scores(q, d, qmask, dmask) / t
    rows = []
    for i in range(s.shape[0]):
        keep = torch.isfinite(teacher[i])
        p = torch.softmax(teacher[i, keep] / tt, 0)
        rows.append((p * (torch.log(p) - torch.log_softmax(s[i], 0)[keep])).sum())
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_teacher_score_of_minus_inf_is_a_candidate_of_probability_zero(backend: str, reduction: str) -> None:
    q, d, teacher, qmask, dmask = _data(b=3, n=4)
    teacher = teacher.clone()
    teacher[0, 1] = teacher[2, 0] = teacher[2, 3] = float("-inf")  # ruled out, or a ragged list's padding
    tt = torch.tensor(2.0, dtype=torch.float64)
    leaves = [q.clone().requires_grad_(), d.clone().requires_grad_(), teacher.clone().requires_grad_()]
    leaves.append(tt.clone().requires_grad_())
    rows = _ruled_out_oracle(*leaves[:3], qmask, dmask, 0.5, leaves[3])
    want = {"mean": rows.mean(), "sum": rows.sum(), "none": rows}[reduction]
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    got = flashcl.maxsim_distill_loss(
        *mine[:3],
        query_mask=qmask,
        doc_mask=dmask,
        temperature=0.5,
        teacher_temperature=mine[3],
        reduction=reduction,
        backend=backend,
        block_size=2,
    )
    assert_close(got, want, "value", 1e-12, 1e-10)
    up = torch.arange(1.0, want.numel() + 1, dtype=torch.float64).view(want.shape)  # non-uniform for "none"
    grads = torch.autograd.grad(got, mine, up)
    for a, b, name in zip(grads, torch.autograd.grad(want, leaves, up), ("query", "docs", "teacher", "tt")):
        assert bool(torch.isfinite(a).all()), name
        assert_close(a, torch.nan_to_num(b), f"grad {name}", 1e-12, 1e-10)
    assert float(grads[2][0, 1]) == 0.0 and float(grads[2][2, 3]) == 0.0
    # NaN in the teacher stays NaN; a row ruled out everywhere is a clear error
    nan = teacher.clone()
    nan[1, 2] = float("nan")
    bad = flashcl.maxsim_distill_loss(q, d, nan, reduction="none", backend=backend)
    assert bool(bad[1].isnan()) and bool(torch.isfinite(bad[[0, 2]]).all())
    teacher[1] = float("-inf")
    with pytest.raises(ValueError, match="row 1 is -inf for every candidate"):
        flashcl.maxsim_distill_loss(q, d, teacher, backend=backend)
