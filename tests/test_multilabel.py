"""Multi-label SupCon ((B, C) multi-hot labels) against the MultiSupConLoss formula of
pytorch-metric-learning pull request #667, written out here from the PR's code (its
Jaccard matrix, its masks, its AvgNonZeroReducer), with and without a queue; every
backend; across 2 gloo processes on both strategies."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from helpers import assert_close, close_group, spawn

TOL = (1e-10, 1e-9)
BACKENDS = ["reference", "dense", "tiled"]


def pr667(emb, labels, temperature=0.1, threshold=0.3, ref_emb=None, ref_labels=None, reduce=True):
    """MultiSupConLoss (PR #667): cosine similarities over the temperature; positives
    J > threshold (the anchor itself left out when the references contain the batch
    first), negatives the rest; -(sum_p J log_prob) / |P| per anchor; the mean over the
    anchors whose loss is not zero."""
    ref_emb = emb if ref_emb is None else torch.cat([emb, ref_emb])
    ref_labels = labels if ref_labels is None else torch.cat([labels, ref_labels])
    y1, y2 = labels.double(), ref_labels.double()
    inter = y1 @ y2.T
    jac = inter / (y1.sum(1, keepdim=True) + y2.sum(1).unsqueeze(0) - inter)
    matches = (jac > threshold).long()
    diffs = matches ^ 1
    eye = torch.zeros_like(matches, dtype=torch.bool)
    eye[torch.arange(len(emb)), torch.arange(len(emb))] = True
    matches[eye] = 0  # the anchor itself (in the PR: fill_diagonal_, or the queue's self comparisons removed)
    mat = F.normalize(emb, dim=1) @ F.normalize(ref_emb, dim=1).T / temperature
    matches, diffs = matches.to(mat.dtype), diffs.to(mat.dtype)  # the PR's masks are float (zeros_like(mat))
    keep = (matches + diffs).bool()
    denominator = torch.logsumexp(mat.masked_fill(~keep, float("-inf")), dim=1, keepdim=True)
    log_prob = mat - denominator
    mean_log_prob_pos = (jac * log_prob * matches).sum(1) / (matches.sum(1) + torch.finfo(mat.dtype).tiny)
    losses = -mean_log_prob_pos
    if not reduce:
        return losses
    nonzero = losses != 0
    return losses[nonzero].mean() if nonzero.any() else losses.sum() * 0


def _data(b: int = 14, c: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(b, c, generator=g) < 0.4).long()
    y[torch.arange(b), torch.randint(0, c, (b,), generator=g)] = 1  # no empty set
    return torch.randn(b, 6, dtype=torch.float64, generator=g), y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6])
def test_equals_the_pr_formula(backend: str, threshold: float) -> None:
    emb, y = _data()
    emb.requires_grad_(True)
    t = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    got = flashcl.supcon_loss(emb, y, temperature=t, overlap_threshold=threshold, backend=backend, block_size=4)
    want = pr667(emb, y, t, threshold)
    assert_close(got, want, f"{backend}: value", *TOL)
    for a, b, name in zip(torch.autograd.grad(got, [emb, t]), torch.autograd.grad(want, [emb, t]), ["emb", "t"]):
        assert_close(a, b, f"{backend}: grad {name}", *TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_queue_equals_the_pr_formula(backend: str) -> None:
    emb, y = _data(10, 4, 1)
    ref, y_ref = _data(7, 4, 2)
    emb.requires_grad_(True)
    got = flashcl.supcon_loss(emb, y.bool(), ref=ref, ref_labels=y_ref, backend=backend, block_size=3)
    want = pr667(emb, y, ref_emb=ref, ref_labels=y_ref)
    assert_close(got, want, f"{backend}: value", *TOL)
    assert_close(torch.autograd.grad(got, emb)[0], torch.autograd.grad(want, emb)[0], f"{backend}: grad", *TOL)


def test_reductions_views_and_module() -> None:
    emb, y = _data(8, 3, 3)
    rows = flashcl.supcon_loss(emb, y, reduction="none", backend="tiled")
    assert_close(rows, pr667(emb, y, reduce=False), "per-anchor losses", *TOL)
    views = torch.stack([emb, emb.flip(1)], 1)
    flat = torch.cat([emb, emb.flip(1)])
    assert_close(flashcl.supcon_loss(views, y, backend="tiled"), pr667(flat, y.repeat(2, 1)), "two views", *TOL)
    assert_close(
        flashcl.SupConLoss(overlap_threshold=0.5)(emb, y),
        flashcl.supcon_loss(emb, y, overlap_threshold=0.5),
        "module",
        *TOL,
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.zeros(4, 2, 2)), "labels"),
        (lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.full((4, 2), 2)), "multi-hot"),
        (lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.tensor([[0], [1], [1], [0]])), "squeeze"),
        (lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.eye(4), overlap_threshold=1.0), "overlap_threshold"),
        (lambda: flashcl.supcon_loss(torch.randn(4, 3), torch.arange(4), overlap_threshold=0.5), "multi-hot"),
        (lambda: flashcl.supcon_loss(torch.randn(4, 4), torch.eye(4), matryoshka_dims=[2, 4]), "matryoshka"),
        (
            lambda: flashcl.supcon_loss(
                torch.randn(4, 3), torch.eye(4), ref=torch.randn(2, 3), ref_labels=torch.eye(2, 3)
            ),
            "classes",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


SIZES = [6, 3]


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    emb, y = _data(sum(SIZES), 4, 4)
    ref, y_ref = _data(5, 4, 5)
    start = sum(SIZES[:rank])
    out = []
    for strategy in ("all_gather", "ring"):
        for queue in (None, ref):
            x = emb[start : start + SIZES[rank]].clone().requires_grad_(True)
            loss = flashcl.supcon_loss(
                x,
                y[start : start + SIZES[rank]],
                ref=queue,
                ref_labels=None if queue is None else y_ref,
                process_group=dist.group.WORLD,
                strategy=strategy,
                grad_scale="sum",
            )
            out += [loss.detach(), torch.autograd.grad(loss, x)[0]]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_across_processes_equals_one_process(tmp_path) -> None:
    world = len(SIZES)
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    emb, y = _data(sum(SIZES), 4, 4)
    ref, y_ref = _data(5, 4, 5)
    i = 0
    for strategy in ("all_gather", "ring"):
        for queue in (None, ref):
            x = emb.clone().requires_grad_(True)
            want = pr667(x, y, ref_emb=queue, ref_labels=None if queue is None else y_ref)
            grad = torch.autograd.grad(want, x)[0]
            assert_close(sum(r[i] for r in ranks), want, f"{strategy} queue={queue is not None}: value", *TOL)
            assert_close(torch.cat([r[i + 1] for r in ranks]), grad, f"{strategy}: grad", *TOL)
            i += 2


def test_a_memory_bank_of_label_sets_is_the_queue() -> None:
    bank = flashcl.MemoryBank(size=16, dim=6, labels=4, dtype=torch.float64)
    old, y_old = _data(9, 4, 6)
    bank.push(old, y_old)
    emb, y = _data(7, 4, 7)
    keys, key_labels = bank.keys()
    assert key_labels.dtype == torch.bool and key_labels.shape == (9, 4)
    got = flashcl.supcon_loss(emb, y, ref=keys, ref_labels=key_labels, backend="tiled")
    assert_close(got, pr667(emb, y, ref_emb=old, ref_labels=y_old), "bank as queue", *TOL)
    restored = flashcl.MemoryBank(size=16, dim=6, labels=4, dtype=torch.float64)
    restored.load_state_dict(bank.state_dict())
    assert restored.keys()[1].equal(key_labels)
    with pytest.raises(ValueError, match="multi-hot"):
        bank.push(emb, torch.full((7, 4), 2))
    with pytest.raises(ValueError, match=r"\(7, 4\)"):
        bank.push(emb, y[:, :3])
    with pytest.raises(ValueError, match="classes"):
        flashcl.MemoryBank(size=4, dim=2, labels=1)
