"""flashcl.siglip_loss(..., process_group=) on 2 and 3 gloo processes: each rank's value and
gradients (features, logit scale, logit bias) equal open_clip's own SigLipLoss for
each of its exchanges (bidir, shift, reduce, gather), and with uneven batches the
rank values add up to the single-process loss."""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashcl
from flashcl.bench.peers import open_clip_loss_module
from helpers import assert_close, close_group, spawn

TOL = (1e-10, 1e-9)
EQUAL = {2: [6, 6], 3: [5, 5, 5]}
UNEVEN = {2: [4, 7], 3: [5, 2, 6]}


def _data(total: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(total)
    return {
        "img": F.normalize(torch.randn(total, 6, dtype=torch.float64, generator=g), dim=1),
        "txt": F.normalize(torch.randn(total, 6, dtype=torch.float64, generator=g), dim=1),
        "labels": torch.randint(0, 4, (total,), generator=g),
    }


def _shard(sizes: List[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _grads(fn: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    inputs = [
        x.clone().requires_grad_(True),
        y.clone().requires_grad_(True),
        torch.tensor(10.0, dtype=torch.float64, requires_grad=True),
        torch.tensor(-3.0, dtype=torch.float64, requires_grad=True),
    ]
    loss = fn(*inputs)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, inputs)]


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    oc, _ = open_clip_loss_module()
    results: Dict[Any, Any] = {}
    d = _data(sum(EQUAL[world]))
    sl = _shard(EQUAL[world], rank)
    x, y = d["img"][sl], d["txt"][sl]
    if oc is not None:
        for impl in ("bidir", "shift", "reduce", "gather"):
            ref = oc.SigLipLoss(rank=rank, world_size=world, dist_impl=impl)
            results[("open_clip", impl)] = _grads(lambda a, b, s, t, ref=ref: ref(a, b, s, t), x, y)
    for strategy in ("ring", "all_gather"):
        results[("flashcl", strategy)] = _grads(
            lambda a, b, s, t, st=strategy: flashcl.siglip_loss(
                a, b, s, t, strategy=st, process_group=dist.group.WORLD
            ),
            x,
            y,
        )
        results[("flashcl-local-sum", strategy)] = _grads(
            lambda a, b, s, t, st=strategy: flashcl.siglip_loss(
                a, b, s, t, strategy=st, process_group=dist.group.WORLD, normalize_by="local", grad_scale="sum"
            ),
            x,
            y,
        )
    # uneven batches, labels too: the shares of the global loss ("sum")
    d = _data(sum(UNEVEN[world]))
    sl = _shard(UNEVEN[world], rank)
    for strategy in ("ring", "all_gather"):
        for with_labels in (False, True):
            lab = d["labels"][sl] if with_labels else None
            results[("uneven", strategy, with_labels)] = _grads(
                lambda a, b, s, t, st=strategy, lab=lab: flashcl.siglip_loss(
                    a, b, s, t, labels=lab, process_group=dist.group.WORLD, strategy=st, grad_scale="sum", block_size=3
                ),
                d["img"][sl],
                d["txt"][sl],
            )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_siglip(world: int, tmp_path: Any) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    names = ("image", "text", "scale", "bias")
    d = _data(sum(UNEVEN[world]))
    for strategy in ("ring", "all_gather"):
        for with_labels in (False, True):
            lab = d["labels"] if with_labels else None
            single = _grads(
                lambda a, b, s, t, lab=lab: flashcl.siglip_loss(a, b, s, t, labels=lab, backend="reference"),
                d["img"],
                d["txt"],
            )
            key = ("uneven", strategy, with_labels)
            what = f"world {world} uneven {strategy} labels={with_labels}"
            assert_close(sum(rk[key][0] for rk in ranks), single[0], f"{what}: sum of rank losses", *TOL)
            for i, name in enumerate(names[:2]):
                got = torch.cat([ranks[r][key][1][i] for r in range(world)])
                assert_close(got, single[1][i], f"{what}: grad of {name}, by rank", *TOL)
            for i, name in ((2, "scale"), (3, "bias")):
                assert_close(sum(rk[key][1][i] for rk in ranks), single[1][i], f"{what}: summed grad of {name}", *TOL)
    oc, why = open_clip_loss_module()
    if oc is None:
        pytest.skip(f"the comparison with open_clip: {why}")
    for r, res in enumerate(ranks):
        for strategy in ("ring", "all_gather"):
            for ours in ("flashcl", "flashcl-local-sum"):
                got = res[(ours, strategy)]
                for impl in ("bidir", "shift", "reduce", "gather"):
                    exp = res[("open_clip", impl)]
                    what = f"world {world} rank {r}: {ours}/{strategy} vs open_clip {impl}"
                    assert_close(got[0], exp[0], f"{what}: loss", *TOL)
                    for name, a, e in zip(names, got[1], exp[1]):
                        assert_close(a, e, f"{what}: grad of {name}", *TOL)
