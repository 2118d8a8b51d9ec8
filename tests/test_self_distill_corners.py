"""The self-distillation family in its corners, against formulas written here and the
peers' own code (lightly 1.6, DINOv2): tiny losses near collapse keep their relative
precision in float32, second derivatives on every backend, the lightly drop-ins' edge
rules (KoLeo's self product, a teacher whose logits take a gradient)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from ssl_peers import dv2, needs_dinov2, needs_lightly, peer

import flashcl
from flashcl.integrations import lightly as ours
from helpers import assert_close

F64 = torch.float64
TOL = (1e-12, 1e-10)
#: float32 against float64 near collapse: the relative error of the loss and of each gradient (norm-wise)
NEAR = 2e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().to(F64)
    return float((got.detach().to(F64) - want).norm() / want.norm())


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return F.normalize(v, dim=-1)


# ----------------------------------------------------------------------------- near collapse


def _collapsed(seed: int, views: int = 2) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student and teacher rows close to their prototype (a converged model): with sharp
    temperatures the cross-entropy is 1e-8 .. 1e-7 while the logits are 20 .. 25."""
    g = torch.Generator().manual_seed(seed)
    k, d, b = 16, 16, 8
    w = torch.eye(k, d, dtype=F64) + 0.01 * torch.randn(k, d, generator=g, dtype=F64)
    y = w[torch.arange(b) % k] + 0.03 * torch.randn(views, b, d, generator=g, dtype=F64)
    x = y + 0.03 * torch.randn(views, b, d, generator=g, dtype=F64)
    return x, y, w


def _formula(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, ts: float, tt: float) -> torch.Tensor:
    """Each student row's cross-entropy against the same view's teacher softmax, in float64
    (where ``LSE - sum p z`` leaves about 1e-15 of a loss of 1e-8): the oracle."""
    p = torch.softmax(_unit(y) @ _unit(w).detach().T / tt, -1)
    return -(p * torch.log_softmax(_unit(x) @ _unit(w).T / ts, -1)).sum(-1)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ts", [0.05, 0.04])
def test_a_tiny_loss_keeps_its_precision_in_float32(backend: str, reduction: str, ts: float) -> None:
    """A loss of 1e-8 .. 1e-7 (``LSE - sum p z`` of two numbers near 25 leaves nothing of
    it in float32: it came back as 0 or off by 60%): float32 within 2e-5 of float64, the
    loss and the rows' and the prototypes' gradients, the scalar's fused pass and the
    per-row pass."""
    x, y, w = _collapsed(0)
    up = torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(1), dtype=F64) + 0.5
    xl, wl = _leaf(x), _leaf(w)
    rows = _formula(xl, y, wl, ts, 0.04)
    want = rows.mean() if reduction == "mean" else rows
    assert float(rows.max()) < 2e-7
    grad_up = None if reduction == "mean" else up
    want_grads = torch.autograd.grad(want, [xl, wl], grad_up)
    xf, wf = _leaf(x.float()), _leaf(w.float())
    opts = dict(student_temperature=ts, teacher_temperature=0.04, pairs="all", reduction=reduction)
    # one teacher view per student view (the same crop): the formula's pairing
    got = torch.stack(
        [flashcl.dino_loss(xf[v], y[v].float(), wf, backend=backend, block_size=5, **opts) for v in range(x.shape[0])]
    )
    got = got.mean() if reduction == "mean" else got
    assert _rel(got, want) < NEAR, (float(got.sum()), float(want.sum()))
    grads = torch.autograd.grad(got, [xf, wf], None if grad_up is None else grad_up.float())
    for a, e, name in zip(grads, want_grads, ("rows", "prototypes")):
        assert _rel(a, e) < NEAR, f"{name}' gradient: {_rel(a, e):.3g}"


@needs_lightly
def test_a_tiny_loss_keeps_its_precision_in_the_lightly_drop_ins() -> None:
    """lightly's DINOLoss and IBOTPatchLoss on the logits of a near-collapsed model: the
    drop-ins in float32 within 2e-5 of lightly's own code in float64 (lightly's in
    float32 is 1e-3 .. 1 off there)."""
    x, y, w = _collapsed(2)
    logits = lambda v: _unit(v) @ _unit(w).T  # noqa: E731
    t = [logits(v) for v in y]
    s = [logits(v) for v in x]
    mine = ours.DINOLoss(output_dim=16, student_temp=0.05)
    theirs = peer.DINOLoss(output_dim=16, student_temp=0.05).double()
    want_in = [_leaf(v) for v in s]
    want = theirs(t, want_in)
    assert float(want) < 1e-6
    got_in = [_leaf(v.float()) for v in s]
    got = mine([v.float() for v in t], got_in)
    assert _rel(got, want) < NEAR
    for a, e in zip(torch.autograd.grad(got, got_in), torch.autograd.grad(want, want_in)):
        assert _rel(a, e) < NEAR

    mask = torch.ones(2, 2, 4, dtype=torch.bool)
    mine_i, theirs_i = ours.IBOTPatchLoss(output_dim=16, student_temp=0.05), peer.IBOTPatchLoss(16, student_temp=0.05)
    ti, si = torch.cat(t), _leaf(torch.cat(s))
    want = theirs_i.double()(ti, si, mask)
    sf = _leaf(si.float())
    got = mine_i(ti.float(), sf, mask)
    assert _rel(got, want) < NEAR
    assert _rel(torch.autograd.grad(got, sf)[0], torch.autograd.grad(want, si)[0]) < NEAR


# ----------------------------------------------------------------------------- second derivatives


def _second(fn: Callable[..., torch.Tensor], inputs: List[torch.Tensor], seed: int) -> List[torch.Tensor]:
    """The Hessian-vector products of ``fn`` along a fixed direction, by double backward."""
    leaves = [_leaf(v) for v in inputs]
    grads = torch.autograd.grad(fn(*leaves), leaves, create_graph=True, allow_unused=True)
    g = torch.Generator().manual_seed(seed)
    dirs = [torch.randn(v.shape, generator=g, dtype=v.dtype) for v in leaves]
    total = sum((gr * dv).sum() for gr, dv in zip(grads, dirs) if gr is not None)
    out = torch.autograd.grad(total, leaves, allow_unused=True)
    return [torch.zeros_like(v) if o is None else o for o, v in zip(out, leaves)]


# the teacher's side (its rows, its prototypes ``v``) fixed, so that finite differences in the
# student's rows and prototypes see the loss the gradients are of; SwAV's codes come from the
# differentiated views themselves (their value moves with them): Hessian-vector products only
@pytest.mark.parametrize(
    "name,call,finite_differences",
    [
        (
            "dino scalar",
            lambda x, y, w, v, be: flashcl.dino_loss(
                x, y, w, teacher_prototypes=v, pairs="cross", backend=be, block_size=4
            ),
            True,
        ),
        (
            "dino per row",
            lambda x, y, w, v, be: (
                flashcl.dino_loss(
                    x, y, w, teacher_prototypes=v, pairs="cross", reduction="none", backend=be, block_size=4
                )
                ** 2
            ).sum(),
            True,
        ),
        (
            "sinkhorn",
            lambda x, y, w, v, be: flashcl.dino_loss(
                x, y, w, teacher_prototypes=v, targets="sinkhorn", backend=be, block_size=4
            ),
            True,
        ),
        (
            "swav",
            lambda x, y, w, v, be: flashcl.swav_loss(torch.cat([x, y]), w, high_resolution=2, backend=be),
            False,
        ),
        ("koleo", lambda x, y, w, v, be: flashcl.koleo_loss(x[0], backend=be, block_size=3), True),
    ],
)
def test_second_derivatives_on_the_tiled_backend_equal_the_dense_ones(
    name: str, call: Any, finite_differences: bool
) -> None:
    """``create_graph=True`` (a gradient penalty, a Hessian-vector product) on the tiled
    prototype and KoLeo paths: exact, through the dense formula, equal to the dense
    backend's and to gradgradcheck's finite differences."""
    g = torch.Generator().manual_seed(3)
    x, y, w, v = (torch.randn(*s, generator=g, dtype=F64) for s in ((2, 5, 4), (2, 5, 4), (9, 4), (9, 4)))
    want = _second(lambda a, b_: call(a, y, b_, v, "dense"), [x, w], 4)
    got = _second(lambda a, b_: call(a, y, b_, v, "tiled"), [x, w], 4)
    for a, e in zip(got, want):
        assert_close(a, e, f"{name}: a Hessian-vector product", *TOL)
    if finite_differences:
        assert torch.autograd.gradgradcheck(lambda a, b_: call(a, y, b_, v, "tiled"), (_leaf(x), _leaf(w)))


@needs_lightly
def test_second_derivatives_of_the_lightly_drop_ins_equal_lightlys() -> None:
    g = torch.Generator().manual_seed(5)
    t = [torch.randn(4, 7, generator=g, dtype=F64) for _ in range(2)]
    s = [torch.randn(4, 7, generator=g, dtype=F64) for _ in range(3)]
    mine, theirs = ours.DINOLoss(7).double(), peer.DINOLoss(7).double()
    got = _second(lambda *v: mine(t, list(v)), s, 6)
    want = _second(lambda *v: theirs(t, list(v)), s, 6)
    for a, e in zip(got, want):
        assert_close(a, e, "DINOLoss: a Hessian-vector product", *TOL)
    got = _second(lambda *v: ours.SwaVLoss()(list(v[:2]), list(v[2:])), s, 7)
    want = _second(lambda *v: peer.SwaVLoss()(list(v[:2]), list(v[2:]))[0], s, 7)
    for a, e in zip(got, want):
        assert_close(a, e, "SwaVLoss: a Hessian-vector product", *TOL)
    x = torch.randn(9, 5, generator=g, dtype=F64)
    got = _second(lambda v: ours.KoLeoLoss()(v), [x], 8)
    want = _second(lambda v: peer.KoLeoLoss()(v), [x], 8)
    assert_close(got[0], want[0], "KoLeoLoss: a Hessian-vector product", *TOL)


# ----------------------------------------------------------------------------- the drop-ins' own corners


@needs_lightly
@needs_dinov2
def test_koleo_self_product_rule_of_each_peer() -> None:
    """Two antipodal rows: lightly's KoLeoLoss fills its self products with -2 (the other
    row is the neighbour: -log 2), DINOv2's with -1 (a tie the row itself wins: the
    distance is eps). The lightly drop-in keeps lightly's rule, flashcl.koleo_loss
    DINOv2's, each equal to its peer, values and gradients."""
    x = torch.tensor([[1.0, 0.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64)[:2]
    for mine, theirs in ((ours.KoLeoLoss(), peer.KoLeoLoss()), (flashcl.KoLeoLoss(), dv2.KoLeoLoss())):
        a, e = _leaf(x), _leaf(x)
        got, want = mine(a), theirs(e)
        assert_close(got, want, f"{type(mine).__module__}: antipodal rows", *TOL)
        assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, e)[0], "their gradient", *TOL)
    assert float(ours.KoLeoLoss()(x)) == pytest.approx(-0.6931, abs=1e-4)
    for backend in ("reference", "dense", "tiled"):
        assert float(flashcl.koleo_loss(x, backend=backend)) > 8.0
        # lightly's rule as an option of the loss, on every backend
        a, e = _leaf(x), _leaf(x)
        got, want = flashcl.koleo_loss(a, self_score=-2.0, backend=backend), peer.KoLeoLoss()(e)
        assert_close(got, want, f"{backend}: self_score=-2", *TOL)
        assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(want, e)[0], "its gradient", *TOL)


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_koleo_self_score_above_every_product_makes_each_row_its_own_neighbour(backend: str) -> None:
    """``self_score`` above every cosine: each row's neighbour is itself, at distance
    ``|eps 1| = eps sqrt(D)`` (the formula's ``+ eps`` inside the norm): one sample, a batch
    not a multiple of the block, half precision, the Module twin."""
    eps, d = 1e-3, 5
    want = -math.log(eps * math.sqrt(d) + eps)
    for b in (1, 7):
        x = torch.randn(b, d, dtype=F64, generator=torch.Generator().manual_seed(b))
        got = flashcl.koleo_loss(x, eps=eps, self_score=2.0, backend=backend, block_size=3)
        assert abs(float(got) - want) < 1e-9, (b, float(got), want)
    module = flashcl.KoLeoLoss(eps=eps, self_score=2.0, backend=backend, block_size=3)
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(3))
    assert float(module(x)) == pytest.approx(want, rel=1e-5)
    assert float(flashcl.koleo_loss(x.bfloat16(), eps=eps, self_score=2.0, backend=backend)) == pytest.approx(
        want, rel=1e-2
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "x", True, torch.tensor(-2.0, requires_grad=True)])
def test_koleo_self_score_refuses_what_is_not_a_finite_number(bad: object) -> None:
    with pytest.raises(ValueError, match="self_score"):
        flashcl.koleo_loss(torch.randn(5, 3), self_score=bad)  # type: ignore[arg-type]


@needs_lightly
def test_a_teacher_whose_logits_require_grad_gets_lightlys_gradient() -> None:
    """lightly's DINOLoss and IBOTPatchLoss backpropagate into the teacher's logits when
    they require grad (its own head test feeds the same head's logits as teacher and
    student): the drop-ins give the same gradients, to the teacher and the student."""
    g = torch.Generator().manual_seed(9)
    t = [torch.randn(5, 11, generator=g, dtype=F64) for _ in range(2)]
    s = [torch.randn(5, 11, generator=g, dtype=F64) for _ in range(3)]
    out = []
    for loss_fn in (ours.DINOLoss(11).double(), peer.DINOLoss(11).double()):
        tl, sl = [_leaf(v) for v in t], [_leaf(v) for v in s]
        loss = loss_fn(tl, sl)
        out.append((loss, *torch.autograd.grad(loss, tl + sl)))
    for a, e in zip(*out):
        assert_close(a, e, "DINOLoss with a teacher that takes a gradient", *TOL)
    mask = torch.rand(2, 3, 3, generator=g) > 0.4
    n = int(mask.sum())
    t, s = torch.randn(n, 11, generator=g, dtype=F64), torch.randn(n, 11, generator=g, dtype=F64)
    out = []
    for loss_fn in (ours.IBOTPatchLoss(11).double(), peer.IBOTPatchLoss(11).double()):
        tl, sl = _leaf(t), _leaf(s)
        loss = loss_fn(tl, sl, mask)
        out.append((loss, *torch.autograd.grad(loss, [tl, sl])))
    for a, e in zip(*out):
        assert_close(a, e, "IBOTPatchLoss with a teacher that takes a gradient", *TOL)


# ----------------------------------------------------------------------------- Sinkhorn-Knopp's range


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sinkhorn_knopp_where_the_exponential_overflows(dtype: torch.dtype) -> None:
    """A teacher temperature of 2^-10 (``exp(t / tau)`` overflows float32 past 88, float64
    past 709: DINOv2's formula gives NaN) and SwAV with an epsilon of 1e-3: every
    backend finite and equal, the reference's Sinkhorn-Knopp in the log domain too."""
    g = torch.Generator().manual_seed(11)
    x, y, w = (torch.randn(*s, generator=g, dtype=dtype) for s in ((2, 6, 4), (2, 6, 4), (9, 4)))
    for tt in (2.0**-10, 2.0**-14):
        out = {}
        for backend in ("reference", "dense", "tiled"):
            a, wa = _leaf(x), _leaf(w)
            loss = flashcl.dino_loss(a, y, wa, targets="sinkhorn", teacher_temperature=tt, backend=backend)
            swav = flashcl.swav_loss(torch.cat([a, y]), wa, high_resolution=2, sinkhorn_epsilon=tt, backend=backend)
            out[backend] = (loss.detach(), swav.detach(), *torch.autograd.grad(loss + swav, [a, wa]))
            assert all(bool(torch.isfinite(v).all()) for v in out[backend]), backend
        for backend in ("dense", "tiled"):
            for got, want in zip(out[backend], out["reference"]):
                if dtype == F64:
                    assert_close(got, want, f"{backend} at a teacher temperature of {tt}", *TOL)
                else:  # logits of 1e3 .. 1e4: float32's rounding of them moves the targets by about 1e-4
                    assert _rel(got, want) < 1e-3, f"{backend} at a teacher temperature of {tt}"


# ----------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_an_ibot_batch_with_no_masked_patch_is_zero(backend: str) -> None:
    """DINOv2 masks an image with probability 0.5: a batch may have no masked patch at
    all. The loss is 0 with zero gradients, as lightly's IBOTPatchLoss and DINOv2's
    forward_masked return (their sum over no rows divided by the images)."""
    masks = torch.zeros(3, 2, 2, dtype=torch.bool)
    x, w = torch.zeros(0, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    loss = flashcl.dino_loss(x, torch.zeros(0, 4), w, masks=masks, backend=backend)
    loss.backward()
    assert loss.shape == () and float(loss) == 0.0
    assert x.grad is not None and x.grad.shape == (0, 4)
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0
    rows = flashcl.dino_loss(x, torch.zeros(0, 4), w, masks=masks, reduction="none", backend=backend)
    assert rows.shape == (0,)
    if peer is not None:
        want = peer.IBOTPatchLoss(output_dim=7)(torch.zeros(0, 7), torch.zeros(0, 7), masks)
        assert float(want) == 0.0


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_an_empty_swav_queue_is_the_loss_without_one(backend: str) -> None:
    g = torch.Generator().manual_seed(12)
    v, w = torch.randn(3, 5, 4, generator=g, dtype=F64), torch.randn(9, 4, generator=g, dtype=F64)
    got = flashcl.swav_loss(v, w, high_resolution=2, queue=torch.zeros(2, 0, 4, dtype=F64), backend=backend)
    want = flashcl.swav_loss(v, w, high_resolution=2, backend=backend)
    assert_close(got, want, "an empty queue", *TOL)
    if peer is not None:
        scores = [_unit(x) @ _unit(w).T for x in v]
        lightly = peer.SwaVLoss()(scores[:2], scores[2:], [torch.zeros(0, 9, dtype=F64)] * 2)
        assert_close(got.reshape(1), lightly, "lightly's SwaVLoss with an empty queue", *TOL)
    with pytest.raises(ValueError, match="queue"):
        flashcl.swav_loss(v, w, high_resolution=2, queue=torch.zeros(3, 0, 4, dtype=F64))


# ----------------------------------------------------------------------------- the center


def test_the_center_is_made_in_the_teachers_dtype_and_round_trips() -> None:
    """DINOLoss() without num_prototypes: the center made at the first call in the
    teacher's compute dtype (float64 here, float32 for half inputs), and a state_dict
    round trip into a fresh DINOLoss() (which has no center yet) keeps it."""
    g = torch.Generator().manual_seed(13)
    x, y, w = (torch.randn(*s, generator=g, dtype=F64) for s in ((2, 4, 3), (2, 4, 3), (7, 3)))
    loss_fn = flashcl.DINOLoss()
    loss_fn(x, y, w)
    assert loss_fn.center is not None and loss_fn.center.dtype == F64
    fresh = flashcl.DINOLoss()
    fresh.load_state_dict(loss_fn.state_dict())
    assert fresh.center is not None and torch.equal(fresh.center, loss_fn.center)
    assert_close(fresh.eval()(x, y, w), loss_fn.eval()(x, y, w), "the same loss after the round trip", *TOL)
    half = flashcl.DINOLoss()
    half(x.bfloat16(), y.bfloat16(), w.bfloat16())
    assert half.center is not None and half.center.dtype == torch.float32
    with pytest.raises(ValueError, match="center"):
        flashcl.DINOLoss(num_prototypes=5).load_state_dict({"center": torch.zeros(7)})


@needs_lightly
@needs_dinov2
def test_lightlys_and_dinov2s_centers_load_into_every_dino_loss() -> None:
    """A checkpoint's center from lightly's DINOLoss (1, 1, K), its IBOTPatchLoss's Center
    (1, K), DINOv2's DINOLoss (1, K) and iBOTPatchLoss (1, 1, K): each loads into
    flashcl.DINOLoss and into the lightly drop-ins, and gives the peer's next loss."""
    k = 11
    g = torch.Generator().manual_seed(14)
    center = torch.randn(k, generator=g, dtype=F64)
    checkpoints = {
        "lightly DINOLoss": {"center": center.view(1, 1, k)},
        "lightly Center": {"center": center.view(1, k)},
        "DINOv2 DINOLoss": {"center": center.view(1, k)},
        "DINOv2 iBOTPatchLoss": {"center": center.view(1, 1, k)},
        "lightly IBOTPatchLoss": {"center.center": center.view(1, k)},
    }
    peers = {
        "lightly DINOLoss": peer.DINOLoss(k).double(),
        "DINOv2 DINOLoss": dv2.DINOLoss(k).double(),
        "DINOv2 iBOTPatchLoss": dv2.iBOTPatchLoss(k).double(),
        "lightly IBOTPatchLoss": peer.IBOTPatchLoss(k).double(),
    }
    for name, state in checkpoints.items():
        if name in peers:  # the checkpoint is the peer's own
            assert set(peers[name].state_dict()) == set(state), name
            peers[name].load_state_dict(state)
        mine = flashcl.DINOLoss()
        mine.load_state_dict(state)
        assert torch.equal(mine.center, center), name
        drop = ours.DINOLoss(k).double()
        drop.load_state_dict(state)
        assert torch.equal(drop.center.reshape(-1), center), name
        ibot = ours.IBOTPatchLoss(k).double()
        if "center.center" in state:
            ibot.load_state_dict(state)
        else:
            ibot.center.load_state_dict(state)
        assert torch.equal(ibot.center.value.reshape(-1), center), name
    t = [torch.randn(4, k, generator=g, dtype=F64) for _ in range(2)]
    s = [torch.randn(4, k, generator=g, dtype=F64) for _ in range(3)]
    drop = ours.DINOLoss(k).double()
    drop.load_state_dict(peers["lightly DINOLoss"].state_dict())
    assert_close(drop(t, s), peers["lightly DINOLoss"](t, s), "the loaded center's loss", *TOL)


# ----------------------------------------------------------------------------- hard to misuse


def test_a_swapped_student_and_teacher_is_warned_about() -> None:
    """flashcl's losses take (student, teacher, prototypes), lightly's (teacher_out,
    student_out): teacher rows that require grad while the student's do not are likely
    swapped (the value differs and nothing else says so). A warning on both sides; none
    in the right order, none when both take a gradient (lightly's own head test)."""
    g = torch.Generator().manual_seed(15)
    x, y, w = (torch.randn(*s, generator=g) for s in ((2, 4, 3), (2, 4, 3), (7, 3)))
    with pytest.warns(UserWarning, match="swapped"):
        flashcl.dino_loss(y, x.requires_grad_(), w)
    with pytest.warns(UserWarning, match="swapped"):
        flashcl.DINOLoss()(y, x, w)
    t = [torch.randn(4, 7, generator=g) for _ in range(2)]
    s = [torch.randn(4, 7, generator=g, requires_grad=True) for _ in range(2)]
    with pytest.warns(UserWarning, match="swapped"):
        ours.DINOLoss(7)(s, t)
    with pytest.warns(UserWarning, match="swapped"):
        ours.IBOTPatchLoss(7)(s[0], t[0], torch.ones(1, 2, 2, dtype=torch.bool))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashcl.dino_loss(x, y, w)
        ours.DINOLoss(7)(t, s)
        ours.DINOLoss(7)(s, s)


@needs_lightly
@pytest.mark.parametrize("loss", ["dino", "swav"])
def test_a_student_view_with_no_paired_teacher_view_equals_lightly(loss: str) -> None:
    """lightly's DINOLoss with one teacher view and three student views (student view 0 is
    paired with no teacher view: the same index) and SwaVLoss with one high-resolution view
    (paired with none): the value and every gradient of lightly's, the unpaired view's
    gradient 0 (lightly's SwAV leaves it None: unused)."""
    teacher = [torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))]
    results = []
    for mod in (ours, peer):
        views = [torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        views = [v.requires_grad_() for v in views]
        if loss == "dino":
            value = mod.DINOLoss(output_dim=16)(teacher, views)
        else:
            value = mod.SwaVLoss()(views[:1], views[1:])
        value.backward()
        results.append([value.detach(), *[torch.zeros_like(v) if v.grad is None else v.grad for v in views]])
    for i, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, f"{loss}: {'value' if i == 0 else f'view {i - 1} gradient'}", 1e-12, 1e-12)
    assert float(results[0][1].abs().max()) == 0.0
