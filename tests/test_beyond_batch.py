"""Beyond the batch, against code nobody on the project wrote:

* queues: pytorch-metric-learning's ``CrossBatchMemory`` around its ``SupConLoss``
  and ``NTXentLoss`` over several steps with a full queue (flashcl's functions with
  a :class:`flashcl.MemoryBank`, and flashcl's PML adapters inside PML's wrapper);
  lightly's ``NTXentLoss`` with a memory bank; MoCo v2's logits and loss (written
  from Algorithm 1 of He et al. / Chen et al.);
* false negatives: sentence-transformers' ``GISTEmbedLoss`` (its own forward, on
  given embeddings); labels across the two sides against the masked formula;
* debiasing and hard negatives: lightly's ``DCLLoss`` / ``DCLWLoss``; the DCL
  (Chuang et al.) and HCL (Robinson et al.) criteria written from the published
  code's equations, which work in exp space: equal in float64, and flashcl finite
  in float32 where that code overflows;
* bad input: a clear error naming the argument.

lightly is optional (it needs torchvision and Lightning): its tests skip without it.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from flashcl.bench.peers import sentence_transformers_gist
from helpers import assert_close, close_group, spawn

F64 = torch.float64
TOL = (1e-10, 1e-9)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _loss_and_grads(fn: Any, *inputs: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    loss = fn(*leaves)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)]


def _assert_same(
    got: Tuple[torch.Tensor, List[torch.Tensor]],
    expected: Tuple[torch.Tensor, List[torch.Tensor]],
    what: str,
    tol: Tuple[float, float] = TOL,
) -> None:
    assert_close(got[0], expected[0], f"{what}: loss", *tol)
    for i, (a, e) in enumerate(zip(got[1], expected[1])):
        assert_close(a, e, f"{what}: grad of input {i}", *tol)


# ----------------------------------------------------------------------------- queues: PML


def _pml() -> Any:
    return pytest.importorskip("pytorch_metric_learning.losses", reason="pytorch-metric-learning is not installed")


def _steps(n_steps: int, batch: int, dim: int, classes: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, dim, generator=g, dtype=F64), torch.randint(0, classes, (batch,), generator=g))
        for _ in range(n_steps)
    ]


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_memory_bank_supcon_equals_pml_cross_batch_memory(backend: str) -> None:
    # memory 24, batches of 10: full (and wrapping) from the third step on
    pml_losses = _pml()
    theirs = pml_losses.CrossBatchMemory(pml_losses.SupConLoss(temperature=0.1), embedding_size=6, memory_size=24)
    bank = flashcl.MemoryBank(size=24, dim=6, dtype=F64)
    for step, (emb, labels) in enumerate(_steps(7, 10, 6, 4, seed=1)):
        expected = _loss_and_grads(lambda e, lab=labels: theirs(e, lab), emb)

        def ours(e: torch.Tensor, labels: torch.Tensor = labels) -> torch.Tensor:
            slots = bank.push(e, labels)
            keys, key_labels = bank.keys()
            return flashcl.supcon_loss(
                e,
                labels,
                temperature=0.1,
                ref=keys,
                ref_labels=key_labels,
                ref_self=slots,
                backend=backend,
                block_size=4,
            )

        _assert_same(_loss_and_grads(ours, emb), expected, f"step {step}/{backend}")
    assert bank.count == 24


@pytest.mark.parametrize("inner", ["supcon", "ntxent"])
def test_pml_adapters_inside_cross_batch_memory(inner: str) -> None:
    pml_losses = _pml()
    from flashcl.integrations import pytorch_metric_learning as fpml

    make = {"supcon": (lambda m: m.SupConLoss(temperature=0.2)), "ntxent": (lambda m: m.NTXentLoss(temperature=0.3))}
    theirs = pml_losses.CrossBatchMemory(make[inner](pml_losses), embedding_size=5, memory_size=20)
    ours = fpml.CrossBatchMemory(make[inner](fpml), embedding_size=5, memory_size=20)
    ours_plain = pml_losses.CrossBatchMemory(make[inner](fpml), embedding_size=5, memory_size=20)  # PML's wrapper
    for step, (emb, labels) in enumerate(_steps(6, 8, 5, 3, seed=2)):
        expected = _loss_and_grads(lambda e, lab=labels: theirs(e, lab), emb)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to PML's code in flashcl's wrapper
            _assert_same(_loss_and_grads(lambda e, lab=labels: ours(e, lab), emb), expected, f"{inner} step {step}")
        with pytest.warns(UserWarning, match="flashcl's CrossBatchMemory computes the queue"):
            plain = _loss_and_grads(lambda e, lab=labels: ours_plain(e, lab), emb)
        _assert_same(plain, expected, f"{inner} in PML's CrossBatchMemory, step {step}")


# ----------------------------------------------------------------------------- queues: MoCo


def _moco_v2(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, t: float) -> torch.Tensor:
    """MoCo's loss as Algorithm 1 of the paper writes it (queue as (K, C) rows here)."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    l_pos = torch.bmm(q.view(q.shape[0], 1, -1), k.view(k.shape[0], -1, 1)).view(-1, 1)
    l_neg = torch.mm(q, F.normalize(queue, dim=1).t())
    logits = torch.cat([l_pos, l_neg], dim=1) / t
    return F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long))


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_moco_logits_and_loss(backend: str) -> None:
    # the key encoder's output carries no gradient in MoCo; here it does, and must
    # receive the positive's part only (the queue never does)
    q, k, queue = _randn(12, 8, seed=3), _randn(12, 8, seed=4), _randn(40, 8, seed=5)
    expected = _loss_and_grads(lambda a, b: _moco_v2(a, b, queue, 0.2), q, k)
    got = _loss_and_grads(
        lambda a, b: flashcl.info_nce_loss(
            a, b, temperature=0.2, negatives=queue, in_batch_negatives=False, backend=backend, block_size=5
        ),
        q,
        k,
    )
    _assert_same(got, expected, f"MoCo/{backend}")


# ----------------------------------------------------------------------------- lightly


def _lightly() -> Any:
    try:
        from lightly import loss
    except ImportError as e:
        pytest.skip(f"lightly is not importable ({e}); pip install lightly")
    return loss


def _lightly_bank_to_f64(loss_fn: Any) -> None:
    # unit vectors in float64 (lightly draws them in float32)
    loss_fn.memory_bank.bank = F.normalize(loss_fn.memory_bank.bank.to(F64), dim=1)


def test_lightly_ntxent_with_a_memory_bank() -> None:
    lightly = _lightly()
    torch.manual_seed(0)
    # a bank of 4 batches (lightly drops the rows of a batch that pass the bank's
    # end; flashcl wraps them to its start: the same when the size is a multiple)
    theirs = lightly.NTXentLoss(temperature=0.2, memory_bank_size=(32, 6))
    _lightly_bank_to_f64(theirs)
    # flashcl's bank starts from lightly's (random unit vectors)
    bank = flashcl.MemoryBank(size=32, dim=6, labels=False, dtype=F64)
    bank.push(theirs.memory_bank.bank.clone())
    for step in range(7):
        out0, out1 = _randn(8, 6, seed=10 + step), _randn(8, 6, seed=20 + step)
        expected = _loss_and_grads(theirs, out0, out1)  # reads the bank, then enqueues out1

        def ours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = flashcl.info_nce_loss(a, b, temperature=0.2, negatives=bank.keys()[0], in_batch_negatives=False)
            bank.push(F.normalize(b, dim=1))
            return loss

        _assert_same(_loss_and_grads(ours, out0, out1), expected, f"lightly NTXent + memory bank, step {step}")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
def test_lightly_dcl_and_dclw(weighted: bool, backend: str) -> None:
    lightly = _lightly()
    z1, z2 = _randn(9, 6, seed=6), _randn(9, 6, seed=7)
    theirs = lightly.DCLWLoss(temperature=0.3, sigma=0.4) if weighted else lightly.DCLLoss(temperature=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lightly's torch.tensor(tensor) copy warning
        expected = _loss_and_grads(theirs, z1, z2)
    kw: Dict[str, Any] = dict(weighting="vmf", sigma=0.4) if weighted else {}
    got = _loss_and_grads(
        lambda a, b: flashcl.nt_xent_loss(a, b, temperature=0.3, decoupled=True, backend=backend, block_size=4, **kw),
        z1,
        z2,
    )
    _assert_same(got, expected, f"lightly {'DCLW' if weighted else 'DCL'}/{backend}")


# ----------------------------------------------------------------------------- DCL / HCL criteria


def _published_criterion(
    out_1: torch.Tensor, out_2: torch.Tensor, tau_plus: float, beta: Optional[float], temperature: float
) -> torch.Tensor:
    """The debiased (Chuang et al., 2020; ``beta=None``) and hard-negative (Robinson
    et al., 2021) criteria as their published training code computes them: in exp
    space, negatives by a mask, Ng clamped at N e^{-1/t}. Written here from those
    equations (neither is packaged)."""
    b = out_1.shape[0]
    out_1, out_2 = F.normalize(out_1, dim=1), F.normalize(out_2, dim=1)
    out = torch.cat([out_1, out_2], dim=0)
    neg = torch.exp(torch.mm(out, out.t()) / temperature)
    mask = torch.ones(2 * b, 2 * b, dtype=torch.bool)
    idx = torch.arange(b)
    mask[idx, idx] = mask[idx, idx + b] = mask[idx + b, idx] = mask[idx + b, idx + b] = False
    neg = neg.masked_select(mask).view(2 * b, -1)
    pos = torch.exp(torch.sum(out_1 * out_2, dim=-1) / temperature)
    pos = torch.cat([pos, pos], dim=0)
    n = 2 * b - 2
    if beta is None:
        ng = (-tau_plus * n * pos + neg.sum(dim=-1)) / (1 - tau_plus)
    else:
        imp = (beta * neg.log()).exp()
        reweight_neg = (imp * neg).sum(dim=-1) / imp.mean(dim=-1)
        ng = (-tau_plus * n * pos + reweight_neg) / (1 - tau_plus)
    ng = torch.clamp(ng, min=n * torch.e ** (-1 / temperature))
    return (-torch.log(pos / (pos + ng))).mean()


ESTIMATORS = [("debiased", None, 0.1), ("hard", 1.0, 0.1), ("hard", 0.5, 0.0), ("hard", 2.0, 0.3)]


@pytest.mark.parametrize("estimator,beta,tau_plus", ESTIMATORS)
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_debiased_and_hard_estimators_equal_the_published_criteria(
    estimator: str, beta: Optional[float], tau_plus: float, backend: str
) -> None:
    z1, z2 = _randn(10, 6, seed=8), _randn(10, 6, seed=9)
    z2 = z2 + 2.0 * z1  # positives closer than the negatives, as in training
    for t in (0.5, 0.1):
        expected = _loss_and_grads(lambda a, b, t=t: _published_criterion(a, b, tau_plus, beta, t), z1, z2)
        got = _loss_and_grads(
            lambda a, b, t=t: flashcl.nt_xent_loss(
                a,
                b,
                temperature=t,
                estimator=estimator,
                tau_plus=tau_plus,
                beta=beta or 0.0,
                backend=backend,
                block_size=4,
            ),
            z1,
            z2,
        )
        _assert_same(got, expected, f"{estimator} beta={beta} tau+={tau_plus} t={t}/{backend}")


def test_the_clamp_floor_is_reached() -> None:
    # large tau_plus: the corrected negative mass goes below the floor for some rows;
    # the floor is a constant (no gradient through it), as in the published code
    z1 = _randn(6, 4, seed=11)
    z2 = z1 + 0.01 * _randn(6, 4, seed=12)
    expected = _loss_and_grads(lambda a, b: _published_criterion(a, b, 0.9, None, 0.5), z1, z2)
    got = _loss_and_grads(
        lambda a, b: flashcl.nt_xent_loss(
            a, b, temperature=0.5, estimator="debiased", tau_plus=0.9, backend="tiled", block_size=4
        ),
        z1,
        z2,
    )
    _assert_same(got, expected, "debiased at the floor")


@pytest.mark.parametrize("estimator,beta", [("debiased", None), ("hard", 1.0)])
def test_estimators_finite_in_float32_where_exp_space_overflows(estimator: str, beta: Optional[float]) -> None:
    # temperature 0.01: exp(s / t) reaches e^100 (float32 overflows beyond e^88.7)
    z1 = _randn(16, 8, seed=13)
    z2 = z1 + 0.05 * _randn(16, 8, seed=14)
    published32 = _published_criterion(z1.float(), z2.float(), 0.1, beta, 0.01)
    assert not torch.isfinite(published32), "the exp-space criterion was expected to overflow in float32"
    expected = _loss_and_grads(lambda a, b: _published_criterion(a, b, 0.1, beta, 0.01), z1, z2)
    assert torch.isfinite(expected[0])
    for backend in ("dense", "tiled"):
        got = _loss_and_grads(
            lambda a, b, be=backend: flashcl.nt_xent_loss(
                a, b, temperature=0.01, estimator=estimator, tau_plus=0.1, beta=beta or 0.0, backend=be, block_size=4
            ),
            z1.float(),
            z2.float(),
        )
        assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
        assert_close(got[0], expected[0], f"{estimator}/{backend} float32 loss", 1e-4, 1e-4)
        for a, e in zip(got[1], expected[1]):
            assert_close(a, e, f"{estimator}/{backend} float32 grad", 1e-4 * float(e.abs().max()) + 1e-6, 1e-3)


# ----------------------------------------------------------------------------- labels across sides


def _masked_info_nce(
    q: torch.Tensor, k: torch.Tensor, index: torch.Tensor, ql: torch.Tensor, kl: torch.Tensor, t: float, duplicates: str
) -> torch.Tensor:
    """The formula with an explicit B x N mask."""
    s = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / t
    same = ql.unsqueeze(1) == kl.unsqueeze(0)
    if duplicates == "mask":
        out = same.clone()
        out[torch.arange(q.shape[0]), index] = False
        return (torch.logsumexp(s.masked_fill(out, float("-inf")), 1) - s[torch.arange(q.shape[0]), index]).mean()
    pos = (s * same).sum(1) / same.sum(1)
    return (torch.logsumexp(s, 1) - pos).mean()


@pytest.mark.parametrize("duplicates", ["mask", "positive"])
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_labels_across_the_two_sides(duplicates: str, backend: str) -> None:
    g = torch.Generator().manual_seed(15)
    kl = torch.randint(0, 4, (14,), generator=g)
    index = torch.randint(0, 14, (9,), generator=g)
    ql = kl[index]
    q, k = _randn(9, 5, seed=16), _randn(14, 5, seed=17)
    expected = _loss_and_grads(lambda a, b: _masked_info_nce(a, b, index, ql, kl, 0.2, duplicates), q, k)
    got = _loss_and_grads(
        lambda a, b: flashcl.info_nce_loss(
            a,
            b,
            index,
            temperature=0.2,
            query_labels=ql,
            key_labels=kl,
            duplicates=duplicates,
            backend=backend,
            block_size=4,
        ),
        q,
        k,
    )
    _assert_same(got, expected, f"duplicates={duplicates}/{backend}")


# ----------------------------------------------------------------------------- GIST


def _st_gist(embeddings: List[torch.Tensor], guides: List[torch.Tensor], **config: Any) -> torch.Tensor:
    """sentence-transformers' GISTEmbedLoss.forward on given embeddings (its model
    passes replaced by the tensors; the loss's own masking and cross-entropy run)."""
    fn, why = sentence_transformers_gist(**config)
    if fn is None:
        pytest.skip(why)
    return fn(embeddings, guides)


GIST_CONFIGS: List[Dict[str, Any]] = [
    {},
    {"temperature": 0.05, "margin": 0.1},
    {"temperature": 0.02, "margin": 0.1, "margin_strategy": "relative"},
    {"contrast_anchors": False},
    {"contrast_positives": False, "margin": -0.2},
    {"contrast_anchors": False, "contrast_positives": False},
]


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("config", GIST_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_gist_equals_sentence_transformers(config: Dict[str, Any], negative: bool, backend: str) -> None:
    b = 12
    a, p, n = _randn(b, 16, seed=20), _randn(b, 16, seed=21), _randn(b, 16, seed=22)
    p = p + a
    ga, gn = _randn(b, 8, seed=23), _randn(b, 8, seed=24)
    gp = ga + 0.8 * _randn(b, 8, seed=25)
    ga[3] = 2.0 * gp[5] + 0.05 * _randn(8, seed=26)  # anchor 3 a paraphrase of positive 5 (no exact tie)
    gn[1] = ga[1] + 0.1 * _randn(8, seed=27)  # a hard negative that the guide flags
    columns = [a, p] + ([n] if negative else [])
    guides = [ga, gp] + ([gn] if negative else [])
    expected = _loss_and_grads(lambda *e: _st_gist(list(e), guides, **config), *columns)
    got = _loss_and_grads(
        lambda *e: flashcl.gist_loss(*e, guide=tuple(guides), backend=backend, block_size=5, **config), *columns
    )
    _assert_same(got, expected, f"GIST {config} negative={negative}/{backend}")


def test_gist_masks_something_here() -> None:
    # the data above exercise the filter: without the guide (a guide that flags
    # nothing) the loss differs
    a, p = _randn(12, 16, seed=20), _randn(12, 16, seed=21)
    ga = _randn(12, 8, seed=23)
    gp = ga + 0.8 * _randn(12, 8, seed=25)
    # (at temperature 0.05: at 0.01 the positive's term dwarfs what the guide removes)
    guided = flashcl.gist_loss(a, a + p, guide=(ga, gp), temperature=0.05)
    nothing = flashcl.gist_loss(a, a + p, guide=(ga, gp), margin=-10.0, temperature=0.05)  # every threshold above 1
    assert abs(float(guided) - float(nothing)) > 1e-3


def test_gist_float32_at_its_default_temperature() -> None:
    # temperature 0.01: scores up to 100 in float32
    a, p = _randn(40, 16, seed=30), _randn(40, 16, seed=31)
    ga, gp = _randn(40, 8, seed=32), _randn(40, 8, seed=33)
    expected = flashcl.gist_loss(a, p, guide=(ga, gp), backend="reference")
    for backend in ("dense", "tiled"):
        got = flashcl.gist_loss(a.float(), p.float(), guide=(ga.float(), gp.float()), backend=backend, block_size=7)
        assert_close(got, expected, f"GIST float32/{backend}", 1e-4, 1e-5)


# ----------------------------------------------------------------------------- MemoryBank


def test_memory_bank_fifo() -> None:
    bank = flashcl.MemoryBank(size=5, dim=2, dtype=F64)
    rows = torch.arange(16, dtype=F64).view(8, 2)
    slots = bank.push(rows[:3], torch.arange(3))
    assert slots.tolist() == [0, 1, 2] and bank.keys()[0].shape == (3, 2)
    slots = bank.push(rows[3:7], torch.arange(3, 7))
    assert slots.tolist() == [3, 4, 0, 1]
    keys, labels = bank.keys()
    assert keys.shape == (5, 2)
    # the last five rows pushed, whatever their slots
    assert sorted(labels.tolist()) == [2, 3, 4, 5, 6]
    for j in range(5):
        assert torch.equal(keys[j], rows[int(labels[j])])
    bank.reset()
    assert bank.keys()[0].shape == (0, 2)


def test_memory_bank_stores_no_gradient_and_never_aliases_the_input() -> None:
    bank = flashcl.MemoryBank(size=4, dim=3)
    x = torch.randn(2, 3, requires_grad=True)
    bank.push(x, torch.tensor([0, 1]))
    keys, _ = bank.keys()
    assert not keys.requires_grad
    with torch.no_grad():
        x.add_(1.0)
    assert not torch.equal(keys[:2], x.detach()), "the bank must hold a copy"


def _bank_worker(rank: int, world: int, out_dir: str, sizes: List[int]) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    bank = flashcl.MemoryBank(size=32, dim=3, dtype=F64)
    slots_by_step = []
    for step in range(3):
        rows = torch.full((sizes[rank], 3), float(100 * step + 10 * rank), dtype=F64)
        rows[:, 1] = torch.arange(sizes[rank], dtype=F64)
        slots_by_step.append(bank.push(rows, torch.full((sizes[rank],), rank)))
    torch.save({"keys": bank.keys(), "slots": slots_by_step}, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("sizes", [[3, 5], [2, 4, 1]])
def test_memory_bank_enqueues_the_global_batch_in_rank_order(sizes: List[int], tmp_path: Any) -> None:
    world = len(sizes)
    spawn(_bank_worker, args=(world, str(tmp_path), sizes), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # the global batch of each step, rank after rank, written oldest slot first
    expected = []
    for step in range(3):
        for r, n in enumerate(sizes):
            for i in range(n):
                expected.append([100.0 * step + 10 * r, float(i), 100.0 * step + 10 * r])
    total = len(expected)
    for r, res in enumerate(ranks):
        keys, labels = res["keys"]
        assert torch.equal(keys, ranks[0]["keys"][0]) and torch.equal(labels, ranks[0]["keys"][1])
        assert keys.shape[0] == min(32, total)
        assert torch.equal(keys[:total], torch.tensor(expected, dtype=F64)[:32])
        for step, slots in enumerate(res["slots"]):
            first = step * sum(sizes) + sum(sizes[:r])
            assert slots.tolist() == [(first + i) % 32 for i in range(sizes[r])], (r, step)


# ----------------------------------------------------------------------------- bad input

E, L = _randn(6, 4, seed=40), torch.tensor([0, 1, 0, 1, 2, 2])
BAD: Dict[str, Tuple[Any, type, str]] = {
    "ref of another width": (
        lambda: flashcl.supcon_loss(E, L, ref=_randn(5, 3, seed=1), ref_labels=L[:5]),
        ValueError,
        "ref must be 4 wide",
    ),
    "ref without its labels": (lambda: flashcl.supcon_loss(E, L, ref=_randn(5, 4, seed=1)), ValueError, "ref_labels"),
    "ref_labels without ref": (lambda: flashcl.supcon_loss(E, L, ref_labels=L), ValueError, "need ref"),
    "ref_self out of range": (
        lambda: flashcl.supcon_loss(E, L, ref=E, ref_labels=L, ref_self=torch.tensor([0, 1, 2, 3, 4, 6])),
        ValueError,
        "ref_self",
    ),
    "ref of another dtype": (lambda: flashcl.supcon_loss(E, L, ref=E.float(), ref_labels=L), TypeError, "ref must"),
    "negatives of another width": (
        lambda: flashcl.info_nce_loss(E, E, negatives=_randn(7, 5, seed=2)),
        ValueError,
        "negatives must be 4 wide",
    ),
    "query_labels alone": (lambda: flashcl.info_nce_loss(E, E, query_labels=L), ValueError, "key_labels"),
    "positive of another label": (
        lambda: flashcl.info_nce_loss(E, E, query_labels=L, key_labels=L.flip(0)),
        ValueError,
        "positive key must share",
    ),
    "MoCo without a queue": (
        lambda: flashcl.info_nce_loss(E, E, in_batch_negatives=False),
        ValueError,
        "pass negatives",
    ),
    "bank of negative size": (lambda: flashcl.MemoryBank(size=-4, dim=3), ValueError, "size must be a positive"),
    "bank of zero width": (lambda: flashcl.MemoryBank(size=4, dim=0), ValueError, "dim must be a positive"),
    "push of another width": (
        lambda: flashcl.MemoryBank(size=8, dim=3).push(E, L),
        ValueError,
        "embeddings must be 3 wide",
    ),
    "push without labels": (lambda: flashcl.MemoryBank(size=8, dim=4).push(E), ValueError, "labels is None"),
    "push too large": (lambda: flashcl.MemoryBank(size=4, dim=4).push(E, L), ValueError, "does not fit"),
    "tau_plus out of range": (
        lambda: flashcl.nt_xent_loss(E, E, estimator="debiased", tau_plus=1.0),
        ValueError,
        "tau_plus",
    ),
    "negative beta": (lambda: flashcl.nt_xent_loss(E, E, estimator="hard", beta=-1.0), ValueError, "beta"),
    "estimator name": (lambda: flashcl.nt_xent_loss(E, E, estimator="biased"), ValueError, "estimator"),
    "vmf without decoupled": (lambda: flashcl.nt_xent_loss(E, E, weighting="vmf"), ValueError, "decoupled=True"),
    "guide of another length": (lambda: flashcl.gist_loss(E, E, guide=(E, E[:5])), ValueError, r"guide\[1\]"),
    "guide missing the negatives": (lambda: flashcl.gist_loss(E, E, E, guide=(E, E)), ValueError, "guide must hold"),
    "gist on triton": (lambda: flashcl.gist_loss(E, E, guide=(E, E), backend="triton"), ValueError, "tiled"),
    "margin strategy": (
        lambda: flashcl.gist_loss(E, E, guide=(E, E), margin_strategy="percent"),
        ValueError,
        "margin_strategy",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_names_the_argument(name: str) -> None:
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call()


def test_auto_never_picks_the_kernels_for_masks_computed_from_the_data(monkeypatch: Any) -> None:
    # on CUDA "auto" would pick the Triton kernels, which take no such masks: the
    # losses must tell resolve that their head has no kernel
    from flashcl import backends

    seen: List[Optional[str]] = []
    original = backends.resolve

    def spy(
        backend: str,
        entries: int,
        device: torch.device,
        dtype: torch.dtype,
        width: int = 0,
        kernel: Optional[str] = "softmax",
    ) -> str:
        seen.append(kernel)
        return original(backend, entries, device, dtype, width, kernel)

    monkeypatch.setattr(backends, "resolve", spy)
    q, k = _randn(6, 4, seed=50), _randn(6, 4, seed=51)
    labels = torch.tensor([0, 1, 0, 2, 1, 2])
    calls = [
        lambda: flashcl.info_nce_loss(q, k, query_labels=labels, key_labels=labels),
        lambda: flashcl.info_nce_loss(q, k, query_labels=labels, key_labels=labels, negatives=_randn(5, 4, seed=52)),
        lambda: flashcl.gist_loss(q, k, guide=(q, k)),
        lambda: flashcl.nt_xent_loss(q, k, estimator="hard"),
    ]
    for call in calls:
        seen.clear()
        call()
        assert seen and all(kernel is None for kernel in seen), seen
    seen.clear()
    flashcl.info_nce_loss(q, k, query_labels=labels, key_labels=labels, duplicates="positive")
    assert seen == ["softmax"]
