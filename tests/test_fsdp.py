"""Sharded models: the losses and cached_step under torch's fully_shard (FSDP2) on 2
gloo CPU processes give each parameter the gradient of one process's full-batch
step (float64)."""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, spawn

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch without FSDP2
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

SIZES = [6, 5]  # uneven local batches; with chunks of 2 rows, 3 chunks on each rank
TOL = (1e-10, 1e-9)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5)).double()


def _data() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = sum(SIZES)
    return {
        "x": torch.randn(n, 6, dtype=torch.float64, generator=g),
        "y": torch.randn(n, 6, dtype=torch.float64, generator=g),
        "labels": torch.randint(0, 3, (n,), generator=g),
    }


def _steps(group: Any) -> Dict[str, Callable[[torch.nn.Module, Dict[str, torch.Tensor]], None]]:
    """name -> one training step's backward on the (local or whole) batch ``b``."""
    kw = {} if group is None else {"process_group": group}

    def supcon(m: torch.nn.Module, b: Dict[str, torch.Tensor]) -> None:
        flashcl.supcon_loss(m(b["x"]), b["labels"], temperature=0.2, **kw).backward()

    def clip_ring(m: torch.nn.Module, b: Dict[str, torch.Tensor]) -> None:
        extra = {} if group is None else {"strategy": "ring"}
        flashcl.clip_loss(m(b["x"]), m(b["y"]), 5.0, labels=b["labels"], **kw, **extra).backward()

    def cached_info_nce(m: torch.nn.Module, b: Dict[str, torch.Tensor]) -> None:
        flashcl.cached_step(
            m, [b["x"], b["y"]], lambda q, d: flashcl.info_nce_loss(q, d, temperature=0.1, **kw), chunk_size=2
        )

    def cached_supcon_matryoshka(m: torch.nn.Module, b: Dict[str, torch.Tensor]) -> None:
        flashcl.cached_step(
            m, [b["x"]], lambda e: flashcl.supcon_loss(e, b["labels"], matryoshka_dims=[2, 5], **kw), chunk_size=2
        )

    def sharded_arcface(m: torch.nn.Module, b: Dict[str, torch.Tensor]) -> None:
        # 7 classes: rank 0 holds classes 0-2, rank 1 classes 3-6 (the labels are all rank 0's)
        w = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        if group is None:
            flashcl.arcface_loss(m(b["x"]), b["labels"], w, scale=4.0).backward()
            return
        lo, n = [(0, 3), (3, 4)][dist.get_rank(group)]
        flashcl.arcface_loss(
            m(b["x"]), b["labels"], w[lo : lo + n], scale=4.0, shard_classes=True, process_group=group
        ).backward()

    return {
        "sharded_arcface": sharded_arcface,
        "supcon": supcon,
        "clip_ring": clip_ring,
        "cached_info_nce": cached_info_nce,
        "cached_supcon_matryoshka": cached_supcon_matryoshka,
    }


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    start = sum(SIZES[:rank])
    local = {k: v[start : start + SIZES[rank]] for k, v in _data().items()}
    results: Dict[str, List[torch.Tensor]] = {}
    for name, step in _steps(dist.group.WORLD).items():
        model = _model()
        fully_shard(model[0])
        fully_shard(model)
        step(model, local)
        results[name] = [p.grad.full_tensor().detach().clone() for p in model.parameters()]
        del model
    # different chunk counts across ranks: a ValueError on every rank, not a hang in a forward's collective
    model = _model()
    fully_shard(model)
    short = {k: v[: 2 * (3 - rank)] for k, v in local.items()}  # 3 chunks on rank 0, 2 on rank 1
    try:
        _steps(dist.group.WORLD)["cached_info_nce"](model, short)
        results["uneven"] = "no error"  # type: ignore[assignment]
    except ValueError as err:
        results["uneven"] = str(err)  # type: ignore[assignment]
    del model
    # two separately sharded towers, the same total of chunks on each rank (2 + 3 and
    # 3 + 2: uneven hard negatives per rank): a ValueError on every rank, not a hang
    towers = [_model(), _model()]
    for tower in towers:
        fully_shard(tower)
    q, d = torch.randn([4, 6][rank], 6, dtype=torch.float64), torch.randn([12, 8][rank], 6, dtype=torch.float64)
    try:
        flashcl.cached_step(
            towers,
            [q, d],
            lambda a, b: flashcl.info_nce_loss(a, b, process_group=dist.group.WORLD),
            chunk_size=[2, 4],
        )
        results["towers"] = "no error"  # type: ignore[assignment]
    except ValueError as err:
        results["towers"] = str(err)  # type: ignore[assignment]
    del towers
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_fully_shard_gradients_equal_one_process(tmp_path) -> None:
    world = len(SIZES)
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in range(world):
        assert "same number of chunks" in ranks[r]["uneven"], ranks[r]["uneven"]
        assert "encoder 0: 2 to 3, encoder 1: 2 to 3" in ranks[r]["towers"], ranks[r]["towers"]
    whole = _data()
    for name, step in _steps(None).items():
        model = _model()
        step(model, whole)
        for r in range(world):
            for i, p in enumerate(model.parameters()):
                assert_close(ranks[r][name][i], p.grad, f"{name}: rank {r} parameter {i} vs one process", *TOL)
