"""flashcl.dino_loss, swav_loss, koleo_loss, prototype_center, their Modules and the
lightly drop-ins (flashcl.integrations.lightly) against the peers' own code: lightly
1.6's loss files (DINOLoss, IBOTPatchLoss, KoLeoLoss, SwaVLoss, its Center) and the
DINOv2 repository's (the ``dinov2`` package: DINOLoss with its centred softmax and
Sinkhorn-Knopp, iBOTPatchLoss.forward_masked, KoLeoLoss), float64, values and every
gradient (the student's rows, the prototypes), every backend; across 2 and 3 gloo
processes with uneven batches (tests/test_self_distill_across.py)."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from ssl_peers import default_dtype, dv2, needs_dinov2, needs_lightly, peer

import flashcl
from flashcl.integrations import lightly as ours
from helpers import assert_close

BACKENDS = ["reference", "dense", "tiled"]
TOL = (1e-12, 1e-10)
F64 = torch.float64


def _r(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def _unit(v: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    return F.normalize(v, dim=-1) if normalize else v


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


def _float32(v: float) -> float:
    """A temperature as lightly holds it (``torch.tensor(v)``: float32)."""
    return float(torch.tensor(v, dtype=torch.float32))


# ----------------------------------------------------------------------------- DINO against lightly


@needs_lightly
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_dino_equals_lightly_dino_loss(backend: str, normalize: bool) -> None:
    """Two global teacher views, two global and three local student views (the same crop
    left out: ``pairs="cross"``), a center, separate teacher prototypes: the loss, the
    student rows' and the prototypes' gradients and the center's update equal lightly's
    DINOLoss on the logits the same head forms."""
    g = torch.Generator().manual_seed(1)
    s, t, b, k, d = 5, 2, 7, 19, 6
    x, y, w, wt, c = _r(g, s, b, d), _r(g, t, b, d), _r(g, k, d), _r(g, k, d), _r(g, k)
    tt = 0.04 if normalize else 0.7
    lightly_loss = peer.DINOLoss(output_dim=k).double()
    lightly_loss.center.copy_(c.view(1, 1, k))
    xl, wl = _leaf(x), _leaf(w)
    t_logits = [_unit(v, normalize) @ _unit(wt, normalize).T for v in y]
    s_logits = [_unit(v, normalize) @ _unit(wl, normalize).T for v in xl]
    want = lightly_loss(t_logits, s_logits, teacher_temp=tt)
    want_grads = torch.autograd.grad(want, [xl, wl])

    xo, wo = _leaf(x), _leaf(w)
    got = flashcl.dino_loss(
        xo,
        y,
        wo,
        teacher_prototypes=wt,
        center=c,
        pairs="cross",
        teacher_temperature=_float32(tt),
        normalize=normalize,
        backend=backend,
        block_size=5 if backend == "tiled" else None,
    )
    assert_close(got, want.detach(), f"{backend}: lightly's DINOLoss", *TOL)
    for a, e, name in zip(torch.autograd.grad(got, [xo, wo]), want_grads, ("rows", "prototypes")):
        assert_close(a, e, f"{backend}: {name}' gradient", *TOL)
    mean = flashcl.prototype_center(y, wt, normalize=normalize)
    assert_close(0.9 * c + 0.1 * mean, lightly_loss.center.reshape(-1), "the center's update", *TOL)


@needs_lightly
@pytest.mark.parametrize("backend", BACKENDS)
def test_ibot_masks_equal_lightly_ibot_patch_loss(backend: str) -> None:
    """iBOT's masked patches (an image with none, an image with all): each row weighs
    1 / (masked patches of its image), the sum over the images' count: lightly's
    IBOTPatchLoss, with its center."""
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(4, 3, 5, generator=g) > 0.5
    mask[0] = False
    mask[1] = True
    n, k, d = int(mask.sum()), 23, 5
    x, y, w, c = _r(g, n, d), _r(g, n, d), _r(g, k, d), _r(g, k)
    lightly_loss = peer.IBOTPatchLoss(output_dim=k).double()
    lightly_loss.center.center.copy_(c.view(1, k))
    xl, wl = _leaf(x), _leaf(w)
    # its weights 1 / (an integer count) take torch's default dtype: float64 for the comparison
    with default_dtype(F64):
        want = lightly_loss(_unit(y) @ _unit(w).T, _unit(xl) @ _unit(wl).T, mask)
    want_grads = torch.autograd.grad(want, [xl, wl])
    xo, wo = _leaf(x), _leaf(w)
    got = flashcl.dino_loss(xo, y, wo, masks=mask, center=c, teacher_temperature=0.04, backend=backend)
    assert_close(got, want.detach(), f"{backend}: lightly's IBOTPatchLoss", *TOL)
    for a, e in zip(torch.autograd.grad(got, [xo, wo]), want_grads):
        assert_close(a, e, f"{backend}: gradient", *TOL)


# ----------------------------------------------------------------------------- DINO against DINOv2


@needs_dinov2
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("targets", ["softmax", "sinkhorn"])
def test_dino_equals_dinov2_dino_loss(backend: str, targets: str) -> None:
    """DINOv2's DINOLoss: its centred softmax (the center from its update_center /
    apply_center_update) or its sinkhorn_knopp_teacher over both teacher views' rows,
    its forward summing over every student and teacher view it is given (``pairs="all"``,
    ``"mean"`` divides by the pairs as well; its training's pairing, ``"cross"``:
    tests/test_ssl_drop_ins.py). Its Sinkhorn casts to float32 (``.float()``): that
    case is compared at float32's precision (the float64 comparison with its formula
    written out: tests/test_prototypes.py)."""
    g = torch.Generator().manual_seed(3)
    s, t, b, k, d = 3, 2, 6, 17, 5
    x, y, w, wt = _r(g, s, b, d), _r(g, t, b, d), _r(g, k, d), _r(g, k, d)
    loss_fn = dv2.DINOLoss(k).double()
    t_logits = (_unit(y) @ _unit(wt).T).reshape(t * b, k)
    loss_fn.update_center(_unit(_r(g, 9, d)) @ _unit(wt).T)  # a center from an earlier batch
    if targets == "softmax":
        p = loss_fn.softmax_center_teacher(t_logits, 0.04)
        tol = TOL
    else:
        p = loss_fn.sinkhorn_knopp_teacher(t_logits, 0.04, n_iterations=3).to(F64)
        tol = (1e-5, 1e-6)
    xl, wl = _leaf(x), _leaf(w)
    want = loss_fn([_unit(v) @ _unit(wl).T for v in xl], list(p.view(t, b, k))) / (s * t)
    want_grads = torch.autograd.grad(want, [xl, wl])
    xo, wo = _leaf(x), _leaf(w)
    center = loss_fn.center.reshape(-1) if targets == "softmax" else None
    got = flashcl.dino_loss(
        xo, y, wo, teacher_prototypes=wt, targets=targets, center=center, pairs="all", backend=backend
    )
    assert_close(got, want.detach(), f"{backend}: DINOv2's DINOLoss", *tol)
    for a, e in zip(torch.autograd.grad(got, [xo, wo]), want_grads):
        assert_close(a, e, f"{backend}: gradient", *tol)


@needs_dinov2
@pytest.mark.parametrize("backend", BACKENDS)
def test_ibot_equals_dinov2_forward_masked(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    masks = torch.rand(3, 8, generator=g) > 0.4
    masks[2] = False
    n, k, d = int(masks.sum()), 13, 4
    x, y, w = _r(g, n, d), _r(g, n, d), _r(g, k, d)
    loss_fn = dv2.iBOTPatchLoss(k).double()
    p = loss_fn.softmax_center_teacher(_unit(y) @ _unit(w).T, 0.07)
    xl, wl = _leaf(x), _leaf(w)
    with default_dtype(F64):  # its weights 1 / (an integer count) in torch's default dtype
        want = loss_fn.forward_masked(_unit(xl) @ _unit(wl).T, p, masks)
    xo, wo = _leaf(x), _leaf(w)
    got = flashcl.dino_loss(xo, y, wo, masks=masks, teacher_temperature=0.07, backend=backend)
    assert_close(got, want.detach(), f"{backend}: DINOv2's iBOTPatchLoss", *TOL)
    for a, e in zip(torch.autograd.grad(got, [xo, wo]), torch.autograd.grad(want, [xl, wl])):
        assert_close(a, e, f"{backend}: gradient", *TOL)


@needs_dinov2
@pytest.mark.parametrize("backend", BACKENDS)
def test_koleo_equals_dinov2_and_lightly(backend: str) -> None:
    """Duplicated rows (distance 0: the eps keeps the log finite) and collinear ones (a
    tie of products): DINOv2's KoLeoLoss and lightly's, values and gradients."""
    g = torch.Generator().manual_seed(5)
    x = _r(g, 37, 5)
    x[30] = x[3]
    x[31] = 2 * x[7]
    oracles = [dv2.KoLeoLoss()] + ([peer.KoLeoLoss()] if peer is not None else [])
    for oracle in oracles:
        xl, xo = _leaf(x), _leaf(x)
        want = oracle(xl)
        got = flashcl.koleo_loss(xo, backend=backend, block_size=4 if backend == "tiled" else None)
        name = type(oracle).__module__
        assert_close(got, want.detach(), f"{backend}: {name}", *TOL)
        # the duplicated rows' gradient is the difference of two terms of about 1e7 (1 / eps scale):
        # float64 leaves about 1e-9 of it, in any order of the sums
        grads = torch.autograd.grad(got, xo)[0], torch.autograd.grad(want, xl)[0]
        assert_close(grads[0], grads[1], f"{name} gradient", 1e-8, 1e-8)
        rest = [i for i in range(37) if i not in (3, 30, 7, 31)]  # 31 = 2 x 7: the same unit row
        assert_close(grads[0][rest], grads[1][rest], f"{name} gradient, other rows", *TOL)


# ----------------------------------------------------------------------------- SwAV against lightly


@needs_lightly
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("queue", [False, True])
def test_swav_equals_lightly_swav_loss(backend: str, queue: bool) -> None:
    """Two high-resolution and three low-resolution views, with and without a queue:
    lightly's SwaVLoss on the scores of the normalised features against the normalised
    prototypes, the features' and the prototypes' gradients."""
    g = torch.Generator().manual_seed(6)
    v, b, k, d = 5, 6, 29, 7
    z, c = _r(g, v, b, d), _r(g, k, d)
    q = _r(g, 2, 11, d) if queue else None
    zl, cl = _leaf(z), _leaf(c)
    scores = [_unit(view) @ _unit(cl).T for view in zl]
    queue_scores = None if q is None else [(_unit(view) @ _unit(c).T).detach() for view in q]
    want = peer.SwaVLoss()(scores[:2], scores[2:], queue_scores)
    zo, co = _leaf(z), _leaf(c)
    got = flashcl.swav_loss(zo, co, high_resolution=2, queue=q, backend=backend, block_size=8)
    assert_close(got.reshape(1), want.detach(), f"{backend}: lightly's SwaVLoss", *TOL)
    for a, e in zip(torch.autograd.grad(got, [zo, co]), torch.autograd.grad(want[0], [zl, cl])):
        assert_close(a, e, f"{backend}: gradient", *TOL)


# ----------------------------------------------------------------------------- the drop-ins


def _dino_step(loss_fn: Any, t: List[torch.Tensor], s: List[torch.Tensor], **kw: Any) -> Any:
    leaves = [_leaf(v) for v in s]
    loss = loss_fn(t, leaves, **kw)
    return loss.detach(), torch.autograd.grad(loss, leaves)


@needs_lightly
def test_drop_ins_equal_lightly_over_steps() -> None:
    """Each drop-in against lightly's class over three calls (the center moving), the
    warm-up schedule by ``epoch`` and a temperature per call; the state_dict keys and
    values are lightly's."""
    g = torch.Generator().manual_seed(7)
    k, b = 31, 6
    theirs, mine = peer.DINOLoss(output_dim=k, warmup_teacher_temp_epochs=5).double(), None
    mine = ours.DINOLoss(output_dim=k, warmup_teacher_temp_epochs=5).double()
    for step, kw in enumerate([{"epoch": 1}, {"teacher_temp": 0.05}, {}]):
        t = [_r(g, b, k) for _ in range(2)]
        s = [_r(g, b, k) for _ in range(4)]
        (lw, gw), (lm, gm) = _dino_step(theirs, t, s, **kw), _dino_step(mine, t, s, **kw)
        assert_close(lm, lw, f"DINOLoss step {step}", *TOL)
        for a, e in zip(gm, gw):
            assert_close(a, e, f"DINOLoss gradient, step {step}", *TOL)
        assert_close(mine.center, theirs.center, f"DINOLoss center, step {step}", *TOL)
    assert mine.state_dict().keys() == theirs.state_dict().keys()

    theirs_i, mine_i = peer.IBOTPatchLoss(output_dim=k).double(), ours.IBOTPatchLoss(output_dim=k).double()
    for step in range(3):
        mask = torch.rand(3, 4, 4, generator=g) > 0.5
        n = int(mask.sum())
        t, s = _r(g, n, k), _r(g, n, k)
        a, e = _leaf(s), _leaf(s)
        lm, lw = mine_i(t, a, mask), theirs_i(t, e, mask, teacher_temp=None)
        assert_close(lm, lw.detach(), f"IBOTPatchLoss step {step}", *TOL)
        assert_close(torch.autograd.grad(lm, a)[0], torch.autograd.grad(lw, e)[0], "IBOTPatchLoss gradient", *TOL)
        assert_close(mine_i.center.value, theirs_i.center.value, "IBOTPatchLoss center", *TOL)
    assert mine_i.state_dict().keys() == theirs_i.state_dict().keys()

    for p in (2, 1):
        x = _r(g, 20, 6)
        a, e = _leaf(x), _leaf(x)
        lm, lw = ours.KoLeoLoss(p=p)(a), peer.KoLeoLoss(p=p)(e)
        assert_close(lm, lw.detach(), f"KoLeoLoss p={p}", *TOL)
        assert_close(torch.autograd.grad(lm, a)[0], torch.autograd.grad(lw, e)[0], f"KoLeoLoss p={p} grad", *TOL)

    for queue in (None, [_r(g, 9, k) for _ in range(2)]):
        views = [_r(g, b, k) for _ in range(5)]
        a, e = [_leaf(v) for v in views], [_leaf(v) for v in views]
        lm, lw = ours.SwaVLoss()(a[:2], a[2:], queue), peer.SwaVLoss()(e[:2], e[2:], queue)
        assert lm.shape == lw.shape == (1,)
        assert_close(lm, lw.detach(), "SwaVLoss", *TOL)
        for x1, x2 in zip(torch.autograd.grad(lm[0], a), torch.autograd.grad(lw[0], e)):
            assert_close(x1, x2, "SwaVLoss gradient", *TOL)


@needs_lightly
def test_drop_in_with_a_masked_student_logit_is_finite() -> None:
    """A student logit of -inf where the teacher's probability is 0 (a masked prototype):
    0 log 0 = 0, the loss and the other gradients finite (lightly's einsum gives NaN)."""
    g = torch.Generator().manual_seed(8)
    t = [_r(g, 4, 9) for _ in range(2)]
    s = [_r(g, 4, 9) for _ in range(2)]
    for v in t:
        v[:, 3] = float("-inf")
    for v in s:
        v[:, 3] = float("-inf")
    leaves = [_leaf(v) for v in s]
    loss = ours.DINOLoss(output_dim=9)(t, leaves)
    assert torch.isfinite(loss)
    grads = torch.autograd.grad(loss, leaves)
    finite = [v.clone() for v in s]
    for v in finite:
        v[:, 3] = -1e4  # a logit of probability 0 in double precision
    want = ours.DINOLoss(output_dim=9)(t, [_leaf(v) for v in finite])
    assert_close(loss, want, "-inf as probability 0", *TOL)
    assert all(torch.isfinite(gr).all() for gr in grads)


# ----------------------------------------------------------------------------- the Module and its center


@needs_lightly
def test_dino_module_keeps_lightlys_center_over_steps() -> None:
    """flashcl.DINOLoss in training mode: the stored center centres each call, then
    moves by the EMA of the teacher's batch mean, as lightly's DINOLoss over the same
    three steps; in eval mode the center stays; state_dict round trip."""
    g = torch.Generator().manual_seed(10)
    k, d, b = 21, 6, 5
    w = _r(g, k, d)
    theirs = peer.DINOLoss(output_dim=k).double()
    mine = flashcl.DINOLoss(num_prototypes=k, pairs="cross", teacher_temperature=_float32(0.04)).double()
    for step in range(3):
        x, y = _r(g, 3, b, d), _r(g, 2, b, d)
        want = theirs([_unit(v) @ _unit(w).T for v in y], [_unit(v) @ _unit(w).T for v in x])
        got = mine(x, y, w)
        assert_close(got, want, f"step {step}", *TOL)
        assert_close(mine.center, theirs.center.reshape(-1), f"center after step {step}", *TOL)
    mine.eval()
    before = mine.center.clone()
    mine(_r(g, 3, b, d), _r(g, 2, b, d), w)
    assert torch.equal(mine.center, before)
    fresh = flashcl.DINOLoss(num_prototypes=k).double()
    fresh.load_state_dict(mine.state_dict())
    assert torch.equal(fresh.center, mine.center)


@needs_dinov2
def test_dino_module_center_equals_dinov2s_update() -> None:
    """DINOv2's update_center / apply_center_update (the sum of the teacher's logits over
    the batch, divided by the rows) against flashcl.DINOLoss's center over three steps."""
    g = torch.Generator().manual_seed(19)
    k, d, b = 13, 5, 6
    w = _r(g, k, d)
    theirs = dv2.DINOLoss(k).double()
    mine = flashcl.DINOLoss(num_prototypes=k, pairs="cross").double()
    for step in range(3):
        x, y = _r(g, 3, b, d), _r(g, 2, b, d)
        mine(x, y, w)
        theirs.update_center((_unit(y) @ _unit(w).T).reshape(2 * b, k))
        theirs.apply_center_update()
        assert_close(mine.center, theirs.center.reshape(-1), f"center after step {step}", *TOL)


def test_dino_module_without_num_prototypes_creates_its_center() -> None:
    loss_fn = flashcl.DINOLoss()
    assert loss_fn.center is None
    loss_fn(torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.randn(7, 3))
    assert loss_fn.center is not None and loss_fn.center.shape == (7,) and loss_fn.center.abs().sum() > 0
    with pytest.raises(ValueError, match="num_prototypes"):
        flashcl.DINOLoss(num_prototypes=5)(torch.randn(4, 3), torch.randn(4, 3), torch.randn(7, 3))


# ----------------------------------------------------------------------------- options and corners


def test_reductions_none_and_sum() -> None:
    g = torch.Generator().manual_seed(11)
    x, y, w = _r(g, 3, 4, 5), _r(g, 2, 4, 5), _r(g, 9, 5)
    for backend in BACKENDS:
        rows = flashcl.dino_loss(x, y, w, pairs="cross", reduction="none", backend=backend)
        assert rows.shape == (3, 4)
        total = flashcl.dino_loss(x, y, w, pairs="cross", reduction="sum", backend=backend)
        mean = flashcl.dino_loss(x, y, w, pairs="cross", backend=backend)
        assert_close(rows.sum(), total, f"{backend}: sum", *TOL)
        assert_close(mean, total / (4 * 4), f"{backend}: mean over 4 pairs x 4 rows", *TOL)
    single = flashcl.dino_loss(x[0], y[0], w, reduction="none")
    assert single.shape == (4,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduction_none_with_an_uneven_upstream_gradient(backend: str) -> None:
    g = torch.Generator().manual_seed(12)
    x, y, w = _r(g, 2, 5, 4), _r(g, 2, 5, 4), _r(g, 11, 4)
    up = _r(g, 2, 5)
    a, wa = _leaf(x), _leaf(w)
    rows = flashcl.dino_loss(a, y, wa, targets="sinkhorn", reduction="none", backend=backend)
    got = torch.autograd.grad(rows, [a, wa], up)
    b_, wb = _leaf(x), _leaf(w)
    t = torch.softmax(torch.zeros(1), 0)  # noqa: F841 - the oracle below is written from the formula
    want_rows = flashcl.dino_loss(b_, y, wb, targets="sinkhorn", reduction="none", backend="reference")
    want = torch.autograd.grad(want_rows, [b_, wb], up)
    for x1, x2 in zip(got, want):
        assert_close(x1, x2, f"{backend}: gradient", *TOL)


def test_inputs_are_not_modified_and_strided_inputs_work() -> None:
    g = torch.Generator().manual_seed(13)
    base = _r(g, 4, 6, 10)
    x = base[:, :, ::2]  # non-contiguous
    y = _r(g, 1, 6, 5).expand(2, 6, 5)  # stride 0
    w = _r(g, 12, 10)[:, 1:6]
    c = _r(g, 12)
    saved = [v.clone() for v in (x, y, w, c)]
    for backend in BACKENDS:
        got = flashcl.dino_loss(x, y, w, center=c, backend=backend)
        want = flashcl.dino_loss(x.contiguous(), y.contiguous(), w.contiguous(), center=c, backend="reference")
        assert_close(got, want, f"{backend}: strided", *TOL)
    for a, e in zip((x, y, w, c), saved):
        assert torch.equal(a, e)


def test_half_precision_accumulates_in_float32() -> None:
    g = torch.Generator().manual_seed(14)
    x, y, w = (_r(g, *s) for s in ((2, 8, 16), (2, 8, 16), (64, 16)))
    want = flashcl.dino_loss(x, y, w, pairs="cross", backend="dense")
    for dtype in (torch.bfloat16, torch.float16):
        xs, ws = _leaf(x.to(dtype)), _leaf(w.to(dtype))
        for backend in ("dense", "tiled"):
            got = flashcl.dino_loss(xs, y.to(dtype), ws, pairs="cross", backend=backend, block_size=16)
            assert got.dtype == torch.float32
            assert abs(float(got.detach()) - float(want)) < 2e-2 * abs(float(want))
            gx, gw = torch.autograd.grad(got, [xs, ws])
            assert gx.dtype == gw.dtype == dtype and torch.isfinite(gx).all() and torch.isfinite(gw).all()
        k = flashcl.koleo_loss(x[0].to(dtype))
        assert k.dtype == torch.float32 and abs(float(k) - float(flashcl.koleo_loss(x[0]))) < 2e-2


def test_extreme_temperatures_stay_finite() -> None:
    """Teacher temperature 1e-3 (exp(t / tau) overflows float64 in DINOv2's Sinkhorn,
    not in the log domain) and a student temperature of 1e3: tiled equals dense."""
    g = torch.Generator().manual_seed(15)
    x, y, w = _r(g, 2, 6, 4), _r(g, 2, 6, 4), _r(g, 9, 4)
    for targets in ("softmax", "sinkhorn"):
        for ts, tt in ((1e-3, 1e-3), (1e3, 1e3)):
            opts = dict(targets=targets, student_temperature=ts, teacher_temperature=tt)
            a = flashcl.dino_loss(x, y, w, backend="dense", **opts)
            b = flashcl.dino_loss(x, y, w, backend="tiled", block_size=4, **opts)
            assert torch.isfinite(a) and torch.isfinite(b)
            assert_close(b, a, f"{targets} {ts} {tt}", 1e-9, 1e-9)


def test_frozen_prototypes_and_accumulation() -> None:
    g = torch.Generator().manual_seed(16)
    x, y, w = _r(g, 5, 4), _r(g, 5, 4), _r(g, 7, 4)
    a = _leaf(x)
    flashcl.dino_loss(a, y, w, backend="tiled").backward()
    first = a.grad.clone()
    flashcl.dino_loss(a, y, w, backend="tiled").backward()
    assert_close(a.grad, 2 * first, "accumulated", *TOL)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, y, w: flashcl.dino_loss(x, y[:, :3], w), "teacher"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w[:, :2]), "prototypes"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, teacher_prototypes=w[:3]), "teacher_prototypes"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, student_temperature=0.0), "student_temperature"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, teacher_temperature=float("nan")), "teacher_temperature"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, targets="kmeans"), "targets"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, pairs="cross"), "no pair"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, targets="sinkhorn", center=torch.zeros(9)), "center"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, center=torch.zeros(8)), "center"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, sinkhorn_iterations=-1), "sinkhorn_iterations"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, backend="triton"), "backend"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, masks=torch.ones(2, 2, dtype=torch.bool)), "masks"),
        (lambda x, y, w: flashcl.dino_loss(x, y, w, masks=torch.ones(6, 1)), "masks"),
        (lambda x, y, w: flashcl.dino_loss(x[:0], y[:0], w), "student"),
        (
            lambda x, y, w: flashcl.dino_loss(x, y, w, student_temperature=torch.tensor(0.1, requires_grad=True)),
            "learnable",
        ),
        (lambda x, y, w: flashcl.swav_loss(x.unsqueeze(0), w, high_resolution=2), "high_resolution"),
        (lambda x, y, w: flashcl.swav_loss(x, w), "views"),
        (lambda x, y, w: flashcl.swav_loss(torch.stack([x, y]), w, queue=torch.zeros(1, 3, 4)), "queue"),
        (lambda x, y, w: flashcl.koleo_loss(x, eps=0.0), "eps"),
        (lambda x, y, w: flashcl.DINOLoss(center_momentum=1.5), "center_momentum"),
    ],
)
def test_bad_input_is_a_clear_error(call: Any, match: str) -> None:
    x, y, w = torch.randn(6, 4), torch.randn(6, 4), torch.randn(9, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, y, w)


def test_compiled_loss_equals_eager() -> None:
    g = torch.Generator().manual_seed(17)
    x, y, w = _r(g, 2, 5, 4), _r(g, 2, 5, 4), _r(g, 8, 4)
    fn = torch.compile(lambda a, b_, c: flashcl.dino_loss(a, b_, c, pairs="cross", backend="tiled"))
    a, wa = _leaf(x), _leaf(w)
    got = fn(a, y, wa)
    got.backward()
    b2, wb = _leaf(x), _leaf(w)
    want = flashcl.dino_loss(b2, y, wb, pairs="cross", backend="tiled")
    want.backward()
    assert_close(got, want, "compiled", *TOL)
    assert_close(a.grad, b2.grad, "compiled rows' gradient", *TOL)
    assert_close(wa.grad, wb.grad, "compiled prototypes' gradient", *TOL)


@pytest.mark.parametrize("iterations", [0, 1, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sinkhorn_iterations_and_reductions_on_every_path(iterations: int, reduction: str) -> None:
    """The tiled backend's three paths (a scalar whose targets' row sums are known: its
    gradients formed in the forward pass; Sinkhorn with no iteration, whose rows do not
    sum to 1: recomputed in the backward; per row) equal the reference loops."""
    g = torch.Generator().manual_seed(18)
    x, y, w = _r(g, 3, 5, 4), _r(g, 2, 5, 4), _r(g, 11, 4)
    up = _r(g, 3, 5) if reduction == "none" else torch.tensor(1.7, dtype=F64)
    out = {}
    for backend in ("reference", "tiled"):
        a, wa = _leaf(x), _leaf(w)
        opts = dict(targets="sinkhorn", sinkhorn_iterations=iterations, pairs="cross", reduction=reduction)
        loss = flashcl.dino_loss(a, y, wa, backend=backend, block_size=3, **opts)
        out[backend] = (loss.detach(), *torch.autograd.grad(loss, [a, wa], up))
    for got, want, name in zip(out["tiled"], out["reference"], ("value", "rows", "prototypes")):
        assert_close(got, want, f"{iterations} iterations, {reduction}: {name}", *TOL)


@pytest.mark.parametrize("targets", ["softmax", "sinkhorn"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_tiled_over_many_prototypes_equals_reference(targets: str, reduction: str) -> None:
    """K = 1,024 prototypes: the tiled head's largest logits found by runs of columns
    (heads.row_max's path for wide tiles), one view and DINO's stacked views; the loss
    and both gradients equal the reference in float64."""
    g = torch.Generator().manual_seed(11)
    for s, t, pairs in ((1, 1, "all"), (4, 2, "cross")):
        x, y, w = _r(g, s, 24, 16), _r(g, t, 24, 16), _r(g, 1024, 16)
        center = 0.1 * _r(g, 1024) if targets == "softmax" else None
        up = torch.rand(s * 24, generator=g, dtype=torch.float64)
        out = {}
        for backend in ("reference", "tiled"):
            xs, ws = _leaf(x), _leaf(w)
            v = flashcl.dino_loss(
                xs, y, ws, targets=targets, center=center, pairs=pairs, reduction=reduction, backend=backend
            )
            (v if reduction == "mean" else (v.reshape(-1) * up).sum()).backward()
            out[backend] = (v.detach(), xs.grad, ws.grad)
        for name, a, b in zip(("loss", "grad x", "grad w"), out["tiled"], out["reference"]):
            assert_close(a, b, f"{name}, {targets}, {pairs}", *TOL)
