"""PrototypeHead on the heads DINO and DINOv2 users have (DINOv2's DINOHead, lightly's
DINOProjectionHead with both settings of norm_last_layer, its DINOv2ProjectionHead, both
forms of torch's weight norm, a frozen or a trainable magnitude, no weight norm): the
fused loss on its rows and prototypes trains the head exactly as lightly's DINOLoss on the
head's own logits, over optimizer steps, in every dtype; under FSDP2 on 2 gloo processes,
the gradients of one process's full batch, or an error that names the wrapping to use."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import pytest
import torch

import flashcl
from flashcl.bench.peers import lightly_heads, lightly_ssl_losses
from flashcl.integrations.lightly import PrototypeHead
from helpers import assert_close, close_group, init_gloo, spawn

peer, WHY = lightly_ssl_losses()
heads, HEADS_WHY = lightly_heads()
needs_lightly = pytest.mark.skipif(peer is None or heads is None, reason=f"lightly: {WHY or HEADS_WHY}")
try:
    from dinov2.layers.dino_head import DINOHead
except ImportError as e:  # pragma: no cover - the suite installs it
    DINOHead, DV2_WHY = None, str(e)
else:
    DV2_WHY = ""

F64 = torch.float64
TOL = (1e-12, 1e-10)
IN, HIDDEN, BOTTLENECK, K = 12, 16, 8, 40


class _Head(torch.nn.Module):
    """A DINO head with a chosen last layer: torch's older weight_norm or its
    parametrization, the magnitude frozen at 1 or trainable, or a plain Linear."""

    def __init__(self, form: str, frozen: bool) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, BOTTLENECK)
        )
        layer = torch.nn.Linear(BOTTLENECK, K, bias=False)
        if form == "parametrizations":
            self.last_layer = torch.nn.utils.parametrizations.weight_norm(layer)
            g = self.last_layer.parametrizations.weight.original0
        elif form == "weight_norm":
            with pytest.warns(FutureWarning):
                self.last_layer = torch.nn.utils.weight_norm(layer)
            g = self.last_layer.weight_g
        else:
            self.last_layer, g = layer, None
        if g is not None:
            g.data.fill_(1)
            g.requires_grad = not frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(torch.nn.functional.normalize(self.mlp(x), dim=-1))


def _makers() -> Dict[str, Callable[[], torch.nn.Module]]:
    out: Dict[str, Callable[[], torch.nn.Module]] = {
        f"{form} {'frozen' if frozen else 'trainable'}": (lambda form=form, frozen=frozen: _Head(form, frozen))
        for form in ("parametrizations", "weight_norm")
        for frozen in (True, False)
    }
    out["plain Linear"] = lambda: _Head("plain", True)
    if DINOHead is not None:
        out["DINOv2 DINOHead"] = lambda: DINOHead(IN, K, nlayers=3, hidden_dim=HIDDEN, bottleneck_dim=BOTTLENECK)
    if heads is not None:
        for norm in (True, False):
            out[f"lightly DINOProjectionHead norm_last_layer={norm}"] = lambda norm=norm: heads.DINOProjectionHead(
                IN, HIDDEN, BOTTLENECK, K, norm_last_layer=norm
            )
        out["lightly DINOv2ProjectionHead"] = lambda: heads.DINOv2ProjectionHead(IN, HIDDEN, BOTTLENECK, K)
    return out


MAKERS = _makers()


def _pair(make: Callable[[], torch.nn.Module], seed: int) -> List[torch.nn.Module]:
    """Two copies of one head (torch's older weight norm does not deep-copy: built twice
    and loaded), in float64."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(seed)
        first = make().double()
        second = make().double()
    second.load_state_dict(first.state_dict())
    return [first, second]


def _float32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@needs_lightly
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_fused_loss_trains_the_head_as_lightly_on_its_logits(name: str) -> None:
    """Three SGD steps: lightly's DINOLoss on the student head's logits (2 global + 2 local
    crops, a fixed teacher, lightly's center), and flashcl.DINOLoss on the PrototypeHead's
    rows and prototypes: the same loss at every step and the same parameters after it,
    the magnitude of the weight norm included where it is trainable (it was read once,
    when the PrototypeHead was made: 0.83 off after one step)."""
    student_a, student_b = _pair(MAKERS[name], 0)
    teacher = _pair(MAKERS[name], 1)[0]
    ours = PrototypeHead(student_b)
    teacher_head = PrototypeHead(teacher)
    params_a = [p for p in student_a.parameters() if p.requires_grad]
    params_b = [p for p in student_b.parameters() if p.requires_grad]
    opt_a, opt_b = torch.optim.SGD(params_a, lr=0.5), torch.optim.SGD(params_b, lr=0.5)
    theirs = peer.DINOLoss(output_dim=K).double()
    mine = flashcl.DINOLoss(num_prototypes=K, pairs="cross", normalize=False, teacher_temperature=_float32(0.04))
    mine = mine.double()
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        crops = [torch.randn(5, IN, generator=g, dtype=F64) for _ in range(4)]
        with torch.no_grad():
            t_logits = [teacher(c) for c in crops[:2]]
            t_rows, t_w = teacher_head(torch.cat(crops[:2]), prototypes=True)
        want = theirs(t_logits, [student_a(c) for c in crops])
        rows, w = ours(torch.cat(crops), prototypes=True)
        got = mine(rows.view(4, 5, -1), t_rows.view(2, 5, -1), w, teacher_prototypes=t_w)
        assert_close(got, want, f"{name}: the loss at step {step}", *TOL)
        for opt, loss in ((opt_a, want), (opt_b, got)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        for i, (a, b) in enumerate(zip(params_a, params_b)):
            assert_close(b, a, f"{name}: parameter {i} after step {step}", *TOL)
    assert_close(mine.center, theirs.center.reshape(-1), f"{name}: the center", *TOL)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_prototypes_follow_the_parameters_and_the_dtype(name: str) -> None:
    """The prototypes are the layer's weight as its forward applies it, after a change of
    its parameters and after ``.to(dtype)``; rows @ prototypes.T is the head's logits."""
    head = _pair(MAKERS[name], 3)[0]
    wrapped = PrototypeHead(head)
    x = torch.randn(6, IN, dtype=F64)
    rows, w = wrapped(x, prototypes=True)
    assert_close(rows @ w.T, head(x), f"{name}: the head's logits", *TOL)
    with torch.no_grad():
        for p in head.last_layer.parameters():
            p.mul_(1.5).add_(0.1)
    assert_close(wrapped(x) @ wrapped.prototypes().T, head(x), f"{name}: after a change of the weights", *TOL)
    head.float()
    rows, w = wrapped(x.float(), prototypes=True)
    assert rows.dtype == w.dtype == torch.float32
    assert_close(rows @ w.T, head(x.float()), f"{name}: in float32", 1e-5, 1e-5)
    assert not wrapped.normalize


def test_a_head_without_a_last_layer_is_refused() -> None:
    with pytest.raises(ValueError, match="last_layer"):
        PrototypeHead(torch.nn.Linear(3, 4))


# ----------------------------------------------------------------------------- FSDP2 on 2 gloo processes

SIZES = [3, 4]  # uneven local batches: each rank's images, 2 global + 2 local crops each


def _batch() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(sum(SIZES), IN, generator=g, dtype=F64) for _ in range(4)]


def _step(student: torch.nn.Module, teacher: torch.nn.Module, crops: List[torch.Tensor], group: Any) -> None:
    """One DINO step's backward: the student's and the teacher's PrototypeHead calls, the
    fused loss over every rank's images (``group``), its gradient into the student."""
    n = crops[0].shape[0]
    rows, w = student(torch.cat(crops), prototypes=True)
    with torch.no_grad():
        t_rows, t_w = teacher(torch.cat(crops[:2]), prototypes=True)
    flashcl.dino_loss(
        rows.view(4, n, -1),
        t_rows.view(2, n, -1),
        w,
        teacher_prototypes=t_w,
        pairs="cross",
        normalize=False,
        process_group=group,
    ).backward()


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world, out_dir)
    start = sum(SIZES[:rank])
    local = [c[start : start + SIZES[rank]] for c in _batch()]
    results: Dict[str, Any] = {}
    for name in ("DINOv2 DINOHead", "weight_norm trainable", "parametrizations trainable"):
        for wrapping in ("PrototypeHead", "its layers and the PrototypeHead", "the head", "the last layer"):
            student_head, teacher_head = _pair(MAKERS[name], 5)
            student, teacher = PrototypeHead(student_head), PrototypeHead(teacher_head)
            if wrapping == "its layers and the PrototypeHead":
                for layer in student.mlp:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer)
            if wrapping == "the head":
                fully_shard(student_head)
            elif wrapping == "the last layer":
                fully_shard(student.last_layer)
            else:
                fully_shard(student)
            fully_shard(teacher)
            try:
                _step(student, teacher, local, dist.group.WORLD)
                results[f"{name}, {wrapping}"] = [p.grad.full_tensor().clone() for p in student_head.parameters()]
            except ValueError as err:
                results[f"{name}, {wrapping}"] = str(err)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.skipif(DINOHead is None, reason=f"dinov2 not importable: {DV2_WHY}")
def test_fully_shard_gives_one_process_gradients_or_names_the_wrapping(tmp_path: Any) -> None:
    """fully_shard on the PrototypeHead (alone, or on the MLP's layers as well): every
    parameter's gradient is one process's on the concatenated batch (the loss over every
    rank's images, FSDP averaging the gradients as DDP does); fully_shard on the head or on
    its last layer alone: a ValueError on every rank that names the wrapping to use."""
    world = len(SIZES)
    spawn(_fsdp_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    whole = _batch()
    for name in ("DINOv2 DINOHead", "weight_norm trainable", "parametrizations trainable"):
        student_head, teacher_head = _pair(MAKERS[name], 5)
        _step(PrototypeHead(student_head), PrototypeHead(teacher_head), whole, None)
        for wrapping in ("PrototypeHead", "its layers and the PrototypeHead"):
            for r in range(world):
                got = ranks[r][f"{name}, {wrapping}"]
                assert isinstance(got, list), got
                for i, (a, p) in enumerate(zip(got, student_head.parameters())):
                    assert_close(a, p.grad, f"{name}, {wrapping}: rank {r} parameter {i}", 1e-10, 1e-9)
        for wrapping in ("the head", "the last layer"):
            for r in range(world):
                err = ranks[r][f"{name}, {wrapping}"]
                assert isinstance(err, str) and "fully_shard to the PrototypeHead" in err, err
