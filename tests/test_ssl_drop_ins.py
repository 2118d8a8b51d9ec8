"""The DINOv2 drop-ins (flashcl.integrations.dinov2: DINOLoss, iBOTPatchLoss, KoLeoLoss)
and lightly's IBOTPlusPlusPatchLoss drop-in against the peers' own classes over several
steps, their centers moving: values, every gradient and the centers in float64, DINOv2's
padded iBOT buffers and its masks_weight, its Sinkhorn-Knopp; and DINOv2's training
pairing (its global crops' targets swapped) equal to flashcl.dino_loss's pairs="cross"."""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F
from ssl_peers import default_dtype, dv2, needs_dinov2, needs_lightly, peer

import flashcl
from flashcl.integrations import dinov2 as ours_v2
from flashcl.integrations import lightly as ours
from helpers import assert_close

F64 = torch.float64
TOL = (1e-12, 1e-10)


def _r(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


@needs_dinov2
@pytest.mark.parametrize("centering", ["softmax", "sinkhorn"])
def test_dinov2_dino_loss_over_steps(centering: str) -> None:
    """DINOv2's step: the teacher's targets (softmax_center_teacher, whose first call
    applies the previous step's update_center, or sinkhorn_knopp_teacher), the local
    crops against both teacher crops, the global crops against the swapped ones; three
    steps. Sinkhorn-Knopp: DINOv2 casts to float32, so 1e-6 there."""
    g = torch.Generator().manual_seed(1)
    k, b = 19, 5
    theirs, mine = dv2.DINOLoss(k).double(), ours_v2.DINOLoss(k).double()
    tol = TOL if centering == "softmax" else (1e-6, 1e-5)
    for step in range(3):
        t_logits = _r(g, 2 * b, k)
        s_local, s_global = _r(g, 4 * b, k), _r(g, 2 * b, k)
        out = []
        for loss_fn in (theirs, mine):
            if centering == "softmax":
                p = loss_fn.softmax_center_teacher(t_logits, teacher_temp=0.04)
                loss_fn.update_center(t_logits)
            else:
                p = loss_fn.sinkhorn_knopp_teacher(t_logits, teacher_temp=0.04).to(F64)
            p = p.view(2, b, k)
            local, glob = _leaf(s_local), _leaf(s_global)
            loss = loss_fn(list(local.chunk(4)), list(p)) + loss_fn([glob], [p.flip(0).flatten(0, 1)])
            out.append((loss, p, *torch.autograd.grad(loss, [local, glob])))
        for a, e, name in zip(out[1], out[0], ("loss", "targets", "local grad", "global grad")):
            assert_close(a, e, f"{centering} step {step}: {name}", *tol)
        theirs.apply_center_update()
        mine.apply_center_update()
        assert_close(mine.center, theirs.center, f"the center after step {step}", *TOL)
    assert mine.state_dict().keys() == theirs.state_dict().keys()


@needs_dinov2
def test_dinov2_ibot_forward_masked_with_padded_buffers_over_steps() -> None:
    """DINOv2's iBOT step: the masked patches in buffers padded to an upper bound (its
    collate's), the center of the (1, n, K) teacher tokens, forward_masked with
    n_masked_patches and its collate's masks_weight, and without them; the gradient of a
    padded row is 0."""
    g = torch.Generator().manual_seed(2)
    k, images, patches, upper = 13, 3, 8, 20
    theirs, mine = dv2.iBOTPatchLoss(k).double(), ours_v2.iBOTPatchLoss(k).double()
    for step in range(3):
        masks = torch.rand(images, patches, generator=g) > 0.5
        masks[step % images] = False  # an image with no masked patch
        n = int(masks.sum())
        weight = (1 / masks.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(masks)[masks].to(F64)
        t_tokens = _r(g, 1, n, k)
        student = torch.zeros(upper, k, dtype=F64)
        student[:n] = _r(g, n, k)
        out = []
        for loss_fn in (theirs, mine):
            p = loss_fn.softmax_center_teacher(t_tokens[:, :n], teacher_temp=0.07).squeeze(0)
            loss_fn.update_center(t_tokens[:n])
            p_padded = torch.cat([p, torch.full((upper - n, k), 1.0 / k, dtype=F64)])
            a, b_ = _leaf(student), _leaf(student[:n])
            with default_dtype(F64):
                padded = loss_fn.forward_masked(a, p_padded, masks, n_masked_patches=n, masks_weight=weight)
                plain = loss_fn.forward_masked(b_, p, masks)
            out.append((padded, plain, p, *torch.autograd.grad(padded + plain, [a, b_])))
        for x, e, name in zip(out[1], out[0], ("padded", "plain", "targets", "padded grad", "plain grad")):
            assert_close(x, e, f"step {step}: {name}", *TOL)
        assert float(out[1][3][n:].abs().sum()) == 0.0
        theirs.apply_center_update()
        mine.apply_center_update()
        assert_close(mine.center, theirs.center, f"the center after step {step}", *TOL)
    tokens, t_tokens = _r(g, 2, 6, k), torch.softmax(_r(g, 2, 6, k), -1)
    masks = torch.rand(2, 6, generator=g) > 0.5
    a, e = _leaf(tokens), _leaf(tokens)
    got, want = mine(a, t_tokens, masks), theirs(e, t_tokens, masks)
    assert_close(got, want, "forward on (B, N, K)", *TOL)
    assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, e)[0], "its gradient", *TOL)


@needs_dinov2
def test_dinov2_ibot_sinkhorn_and_koleo() -> None:
    """iBOT's Sinkhorn-Knopp with B the masked patches' count (DINOv2 needs
    torch.distributed for it: its formula written out here), at a temperature where
    DINOv2's overflows; KoLeoLoss and its pairwise_NNs_inner."""
    g = torch.Generator().manual_seed(3)
    t = _r(g, 9, 7)
    for temp in (0.07, 2.0**-12):
        q = torch.exp(t / temp).t()
        q = q / q.sum()
        for _ in range(3):
            q = q / q.sum(1, keepdim=True) / 7
            q = q / q.sum(0, keepdim=True) / 9
        want = (q * 9).t()
        got = ours_v2.iBOTPatchLoss(7).sinkhorn_knopp_teacher(t, temp, torch.tensor(9))
        if temp < 1e-3:
            assert not bool(torch.isfinite(want).all())  # the exponential overflows float64 there
            assert bool(torch.isfinite(got).all())
            assert_close(got.sum(1), torch.ones(9, dtype=F64), "each row's targets sum to 1", *TOL)
        else:
            assert_close(got, want, "iBOT's Sinkhorn-Knopp", *TOL)
    x = _r(g, 20, 6)
    x[5] = 3 * x[2]
    a, e = _leaf(x), _leaf(x)
    got, want = ours_v2.KoLeoLoss()(a), dv2.KoLeoLoss()(e)
    assert_close(got, want, "KoLeoLoss", *TOL)
    assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, e)[0], "KoLeoLoss gradient", 1e-8, 1e-8)
    unit = F.normalize(x, dim=-1)
    assert torch.equal(ours_v2.KoLeoLoss().pairwise_NNs_inner(unit), dv2.KoLeoLoss().pairwise_NNs_inner(unit))


@needs_dinov2
def test_dinov2s_training_pairing_is_pairs_cross() -> None:
    """DINOv2's ssl_meta_arch: the local crops against both teacher crops, the global
    crops (processed together) against the teacher's crops swapped, times 2, over
    ``n_global_terms + n_local_terms``: equal to flashcl.dino_loss with pairs="cross" on
    the same logits, not pairs="all"."""
    g = torch.Generator().manual_seed(4)
    b, k, d, n_local = 4, 17, 6, 3
    w = _r(g, k, d)
    s, t = _r(g, 2 + n_local, b, d), _r(g, 2, b, d)
    logits = lambda v: F.normalize(v, dim=-1) @ F.normalize(w, dim=-1).T  # noqa: E731
    loss_fn = dv2.DINOLoss(k).double()
    p = loss_fn.softmax_center_teacher(logits(t).flatten(0, 1), teacher_temp=0.04).view(2, b, k)
    terms = 2 * 1 + n_local * 2
    local = loss_fn(list(logits(s[2:]).unbind(0)), list(p)) / terms
    glob = loss_fn([logits(s[:2]).flatten(0, 1)], [p.flip(0).flatten(0, 1)]) * 2 / terms
    cross = flashcl.dino_loss(s, t, w, pairs="cross")
    assert_close(cross, local + glob, "pairs='cross' is DINOv2's training", *TOL)
    assert abs(float(flashcl.dino_loss(s, t, w, pairs="all")) - float(local + glob)) > 1e-3
    assert_close(flashcl.dino_loss(s, t, w), cross, "the default pairing", *TOL)


# ----------------------------------------------------------------------------- lightly's iBOT++


@needs_lightly
def test_lightly_ibot_plus_plus_over_steps() -> None:
    """lightly 1.6's IBOTPlusPlusPatchLoss: (B, N, K) without a mask, with one (and
    visible_loss_weight 0 and 0.5), (B N, K) with one; the center over the steps."""
    g = torch.Generator().manual_seed(5)
    b, n, k = 3, 6, 11
    theirs, mine = peer.IBOTPlusPlusPatchLoss(output_dim=k).double(), ours.IBOTPlusPlusPatchLoss(output_dim=k).double()
    calls: List[dict] = [{}, {"mask": True}, {"mask": True, "visible_loss_weight": 0.0}, {"mask": True, "flat": True}]
    for step, call in enumerate(calls):
        t, s = _r(g, b, n, k), _r(g, b, n, k)
        mask = torch.rand(b, n, generator=g) > 0.5 if call.get("mask") else None
        if call.get("flat"):
            t, s = t.flatten(0, 1), s.flatten(0, 1)
        kw = {"visible_loss_weight": call["visible_loss_weight"]} if "visible_loss_weight" in call else {}
        a, e = _leaf(s), _leaf(s)
        got, want = mine(t, a, mask=mask, **kw), theirs(t, e, mask=mask, **kw)
        assert_close(got, want, f"step {step}", *TOL)
        assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, e)[0], f"step {step} grad", *TOL)
        assert_close(mine.center.value, theirs.center.value, f"the center after step {step}", *TOL)
    for bad, match in (
        ((torch.randn(2, 5, k), torch.randn(2, 6, k)), "same shape"),
        ((torch.randn(10, k),) * 2, "mask"),
    ):
        with pytest.raises(ValueError, match=match):
            mine(*bad)
