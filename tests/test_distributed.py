"""The losses with process_group= over gloo on 127.0.0.1: every loss, world sizes 2 and 3, uneven
batches, equal in float64 to one process on the concatenated batch."""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, spawn

SIZES = {2: [5, 8], 3: [4, 1, 7]}  # uneven, and a rank with a single row
TOL = (1e-10, 1e-9)


def _data(total: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(total)
    return {
        "emb": torch.randn(total, 6, dtype=torch.float64, generator=g),
        "labels": torch.randint(0, 4, (total,), generator=g),
        "z2": torch.randn(total, 6, dtype=torch.float64, generator=g),
        "keys": torch.randn(2 * total, 6, dtype=torch.float64, generator=g),
        # a queue (a MemoryBank's contents), the same on every rank, and each row's slot in it
        "ref": torch.randn(11, 6, dtype=torch.float64, generator=g),
        "ref_labels": torch.randint(0, 4, (11,), generator=g),
        "ref_self": torch.where(torch.arange(total) % 4 == 3, -1, torch.arange(total) % 11),
        "negatives": torch.randn(9, 6, dtype=torch.float64, generator=g),
        "guide_a": torch.randn(total, 4, dtype=torch.float64, generator=g),
        "guide_p": torch.randn(total, 4, dtype=torch.float64, generator=g),
        # a given score matrix and each row's sampled neighbours (global columns)
        "scores": 3.0 * torch.randn(total, total, dtype=torch.float64, generator=g),
        "neighbors": torch.randint(0, total, (total, 3), generator=g),
    }


def _shard(sizes: List[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


MODES = ("process_group",)


def _cases(
    d: Dict[str, torch.Tensor], sizes: List[int], rank: int, t: torch.Tensor, mode: str, strategy: str = "all_gather"
) -> Dict[str, Any]:
    """name -> (function of the differentiable inputs, the inputs): on a shard through
    the losses' ``process_group=`` (mode "process_group"), or single-process on the
    whole batch (mode "single")."""
    dist_mode = mode != "single"
    sl = _shard(sizes, rank) if dist_mode else slice(None)
    emb, labels, z2 = d["emb"][sl], d["labels"][sl], d["z2"][sl]
    # keys: each rank owns twice its queries' count (its positives + hard negatives)
    if dist_mode:
        ks = _shard([2 * s for s in sizes], rank)
        keys = d["keys"][ks]
        pos = torch.arange(emb.shape[0]) * 2
    else:
        keys = d["keys"][: 2 * sum(sizes)]
        pos = torch.cat([torch.arange(s) * 2 + 2 * sum(sizes[:r]) for r, s in enumerate(sizes)])
    lib = flashcl
    kw: Dict[str, Any] = {"grad_scale": "sum", "strategy": strategy} if dist_mode else {"backend": "reference"}
    if mode == "process_group":
        kw["process_group"] = dist.group.WORLD
    cases = {
        "supcon": (lambda e, tt: lib.supcon_loss(e, labels, temperature=tt, **kw), [emb, t]),
        "supcon_seed2_sum": (
            lambda e, tt: lib.supcon_loss(
                e, labels, temperature=tt, positives="sum", include_self=True, reduction="sum", **kw
            ),
            [emb, t],
        ),
        "nt_xent": (lambda a, b, tt: lib.nt_xent_loss(a, b, temperature=tt, **kw), [emb, z2, t]),
        "info_nce_hard": (lambda q, k, tt: lib.info_nce_loss(q, k, pos, temperature=tt, **kw), [emb, keys, t]),
        "clip": (lambda a, b, s: lib.clip_loss(a, b, s, **kw), [emb, z2, 1.0 / t]),
        "siglip": (lambda a, b, s: lib.siglip_loss(a, b, s, -1.0, **kw), [emb, z2, 1.0 / t]),
    }
    cases["nt_xent_decoupled"] = (
        lambda a, b, tt: lib.nt_xent_loss(a, b, temperature=tt, decoupled=True, **kw),
        [emb, z2, t],
    )
    cases["nt_xent_decoupled_vmf"] = (
        lambda a, b, tt: lib.nt_xent_loss(a, b, temperature=tt, decoupled=True, weighting="vmf", sigma=0.7, **kw),
        [emb, z2, t],
    )
    cases["clip_labels_bias"] = (
        lambda a, b, s: lib.clip_loss(a, b, s, labels=labels, logit_bias=-3.0, **kw),
        [emb, z2, 1.0 / t],
    )
    negatives = d["negatives"]
    cases["info_nce_moco"] = (
        lambda q, k, tt: lib.info_nce_loss(
            q, k, pos, temperature=tt, negatives=negatives, in_batch_negatives=False, **kw
        ),
        [emb, keys, t],
    )
    # GIST
    guide = (d["guide_a"][sl], d["guide_a"][sl] + 0.7 * d["guide_p"][sl])
    cases["gist"] = (lambda a, p, tt: lib.gist_loss(a, p, guide=guide, temperature=tt, margin=0.05, **kw), [emb, z2, t])
    # labels on both sides: a positive's duplicates masked, or positives too
    key_labels = d["labels"].repeat_interleave(2)[_shard([2 * s for s in sizes], rank) if dist_mode else slice(None)]
    for dup in ("mask", "positive"):
        cases[f"info_nce_labels_{dup}"] = (
            lambda q, k, tt, dup=dup: lib.info_nce_loss(
                q, k, pos, temperature=tt, query_labels=labels, key_labels=key_labels, duplicates=dup, **kw
            ),
            [emb, keys, t],
        )
    # the estimators
    cases["nt_xent_debiased"] = (
        lambda a, b, tt: lib.nt_xent_loss(a, b, temperature=tt, estimator="debiased", tau_plus=0.2, **kw),
        [emb, z2, t],
    )
    cases["nt_xent_hard"] = (
        lambda a, b, tt: lib.nt_xent_loss(a, b, temperature=tt, estimator="hard", tau_plus=0.1, beta=0.5, **kw),
        [emb, z2, t],
    )
    # a queue's keys and Matryoshka
    cases["supcon_matryoshka"] = (
        lambda e, tt: lib.supcon_loss(
            e, labels, temperature=tt, matryoshka_dims=[2, 6], matryoshka_weights=[0.5, 1.0], **kw
        ),
        [emb, t],
    )
    cases["info_nce_matryoshka"] = (
        lambda q, k, tt: lib.info_nce_loss(q, k, pos, temperature=tt, matryoshka_dims=[1, 3, 6], **kw),
        [emb, keys, t],
    )
    cases["info_nce_negatives"] = (
        lambda q, k, tt: lib.info_nce_loss(q, k, pos, temperature=tt, negatives=negatives, **kw),
        [emb, keys, t],
    )
    ref, ref_labels, ref_self = d["ref"], d["ref_labels"], d["ref_self"][sl]
    cases["supcon_ref"] = (
        lambda e, tt: lib.supcon_loss(e, labels, temperature=tt, ref=ref, ref_labels=ref_labels, **kw),
        [emb, t],
    )
    cases["supcon_ref_self"] = (
        lambda e, tt: lib.supcon_loss(
            e, labels, temperature=tt, ref=ref, ref_labels=ref_labels, ref_self=ref_self, **kw
        ),
        [emb, t],
    )
    cases["supcon_views"] = (
        lambda e, f, tt: lib.supcon_loss(torch.stack([e, f], 1), labels, temperature=tt, **kw),
        [emb, z2, t],
    )
    cases["clip_matryoshka"] = (
        lambda a, b, s: lib.clip_loss(a, b, s, matryoshka_dims=[2, 6], matryoshka_weights=[1.0, 0.5], **kw),
        [emb, z2, 1.0 / t],
    )
    cases["siglip_labels"] = (
        lambda a, b, s, bias: lib.siglip_loss(a, b, s, bias, labels=labels, normalize=True, **kw),
        [emb, z2, 1.0 / t, t - 2.0],
    )
    cases["info_nce_negatives_labels"] = (
        lambda q, k, tt: lib.info_nce_loss(
            q,
            k,
            pos,
            temperature=tt,
            negatives=negatives,
            query_labels=labels,
            key_labels=key_labels,
            duplicates="positive",
            **kw,
        ),
        [emb, keys, t],
    )
    cases["info_nce_smoothing"] = (
        lambda q, k, tt: lib.info_nce_loss(q, k, pos, temperature=tt, negatives=negatives, label_smoothing=0.1, **kw),
        [emb, keys, t],
    )
    cases["clip_smoothing"] = (lambda a, b, s: lib.clip_loss(a, b, s, label_smoothing=0.2, **kw), [emb, z2, 1.0 / t])
    nb = d["neighbors"][sl]
    cases["neighbor_mean"] = (lambda s: lib.neighbor_loss(s, nb, reduction="mean", **kw), [d["scores"][sl]])
    return cases


def _worker(rank: int, world: int, out_dir: str) -> None:
    # rendezvous through a file: no port to pick, so no race for one
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    sizes = SIZES[world]
    d = _data(sum(sizes))
    results: Dict[str, Any] = {}
    t = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    for mode in MODES:
        for strategy in ("all_gather", "ring"):
            for name, (fn, inputs) in _cases(d, sizes, rank, t, mode, strategy).items():
                inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
                loss = fn(*inputs)
                grads = torch.autograd.grad(loss, inputs)
                results[(mode, strategy, name)] = (loss.detach(), [g.detach() for g in grads])
    # under DistributedDataParallel with the "ddp" convention: the averaged parameter
    # gradient is the single-process gradient of the loss over the whole batch
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 5).double())
    x = d["emb"][_shard(sizes, rank)]
    flashcl.supcon_loss(
        model(x), d["labels"][_shard(sizes, rank)], temperature=0.3, process_group=dist.group.WORLD
    ).backward()
    results["ddp_grads"] = [p.grad.detach().clone() for p in model.parameters()]
    # the "ddp" convention: the returned value is world x the share
    e = d["emb"][_shard(sizes, rank)]
    results["ddp_value"] = flashcl.supcon_loss(
        e, d["labels"][_shard(sizes, rank)], process_group=dist.group.WORLD
    ).detach()
    # mismatched options must raise on every rank, not hang
    try:
        flashcl.supcon_loss(
            e, d["labels"][_shard(sizes, rank)], temperature=0.1 + 0.1 * rank, process_group=dist.group.WORLD
        )
        results["mismatch"] = "no error"
    except ValueError as err:
        results["mismatch"] = str(err)
    # a queue must be the same on every rank: one that differs is a ValueError on every rank
    try:
        flashcl.supcon_loss(
            e,
            d["labels"][_shard(sizes, rank)],
            ref=d["ref"] + 1e-3 * rank,
            ref_labels=d["ref_labels"],
            process_group=dist.group.WORLD,
        )
        results["ref_mismatch"] = "no error"
    except ValueError as err:
        results["ref_mismatch"] = str(err)
    # second derivatives: a clear error on every rank, for both strategies, never a wrong number
    for strategy in ("all_gather", "ring"):
        x = d["emb"][_shard(sizes, rank)].clone().requires_grad_(True)
        loss = flashcl.supcon_loss(
            x, d["labels"][_shard(sizes, rank)], strategy=strategy, process_group=dist.group.WORLD
        )
        try:
            torch.autograd.grad(loss, x, create_graph=True)
            results[f"double_{strategy}"] = "no error"
        except RuntimeError as err:
            results[f"double_{strategy}"] = str(err)
    if world == 3:  # a group of some ranks (0 and 2), not the world: ranks and peers are the group's
        sub = dist.new_group([0, 2])
        if rank in (0, 2):
            for strategy in ("all_gather", "ring"):
                x = d["emb"][_shard(sizes, rank)].clone().requires_grad_(True)
                keys = d["keys"][_shard([2 * s for s in sizes], rank)].clone().requires_grad_(True)
                pos = torch.arange(x.shape[0]) * 2
                loss = flashcl.supcon_loss(
                    x, d["labels"][_shard(sizes, rank)], process_group=sub, strategy=strategy, grad_scale="sum"
                ) + flashcl.info_nce_loss(
                    x, keys, pos, negatives=d["negatives"], process_group=sub, strategy=strategy, grad_scale="sum"
                )
                results[f"subgroup_{strategy}"] = (
                    loss.detach(),
                    [g.detach() for g in torch.autograd.grad(loss, [x, keys])],
                )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    del model  # the DDP module holds the process group
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_equals_single_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sizes = SIZES[world]
    d = _data(sum(sizes))
    t = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    for (mode, strategy, name), (fn, inputs) in [
        ((md, st, nm), c)
        for md in MODES
        for st in ("all_gather", "ring")
        for nm, c in _cases(d, sizes, 0, t, "single", st).items()
    ]:
        inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
        loss = fn(*inputs)
        grads = torch.autograd.grad(loss, inputs)
        key = (mode, strategy, name)
        name = f"{mode}/{strategy}/{name}"
        total = sum(r[key][0] for r in ranks)
        assert_close(total, loss, f"{name}: sum of rank losses vs one process", *TOL)
        # each rank's gradient of a per-rank input is its rows of the single-process
        # gradient (queries / views: the batch's shards; keys: twice as many); a
        # replicated scalar (temperature, logit scale, bias) has its gradient summed over ranks
        for i, g in enumerate(grads):
            if g.dim() == 0:
                assert_close(sum(r[key][1][i] for r in ranks), g, f"{name}: summed grad of scalar input {i}", *TOL)
                continue
            per_rank = sizes if g.shape[0] == sum(sizes) else [2 * s for s in sizes]
            assert g.shape[0] == sum(per_rank), (name, i, g.shape)
            for r in range(world):
                assert_close(ranks[r][key][1][i], g[_shard(per_rank, r)], f"{name}: rank {r} grad of input {i}", *TOL)
    single = flashcl.supcon_loss(d["emb"], d["labels"], backend="reference")
    ddp_mean = sum(r["ddp_value"] for r in ranks) / world
    assert_close(ddp_mean, single, "ddp convention: mean over ranks = global loss", *TOL)
    for r in range(world):
        assert "different calls" in ranks[r]["mismatch"], ranks[r]["mismatch"]
        assert "different calls" in ranks[r]["ref_mismatch"], ranks[r]["ref_mismatch"]
        for strategy in ("all_gather", "ring"):
            assert "second derivatives" in ranks[r][f"double_{strategy}"], ranks[r][f"double_{strategy}"]
    if world == 3:  # the group of ranks 0 and 2: one process on their rows
        members = (0, 2)
        rows = torch.cat([torch.arange(sum(sizes))[_shard(sizes, r)] for r in members])
        key_rows = torch.cat([torch.arange(2 * sum(sizes))[_shard([2 * s for s in sizes], r)] for r in members])
        x = d["emb"][rows].clone().requires_grad_(True)
        keys = d["keys"][key_rows].clone().requires_grad_(True)
        pos = torch.cat(
            [torch.arange(sizes[r]) * 2 + 2 * sum(sizes[m] for m in members[:i]) for i, r in enumerate(members)]
        )
        want = flashcl.supcon_loss(x, d["labels"][rows], backend="reference") + flashcl.info_nce_loss(
            x, keys, pos, negatives=d["negatives"], backend="reference"
        )
        gx, gk = torch.autograd.grad(want, [x, keys])
        for strategy in ("all_gather", "ring"):
            got = [ranks[r][f"subgroup_{strategy}"] for r in members]
            assert_close(sum(v for v, _ in got), want, f"subgroup {strategy}: value", *TOL)
            assert_close(torch.cat([g[0] for _, g in got]), gx, f"subgroup {strategy}: rows' grad", *TOL)
            assert_close(torch.cat([g[1] for _, g in got]), gk, f"subgroup {strategy}: keys' grad", *TOL)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).double()
    flashcl.supcon_loss(model(d["emb"]), d["labels"], temperature=0.3, backend="reference").backward()
    for r in range(world):
        for got, p in zip(ranks[r]["ddp_grads"], model.parameters()):
            assert_close(got, p.grad, f"DDP rank {r}: parameter gradient vs one process", *TOL)


@pytest.mark.slow  # 30 steps of two processes: ~13 s on 2 cores (CI runs it with the slow cases)
def test_ddp_example_trains(tmp_path) -> None:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "ddp_supcon.py"), "--steps", "30", "--strategy", "ring"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if "global loss" in line]
    assert len(losses) >= 2 and losses[-1] < losses[0], out.stdout
    assert "k-NN accuracy" in out.stdout
