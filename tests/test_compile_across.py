"""torch.compile around the losses called with ``process_group=`` on 2 gloo processes: every
loss that takes a process group traces whole (``fullgraph=True``), for each strategy and
``grad_scale`` it takes, and gives the eager call's value and gradients on every rank (a
combination the loss refuses eagerly raises the same error compiled); a second step does
not recompile; a DistributedDataParallel step compiled whole equals the eager step; a
call that differs across the ranks raises on every rank, compiled as eagerly."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import flashcl
from flashcl.compiled import LOSSES
from helpers import assert_close, close_group, init_gloo, spawn

AOT = "aot_eager"  # dynamo + AOTAutograd, without inductor's code generation
TOL = (1e-12, 1e-10)  # float64: the same eager computation runs inside the operator
SIZES = (5, 8)  # the ranks' batch rows (uneven)

Case = Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]


def _cases(rank: int, kw: Dict[str, Any]) -> Dict[str, Case]:
    """name -> (a call of one loss with ``kw`` (its process group and options), its
    differentiable inputs): this rank's rows, the tensors every rank holds alike (class
    weights, prototypes, proxies) from one seed."""
    b = SIZES[rank]
    g = torch.Generator().manual_seed(10 + rank)
    shared = torch.Generator().manual_seed(0)

    def rand(*shape: int, gen: torch.Generator = g) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    emb, views, labels = rand(b, 6), rand(b, 6), torch.randint(0, 3, (b,), generator=g)
    keys, pos = rand(2 * b, 6), torch.arange(b) * 2
    classes, prototypes = rand(4, 6, gen=shared), rand(5, 6, gen=shared)
    t = torch.tensor(0.4, dtype=torch.float64)
    n = sum(SIZES)  # the score matrix is (n, n); each rank holds its rows
    scores, nb = rand(b, n), torch.randint(0, n, (b, 2), generator=g)
    query, docs = rand(b, 3, 6), rand(b, 4, 6)
    candidates, teacher = rand(b, 2, 4, 6), rand(b, 2)
    scored = torch.rand(b, dtype=torch.float64, generator=g)
    only = {k: v for k, v in kw.items() if k != "strategy"}  # the losses without a strategy
    return {
        "supcon_loss": (lambda e, tt: flashcl.supcon_loss(e, labels, temperature=tt, **kw), [emb, t]),
        "nt_xent_loss": (lambda a, v, tt: flashcl.nt_xent_loss(a, v, temperature=tt, **kw), [emb, views, t]),
        "info_nce_loss": (lambda q, k, tt: flashcl.info_nce_loss(q, k, pos, temperature=tt, **kw), [emb, keys, t]),
        "clip_loss": (lambda a, v, tt: flashcl.clip_loss(a, v, 1.0 / tt, **kw), [emb, views, t]),
        "siglip_loss": (lambda a, v, tt: flashcl.siglip_loss(a, v, 1.0 / tt, -1.0, **kw), [emb, views, t]),
        "gist_loss": (
            lambda a, p: flashcl.gist_loss(a, p, guide=(emb[:, :4] + 0.3 * views[:, :4], views[:, :4]), **kw),
            [emb, views],
        ),
        "cosent_loss": (lambda a, v: flashcl.cosent_loss(a, v, scored, **kw), [emb, views]),
        "distill_loss": (
            lambda a, v: flashcl.distill_loss(a, v, emb[:, :4], views[:, :4], scale=5.0, teacher_scale=4.0, **kw),
            [emb, views],
        ),
        "neighbor_loss": (lambda s: flashcl.neighbor_loss(s, nb, exclude_diagonal=False, **kw), [scores]),
        "triplet_loss": (lambda e: flashcl.triplet_loss(e, labels, margin=0.3, mining="hard", **kw), [emb]),
        "circle_loss": (lambda e: flashcl.circle_loss(e, labels, gamma=8.0, **kw), [emb]),
        "multi_similarity_loss": (lambda e: flashcl.multi_similarity_loss(e, labels, beta=5.0, **kw), [emb]),
        "contrastive_loss": (lambda e: flashcl.contrastive_loss(e, labels, **kw), [emb]),
        "rank_n_contrast_loss": (lambda e: flashcl.rank_n_contrast_loss(e, scored, **kw), [emb]),
        "cosface_loss": (lambda e, w: flashcl.cosface_loss(e, labels, w, scale=8.0, **kw), [emb, classes]),
        "arcface_loss": (lambda e, w: flashcl.arcface_loss(e, labels, w, scale=8.0, **kw), [emb, classes]),
        "proxy_anchor_loss": (lambda e, w: flashcl.proxy_anchor_loss(e, labels, w[:3], **kw), [emb, classes]),
        "maxsim_loss": (lambda q, d: flashcl.maxsim_loss(q, d, temperature=0.5, **kw), [query, docs]),
        "maxsim_distill_loss": (
            lambda q, d: flashcl.maxsim_distill_loss(q, d, teacher, temperature=0.5, **only),
            [query, candidates],
        ),
        "dino_loss": (
            lambda s, w: flashcl.dino_loss(s, torch.stack([views, emb]), w, pairs="cross", **only),
            [torch.stack([emb, views]), prototypes],
        ),
        "swav_loss": (lambda v, w: flashcl.swav_loss(v, w, **only), [torch.stack([emb, views]), prototypes]),
        "koleo_loss": (lambda e: flashcl.koleo_loss(e, **only), [emb]),
        "alignment": (lambda a, v: flashcl.metrics.alignment(a, v, process_group=kw["process_group"]), [emb, views]),
        "uniformity": (lambda e: flashcl.metrics.uniformity(e, process_group=kw["process_group"]), [emb]),
    }


def _combinations(name: str) -> List[Dict[str, str]]:
    """The strategies and ``grad_scale`` values the loss ``name`` takes."""
    import inspect

    params = inspect.signature(LOSSES[name]).parameters
    strategies = ("all_gather", "ring") if "strategy" in params else (None,)
    scales = ("ddp", "sum") if "grad_scale" in params else (None,)
    out = []
    for s in strategies:
        for gs in scales:
            out.append({k: v for k, v in (("strategy", s), ("grad_scale", gs)) if v is not None})
    return out


def _run(fn: Callable[..., torch.Tensor], inputs: List[torch.Tensor]) -> Any:
    """The value and the gradients (of each differentiable input), or the error's text."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    try:
        loss = fn(*leaves)
        grads = torch.autograd.grad(loss, leaves)
    except Exception as err:  # noqa: BLE001 - compared across eager and compiled
        cause = err
        while cause.__cause__ is not None:  # dynamo wraps an operator's error
            cause = cause.__cause__
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return loss.detach(), [x.detach() for x in grads]


def _worker(rank: int, world: int, out_dir: str, names: List[str]) -> None:
    init_gloo(rank, world, out_dir)
    results: Dict[Any, Any] = {}
    group = dist.group.WORLD
    for name in names:
        for combo in _combinations(name):
            fn, inputs = _cases(rank, dict(combo, process_group=group))[name]
            torch._dynamo.reset()
            results[(name, tuple(combo.values()))] = (
                _run(fn, inputs),
                _run(torch.compile(fn, fullgraph=True, backend=AOT), inputs),
            )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def _check(world: int, out_dir: str) -> None:
    for rank in range(world):
        results = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        assert results
        for key, (eager, compiled) in results.items():
            what = f"rank {rank}: {key}"
            if isinstance(eager, str):  # a combination the loss refuses: a strategy it does not take
                assert eager.startswith("ValueError") and "ring" in key[1], f"{what}: eager raised {eager}"
                assert compiled == eager, f"{what}: eager raised {eager!r}, compiled gave {compiled!r}"
                print(f"{what}: refused eagerly and compiled: {eager}")
                continue
            assert not isinstance(compiled, str), f"{what}: compiled raised {compiled}"
            assert_close(compiled[0], eager[0], f"{what}: value", *TOL)
            assert len(compiled[1]) == len(eager[1])
            for i, (a, e) in enumerate(zip(compiled[1], eager[1])):
                assert_close(a, e, f"{what}: gradient {i}", *TOL)


QUICK = ["supcon_loss", "clip_loss", "contrastive_loss", "dino_loss"]


def test_losses_with_a_process_group_compile_whole_and_equal_eager(tmp_path) -> None:
    spawn(_worker, args=(2, str(tmp_path), QUICK), nprocs=2, join=True)
    _check(2, str(tmp_path))


@pytest.mark.slow
def test_every_loss_with_a_process_group_compiles_whole_and_equals_eager(tmp_path) -> None:
    # flashcl's own losses (a test's toy loss registers itself too where its file ran first)
    names = sorted(
        n
        for n, fn in LOSSES.items()
        if fn.__module__.startswith("flashcl.") and n not in QUICK and "process_group" in _params(n)
    )
    assert len(names) >= 15
    spawn(_worker, args=(2, str(tmp_path), names), nprocs=2, join=True)
    _check(2, str(tmp_path))


def _params(name: str) -> Any:
    import inspect

    return inspect.signature(LOSSES[name]).parameters


def _step_worker(rank: int, world: int, out_dir: str) -> None:
    """Per-row losses (the backward operator, which runs the loss's collectives again), a
    second step without recompilation, a DDP training step compiled whole, and a
    mismatched call."""
    init_gloo(rank, world, out_dir)
    group = dist.group.WORLD
    results: Dict[str, Any] = {}
    b = SIZES[rank]
    g = torch.Generator().manual_seed(rank)
    emb = torch.randn(b, 6, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 3, (b,), generator=g)
    torch._dynamo.reset()
    per_row = lambda e: flashcl.supcon_loss(e, labels, reduction="none", process_group=group)  # noqa: E731
    weights = torch.rand(b, dtype=torch.float64, generator=g) + 0.5
    results["none"] = [
        _run(lambda e, f=f: (f(e) * weights).sum(), [emb])
        for f in (per_row, torch.compile(per_row, fullgraph=True, backend=AOT))
    ]

    torch._dynamo.reset()
    step = torch.compile(
        lambda e, y: flashcl.clip_loss(e, y, 10.0, process_group=group, strategy="ring"), fullgraph=True, backend=AOT
    )
    step(emb.clone().requires_grad_(True), emb.flip(0)).backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(2):
            x = torch.randn(b, 6, dtype=torch.float64, generator=g, requires_grad=True)
            y = torch.randn(b, 6, dtype=torch.float64, generator=g)
            got = step(x, y)
            got.backward()
            want = flashcl.clip_loss(x.detach(), y, 10.0, process_group=group, strategy="ring")
            results[f"second_{i}"] = (got.detach(), want)

    def make() -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 4).double())
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = flashcl.supcon_loss(model(x), labels, temperature=0.2, process_group=group)
        loss.backward()
        opt.step()
        return loss.detach()

    torch._dynamo.reset()
    eager, compiled = make(), make()
    compiled_train = torch.compile(train, backend=AOT)
    losses = []
    for _ in range(3):
        losses.append((compiled_train(*compiled, emb), train(*eager, emb)))
    results["ddp_losses"] = losses
    results["ddp_params"] = [
        (p.detach().clone(), q.detach().clone()) for p, q in zip(compiled[0].parameters(), eager[0].parameters())
    ]
    torch._dynamo.reset()
    mismatched = torch.compile(
        lambda e: flashcl.supcon_loss(e, labels, temperature=0.1 + 0.1 * rank, process_group=group),
        fullgraph=True,
        backend=AOT,
    )
    results["mismatch"] = _run(mismatched, [emb])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_per_row_second_step_ddp_step_and_mismatch_compiled(tmp_path) -> None:
    spawn(_step_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        (want, want_grads), (got, got_grads) = r["none"]
        assert_close(got, want, f"rank {rank}: per-row loss", *TOL)
        assert_close(got_grads[0], want_grads[0], f"rank {rank}: per-row gradient", *TOL)
        for i in range(2):
            got, want = r[f"second_{i}"]
            assert_close(got, want, f"rank {rank}: step {i + 2}", *TOL)
        for i, (got, want) in enumerate(r["ddp_losses"]):
            assert_close(got, want, f"rank {rank}: DDP step {i} loss", *TOL)
        for i, (got, want) in enumerate(r["ddp_params"]):
            assert_close(got, want, f"rank {rank}: DDP parameter {i} after 3 steps", *TOL)
        assert r["mismatch"].startswith("ValueError") and "temperature" in r["mismatch"], r["mismatch"]
