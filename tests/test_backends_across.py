"""Every backend across processes: the losses whose one body runs through the runner
(flashcl.runner: every loss) take
``backend="reference"``, ``"dense"`` and ``"tiled"`` with a process group (the
reference and dense backends on the gathered keys: the oracle of the multi-process
tests), on 2 and 3 gloo processes with uneven batches, equal in float64 to one
process on the concatenated batch; round the ring only the tiled core, any other
backend a ValueError on every rank."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

SIZES = {2: [5, 8], 3: [4, 1, 7]}
BACKENDS = ("reference", "dense", "tiled")
TOL = (1e-10, 1e-9)


def data(total: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(total + 100)
    return {
        "emb": torch.randn(total, 6, dtype=torch.float64, generator=g),
        "views": torch.randn(total, 6, dtype=torch.float64, generator=g),
        "labels": torch.randint(0, 4, (total,), generator=g),
        "keys": torch.randn(2 * total, 6, dtype=torch.float64, generator=g),
        "ref": torch.randn(7, 6, dtype=torch.float64, generator=g),
        "ref_labels": torch.randint(0, 4, (7,), generator=g),
        "ref_self": torch.where(torch.arange(total) % 3 == 2, -1, torch.arange(total) % 7),
        "negatives": torch.randn(5, 6, dtype=torch.float64, generator=g),
        "classes": torch.randn(4, 6, dtype=torch.float64, generator=g),
        # a given score matrix (the ranks hold its rows) and each row's sampled neighbours
        "scores": 3.0 * torch.randn(total, total, dtype=torch.float64, generator=g),
        "neighbors": torch.randint(0, total, (total, 2), generator=g),
    }


def shard(sizes: List[int], rank: int, per: int = 1) -> slice:
    return slice(per * sum(sizes[:rank]), per * sum(sizes[: rank + 1]))


Case = Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]


def cases(d: Dict[str, torch.Tensor], sizes: List[int], rank: int, kw: Dict[str, Any], single: bool) -> Dict[str, Case]:
    sl = slice(None) if single else shard(sizes, rank)
    emb, views, labels = d["emb"][sl], d["views"][sl], d["labels"][sl]
    keys = d["keys"][slice(None) if single else shard(sizes, rank, 2)]
    if single:
        pos = torch.cat([torch.arange(s) * 2 + 2 * sum(sizes[:r]) for r, s in enumerate(sizes)])
    else:
        pos = torch.arange(emb.shape[0]) * 2
    key_labels = d["labels"].repeat_interleave(2)[slice(None) if single else shard(sizes, rank, 2)]
    ref, ref_labels, ref_self = d["ref"], d["ref_labels"], d["ref_self"][sl]
    t = torch.tensor(0.4, dtype=torch.float64)
    gather = {} if single or "strategy" in kw else {"strategy": "all_gather"}
    # the guide close to the model: some in-batch candidates are its false negatives
    guide_a, guide_p = emb[:, :4] + 0.3 * views[:, :4], views[:, :4] + 0.3 * emb[:, :4]
    guide_n = keys[::2, :4]
    # multi-hot label sets: each sample's class and the next one
    multi_hot = torch.nn.functional.one_hot(labels, 5).bool() | torch.nn.functional.one_hot(labels + 1, 5).bool()
    ref_multi_hot = torch.nn.functional.one_hot(ref_labels, 5).bool()
    return {
        "supcon": (lambda e, tt: flashcl.supcon_loss(e, labels, temperature=tt, **kw), [emb, t]),
        "supcon_sum_self": (
            lambda e, tt: flashcl.supcon_loss(
                e, labels, temperature=tt, positives="sum", include_self=True, reduction="sum", **kw
            ),
            [emb, t],
        ),
        "supcon_views": (
            lambda e, f, tt: flashcl.supcon_loss(torch.stack([e, f], 1), labels, temperature=tt, **kw),
            [emb, views, t],
        ),
        "supcon_matryoshka": (
            lambda e, tt: flashcl.supcon_loss(e, labels, temperature=tt, matryoshka_dims=[2, 6], **kw),
            [emb, t],
        ),
        "supcon_ref": (
            lambda e, tt: flashcl.supcon_loss(e, labels, temperature=tt, ref=ref, ref_labels=ref_labels, **kw),
            [emb, t],
        ),
        "supcon_ref_self": (
            lambda e, tt: flashcl.supcon_loss(
                e, labels, temperature=tt, ref=ref, ref_labels=ref_labels, ref_self=ref_self, **kw
            ),
            [emb, t],
        ),
        "nt_xent": (lambda a, b, tt: flashcl.nt_xent_loss(a, b, temperature=tt, **kw), [emb, views, t]),
        "nt_xent_decoupled_vmf": (
            lambda a, b, tt: flashcl.nt_xent_loss(
                a, b, temperature=tt, decoupled=True, weighting="vmf", sigma=0.7, **kw
            ),
            [emb, views, t],
        ),
        "nt_xent_hard": (
            lambda a, b, tt: flashcl.nt_xent_loss(a, b, temperature=tt, estimator="hard", tau_plus=0.1, beta=0.5, **kw),
            [emb, views, t],
        ),
        "clip": (lambda a, b, tt: flashcl.clip_loss(a, b, 1.0 / tt, **kw), [emb, views, t]),
        "clip_labels": (lambda a, b, tt: flashcl.clip_loss(a, b, 1.0 / tt, labels=labels, **kw), [emb, views, t]),
        "clip_matryoshka_sum": (
            lambda a, b, tt: flashcl.clip_loss(a, b, 1.0 / tt, matryoshka_dims=[2, 6], reduction="sum", **kw),
            [emb, views, t],
        ),
        # SigLIP's default strategy is the ring (open_clip's neighbour exchange): the other backends gather
        "siglip": (
            lambda a, b, tt: flashcl.siglip_loss(a, b, 1.0 / tt, -2.0 * tt, **kw, **gather),
            [emb, views, t],
        ),
        "siglip_labels": (
            lambda a, b, tt: flashcl.siglip_loss(a, b, 1.0 / tt, -1.0, labels=labels, normalize=True, **kw, **gather),
            [emb, views, t],
        ),
        "gist": (
            lambda a, p, tt: flashcl.gist_loss(a, p, guide=(guide_a, guide_p), temperature=tt, margin=0.05, **kw),
            [emb, views, t],
        ),
        "gist_negatives_relative": (
            lambda a, p, n, tt: flashcl.gist_loss(
                a,
                p,
                n,
                guide=(guide_a, guide_p, guide_n),
                temperature=tt,
                margin=0.1,
                margin_strategy="relative",
                contrast_anchors=False,
                **kw,
            ),
            [emb, views, keys[::2], t],
        ),
        "neighbor": (
            lambda sc: flashcl.neighbor_loss(sc, d["neighbors"][sl], reduction="mean", **kw),
            [d["scores"][sl]],
        ),
        "neighbor_keep_diagonal_sum": (
            lambda sc: flashcl.neighbor_loss(sc, d["neighbors"][sl], exclude_diagonal=False, reduction="sum", **kw),
            [d["scores"][sl]],
        ),
        "distill": (
            lambda a, b, ta, tt: flashcl.distill_loss(
                a, b, ta, keys[::2, :4] if single else d["keys"][::2, :4][sl], scale=1.0 / tt, teacher_scale=6.0, **kw
            ),
            [emb, views, emb[:, :4] + 0.5 * views[:, :4], t],
        ),
        "distill_symmetric": (
            lambda a, b, tt: flashcl.distill_loss(
                a, b, guide_a, guide_p, scale=1.0 / tt, teacher_scale=4.0, symmetric=True, **kw
            ),
            [emb, views, t],
        ),
        # class weights: a parameter every rank holds alike (its gradient summed over the ranks)
        "cosface": (
            lambda e, w, tt: flashcl.cosface_loss(e, labels, w, margin=0.2, scale=1.0 / tt, **kw),
            [emb, d["classes"], t],
        ),
        "arcface_sum": (
            lambda e, w, tt: flashcl.arcface_loss(e, labels, w, margin=0.3, scale=1.0 / tt, reduction="sum", **kw),
            [emb, d["classes"], t],
        ),
        "supcon_multi_hot": (
            lambda e, tt: flashcl.supcon_loss(e, multi_hot, temperature=tt, overlap_threshold=0.2, **kw),
            [emb, t],
        ),
        "supcon_multi_hot_queue": (
            lambda e, tt: flashcl.supcon_loss(
                e, multi_hot, temperature=tt, ref=ref, ref_labels=ref_multi_hot, positives="sum", **kw
            ),
            [emb, t],
        ),
        "triplet_all": (lambda e: flashcl.triplet_loss(e, labels, margin=0.4, normalize=True, **kw), [emb]),
        "triplet_hard_sum": (
            lambda e: flashcl.triplet_loss(e, labels, margin=0.3, mining="hard", reduction="sum", **kw),
            [emb],
        ),
        "triplet_semi_hard_soft_cosine": (
            lambda e: flashcl.triplet_loss(
                e, labels, margin=0.0, mining="semi-hard", soft_margin=True, distance="cosine", **kw
            ),
            [emb],
        ),
        "info_nce": (lambda q, k, tt: flashcl.info_nce_loss(q, k, pos, temperature=tt, **kw), [emb, keys, t]),
        "info_nce_labels": (
            lambda q, k, tt: flashcl.info_nce_loss(
                q, k, pos, temperature=tt, query_labels=labels, key_labels=key_labels, **kw
            ),
            [emb, keys, t],
        ),
        "info_nce_duplicates_positive": (
            lambda q, k, tt: flashcl.info_nce_loss(
                q, k, pos, temperature=tt, query_labels=labels, key_labels=key_labels, duplicates="positive", **kw
            ),
            [emb, keys, t],
        ),
        "info_nce_matryoshka": (
            lambda q, k, tt: flashcl.info_nce_loss(q, k, pos, temperature=tt, matryoshka_dims=[3, 6], **kw),
            [emb, keys, t],
        ),
        "info_nce_negatives": (
            lambda q, k, tt: flashcl.info_nce_loss(q, k, pos, temperature=tt, negatives=d["negatives"], **kw),
            [emb, keys, t],
        ),
        "info_nce_moco": (
            lambda q, k, tt: flashcl.info_nce_loss(
                q, k, pos, temperature=tt, negatives=d["negatives"], in_batch_negatives=False, **kw
            ),
            [emb, keys, t],
        ),
    }


def worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = data(sum(sizes))
    results: Dict[Any, Any] = {}
    for backend in BACKENDS:
        kw = {"backend": backend, "process_group": dist.group.WORLD, "grad_scale": "sum"}
        for name, (fn, inputs) in cases(d, sizes, rank, kw, single=False).items():
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
            loss = fn(*leaves)
            results[(backend, name)] = (loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)])
    try:  # round the ring only the tiled core: every rank gets the error
        flashcl.supcon_loss(
            d["emb"][shard(sizes, rank)],
            d["labels"][shard(sizes, rank)],
            backend="dense",
            strategy="ring",
            process_group=dist.group.WORLD,
        )
        results["ring_dense"] = "no error"
    except ValueError as err:
        results["ring_dense"] = str(err)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


#: (input, case): inputs every rank holds alike (class weights), their gradients summed over the ranks
REPLICATED = {(1, "cosface"), (1, "arcface_sum")}


@pytest.mark.parametrize("world", [2, 3])
def test_every_backend_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = data(sum(sizes))
    for name, (fn, inputs) in cases(d, sizes, 0, {"backend": "reference"}, single=True).items():
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        want_grads = torch.autograd.grad(want, leaves)
        for backend in BACKENDS:
            what = f"{backend}/{name}"
            got = [r[(backend, name)] for r in ranks]
            assert_close(sum(v for v, _ in got), want, f"{what}: sum of the ranks' values", *TOL)
            for i, g in enumerate(want_grads):
                if g.dim() == 0 or (i, name) in REPLICATED:
                    assert_close(sum(r[1][i] for r in got), g, f"{what}: summed temperature grad", *TOL)
                    continue
                per = 1 if g.shape[0] == sum(sizes) else 2
                for r in range(world):
                    assert_close(got[r][1][i], g[shard(sizes, r, per)], f"{what}: rank {r} grad {i}", *TOL)
    for r in range(world):
        assert "strategy='ring'" in ranks[r]["ring_dense"], ranks[r]["ring_dense"]


def _triton_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    sizes = SIZES[world]
    d = {k: v.float() if v.is_floating_point() else v for k, v in data(sum(sizes)).items()}
    kw = {"backend": "triton", "process_group": dist.group.WORLD, "grad_scale": "sum"}
    results: Dict[Any, Any] = {}
    for name in TRITON_CASES:
        fn, inputs = cases(d, sizes, rank, kw, single=False)[name]
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        loss = fn(*leaves)
        results[name] = (loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


TRITON_CASES = ("supcon", "nt_xent", "clip", "clip_labels", "info_nce", "info_nce_duplicates_positive")


def test_triton_across_processes_equals_one_process(tmp_path) -> None:
    """The Triton kernels on the gathered keys (what ``auto`` picks on CUDA), here under
    Triton's CPU interpreter in float32, on 2 processes: equal to one process (float64
    reference) within float32's tolerance."""
    import importlib.util

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1 (set by conftest before triton is imported)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter test runs where there is no GPU")
    world = 2
    spawn(_triton_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = data(sum(sizes))
    for name in TRITON_CASES:
        fn, inputs = cases(d, sizes, 0, {"backend": "reference"}, single=True)[name]
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        want = fn(*leaves)
        want_grads = torch.autograd.grad(want, leaves)
        got = [r[name] for r in ranks]
        assert_close(sum(v for v, _ in got), want, f"triton/{name}: value", 2e-5, 2e-5)
        for i, g in enumerate(want_grads):
            if g.dim() == 0:
                assert_close(sum(r[1][i] for r in got), g, f"triton/{name}: temperature grad", 2e-5, 2e-5)
                continue
            per = 1 if g.shape[0] == sum(sizes) else 2
            for r in range(world):
                assert_close(got[r][1][i], g[shard(sizes, r, per)], f"triton/{name}: rank {r} grad {i}", 2e-5, 2e-4)
