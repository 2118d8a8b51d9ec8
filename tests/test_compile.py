"""torch.compile around the losses: every loss of the case table traces with no graph
break (``fullgraph=True``), gives eager's values and gradients, does not recompile
on a second step, compiles once over several batch sizes with ``dynamic=True``; a
training step compiled whole equals the eager step; what cannot run compiled says so."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import flashcl
from flashcl.compiled import operator, operator_args
from helpers import CASES, TOL, assert_close, moved

AOT = "aot_eager"  # dynamo + AOTAutograd (the forward and backward graphs) without inductor's codegen


def _compiled(case, **options):
    torch._dynamo.reset()
    return dataclasses.replace(case, fn=torch.compile(case.fn, fullgraph=True, **options))


def _assert_same(got, want, what: str, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOL[dtype]
    assert_close(got[0], want[0], f"{what}: loss", atol, rtol)
    assert len(got[1]) == len(want[1])
    for i, (a, e) in enumerate(zip(got[1], want[1])):
        assert_close(a, e, f"{what}: gradient {i}", atol, rtol)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_case_compiles_whole_and_equals_eager(name: str, reduction: str) -> None:
    case = CASES[name]
    eager = case.run("auto", reduction, dtype=torch.float32)
    got = _compiled(case, backend=AOT).run("auto", reduction, dtype=torch.float32)  # fullgraph: a break raises
    _assert_same(got, eager, f"{name}/{reduction}")


@pytest.mark.parametrize("name", ["supcon", "clip", "nt_xent", "info_nce_hard_neg", "neighbor"])
def test_no_graph_break_reported(name: str) -> None:
    case = CASES[name]
    inputs = [t.float().requires_grad_(True) for t in case.tensors]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(case.fn)(*inputs, *case.extra, **case.kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_second_step_does_not_recompile() -> None:
    torch._dynamo.reset()
    step = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)
    labels = torch.arange(16) % 4
    step(torch.randn(16, 8, requires_grad=True), labels, temperature=0.1).backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            step(torch.randn(16, 8, requires_grad=True), torch.randint(0, 4, (16,)), temperature=0.1).backward()


def test_dynamic_batch_compiles_once() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(flashcl.clip_loss, fullgraph=True, dynamic=True, backend=AOT)
    for i, b in enumerate((8, 13, 32)):  # D = 6 is none of them (dynamo would guard on an equal size)
        img, txt = torch.randn(b, 6, requires_grad=True), torch.randn(b, 6, requires_grad=True)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = loss(img, txt, logit_scale=10.0)
        got.backward()
        want = flashcl.clip_loss(img.detach(), txt.detach(), logit_scale=10.0)
        assert_close(got.detach(), want, f"clip at B={b}", *TOL[torch.float32])
        fresh = img.detach().requires_grad_(True)
        (want_grad,) = torch.autograd.grad(flashcl.clip_loss(fresh, txt.detach(), logit_scale=10.0), fresh)
        assert_close(img.grad, want_grad, f"clip image gradient at B={b}", *TOL[torch.float32])
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "module, inputs, kwargs",
    [
        (flashcl.SupConLoss(), lambda: (torch.randn(12, 8), torch.arange(12) % 3), {}),
        (flashcl.NTXentLoss(), lambda: (torch.randn(12, 8), torch.randn(12, 8)), {}),
        (flashcl.InfoNCELoss(), lambda: (torch.randn(12, 8), torch.randn(12, 8)), {}),
        (flashcl.ClipLoss(), lambda: (torch.randn(12, 8), torch.randn(12, 8)), {"logit_scale": 10.0}),
        (
            flashcl.SigLipLoss(),
            lambda: (torch.randn(12, 8), torch.randn(12, 8)),
            {"logit_scale": 10.0, "logit_bias": -10.0},
        ),
        (
            flashcl.DistillLoss(),
            lambda: (torch.randn(12, 8), torch.randn(12, 8), torch.randn(12, 5), torch.randn(12, 5)),
            {"scale": 10.0, "teacher_scale": 20.0},
        ),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, torch.nn.Module) else "",
)
def test_modules_with_default_options_compile_whole(module: torch.nn.Module, inputs, kwargs) -> None:
    torch._dynamo.reset()
    xs = inputs()
    leaves = [x.requires_grad_(True) if x.is_floating_point() else x for x in xs]
    got = torch.compile(module, fullgraph=True, backend=AOT)(*leaves, **kwargs)
    got_grads = torch.autograd.grad(got, leaves[0])
    fresh = [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in xs]
    want = module(*fresh, **kwargs)
    _assert_same((got.detach(), got_grads), (want.detach(), torch.autograd.grad(want, fresh[0])), type(module).__name__)


def test_gist_module_compiles_whole() -> None:
    torch._dynamo.reset()
    a, p, ga, gp = (torch.randn(10, 8) for _ in range(4))
    module = flashcl.GistLoss(temperature=0.05)
    got = torch.compile(module, fullgraph=True, backend=AOT)(a.requires_grad_(True), p, guide=(ga, gp))
    _assert_same((got.detach(), torch.autograd.grad(got, a)), _eager_gist(module, a, p, ga, gp), "GistLoss")


def _eager_gist(module, a, p, ga, gp):
    a = a.detach().requires_grad_(True)
    want = module(a, p, guide=(ga, gp))
    return want.detach(), torch.autograd.grad(want, a)


def _multi_hot(b: int, c: int) -> torch.Tensor:
    return torch.rand(b, c, generator=torch.Generator().manual_seed(1)) < 0.4


# The losses and metrics outside the case table: (name, function, differentiable
# inputs, other positional inputs, keyword arguments).
MORE = [
    (
        "distill",
        flashcl.distill_loss,
        [(10, 8), (10, 8)],
        [torch.randn(10, 5), torch.randn(10, 5)],
        {"scale": 10.0, "teacher_scale": 20.0},
    ),
    (
        "distill_symmetric",
        flashcl.distill_loss,
        [(10, 8), (10, 8), (10, 5), (10, 5)],
        [],
        {"scale": 10.0, "teacher_scale": 20.0, "symmetric": True},
    ),
    ("supcon_multi_label", flashcl.supcon_loss, [(12, 8)], [_multi_hot(12, 5)], {"overlap_threshold": 0.2}),
    ("info_nce_label_smoothing", flashcl.info_nce_loss, [(10, 8), (10, 8)], [], {"label_smoothing": 0.1}),
    ("clip_label_smoothing", flashcl.clip_loss, [(10, 8), (10, 8)], [], {"logit_scale": 14.0, "label_smoothing": 0.1}),
    ("cosent", flashcl.cosent_loss, [(10, 8), (10, 8)], [torch.rand(10)], {"scale": 20.0}),
    ("angle", flashcl.cosent_loss, [(10, 8), (10, 8)], [torch.rand(10)], {"similarity": "angle"}),
    ("triplet_all", flashcl.triplet_loss, [(12, 8)], [torch.arange(12) % 3], {"margin": 0.5}),
    (
        "triplet_semi_hard",
        flashcl.triplet_loss,
        [(12, 8)],
        [torch.arange(12) % 3],
        {"margin": 0.5, "mining": "semi-hard"},
    ),
    (
        "cosface",
        lambda e, w, **kw: flashcl.cosface_loss(e, torch.arange(10) % 20, w, **kw),
        [(10, 8), (20, 8)],
        [],
        {"scale": 16.0},
    ),
    (
        "arcface",
        lambda e, w, **kw: flashcl.arcface_loss(e, torch.arange(10) * 2, w, **kw),
        [(10, 8), (20, 8)],
        [],
        {"margin": 0.4},
    ),
    ("maxsim", flashcl.maxsim_loss, [(4, 5, 8), (6, 7, 8)], [], {"temperature": 0.5, "backend": "tiled"}),
    (
        "maxsim_masked_smooth",
        lambda q, d, **kw: flashcl.maxsim_loss(q, d, doc_mask=torch.arange(7).expand(6, 7) < 5, **kw),
        [(4, 5, 8), (6, 7, 8)],
        [],
        {"smooth_max": 0.2, "normalize_scores": True},
    ),
    (
        "maxsim_distill",
        flashcl.maxsim_distill_loss,
        [(4, 5, 8), (4, 3, 7, 8)],
        [torch.randn(4, 3)],
        {"temperature": 0.5, "backend": "tiled", "block_size": 2},
    ),
    ("alignment", flashcl.metrics.alignment, [(10, 8), (10, 8)], [], {"alpha": 2.0}),
    ("uniformity", flashcl.metrics.uniformity, [(10, 8)], [], {"t": 2.0, "block_size": 4}),
]


@pytest.mark.parametrize("name, fn, shapes, extra, kwargs", MORE, ids=[m[0] for m in MORE])
def test_other_losses_and_metrics_compile_whole(name, fn, shapes, extra, kwargs) -> None:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*shape, generator=g) for shape in shapes]

    def run(f):
        leaves = [x.clone().requires_grad_(True) for x in xs]
        out = f(*leaves, *extra, **kwargs)
        return out.detach(), torch.autograd.grad(out, leaves)

    _assert_same(run(torch.compile(fn, fullgraph=True, backend=AOT)), run(fn), name)


def test_learnable_scale_and_tensor_options_get_gradients() -> None:
    torch._dynamo.reset()
    scale = flashcl.LogitScale()
    img, txt = torch.randn(9, 8, requires_grad=True), torch.randn(9, 8, requires_grad=True)
    labels = torch.tensor([0, 1, 1, 2, 3, 3, 3, 4, 5])

    def step(img, txt):
        return flashcl.clip_loss(img, txt, scale(), labels=labels, logit_bias=-1.0)

    got = torch.compile(step, fullgraph=True, backend=AOT)(img, txt)
    got_grads = torch.autograd.grad(got, [img, txt, scale.log_scale])
    want = step(img, txt)
    want_grads = torch.autograd.grad(want, [img, txt, scale.log_scale])
    _assert_same((got.detach(), got_grads), (want.detach(), want_grads), "clip with LogitScale")


def test_training_step_compiled_whole_equals_eager() -> None:
    def make():
        torch.manual_seed(0)
        encoder = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        return encoder, torch.optim.SGD(encoder.parameters(), lr=0.1)

    x, labels = torch.randn(24, 16), torch.arange(24) % 5

    def step(encoder, opt):
        opt.zero_grad()
        loss = flashcl.supcon_loss(encoder(x), labels, temperature=0.2)
        loss.backward()
        opt.step()
        return loss.detach()

    torch._dynamo.reset()
    eager_model, eager_opt = make()
    compiled_model, compiled_opt = make()
    compiled_step = torch.compile(step, backend=AOT)
    for _ in range(3):
        want, got = step(eager_model, eager_opt), compiled_step(compiled_model, compiled_opt)
        assert_close(got, want, "training step loss", *TOL[torch.float32])
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        assert_close(q.detach(), p.detach(), f"parameter {name} after 3 steps", *TOL[torch.float32])


def test_bad_input_raises_its_error_when_compiled() -> None:
    torch._dynamo.reset()
    loss = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)
    with pytest.raises(ValueError, match="labels"):
        loss(torch.randn(8, 4), torch.arange(7))


def test_a_process_group_that_is_no_group_is_named_when_compiled() -> None:
    """A process group enters the operator by its name (tests/test_compile_across.py runs
    the losses compiled on 2 processes); anything else is refused where the call is traced."""
    torch._dynamo.reset()
    loss = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)
    with pytest.raises(Exception, match="process_group of type object cannot enter a compiled flashcl loss"):
        loss(torch.randn(8, 4), torch.arange(8) % 2, process_group=object())


def test_second_derivative_through_compiled_loss_is_refused() -> None:
    torch._dynamo.reset()
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    loss = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)(x, torch.arange(8) % 2)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()
    # eagerly, second derivatives keep working
    eager = flashcl.supcon_loss(x, torch.arange(8) % 2)
    (g,) = torch.autograd.grad(eager, x, create_graph=True)
    assert torch.autograd.grad(g.square().sum(), x)[0].abs().sum() > 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_operator_fake_matches_real(name: str, reduction: str) -> None:
    """The fake implementation's shapes, dtypes and strides are the real outputs'
    (torch.library.opcheck), for every case of the table."""
    case = CASES[name]
    inputs = [t.detach().float().requires_grad_(True) for t in case.tensors]
    kwargs = {k: moved(v, "cpu", torch.float32) for k, v in case.kwargs.items()}
    args = operator_args(case.fn.__name__, [*inputs, *case.extra], dict(kwargs, reduction=reduction))
    torch.library.opcheck(operator(case.fn.__name__), args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["supcon", "clip", "nt_xent", "info_nce_hard_neg", "siglip", "gist", "neighbor"])
def test_inductor_fullgraph(name: str) -> None:
    case = CASES[name]
    eager = case.run("auto", "mean", dtype=torch.float32)
    _assert_same(_compiled(case, backend="inductor").run("auto", "mean", dtype=torch.float32), eager, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg"])
def test_half_precision_compiled_equals_eager(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    inputs = [t.detach().to(dtype).requires_grad_(True) for t in case.tensors]
    kwargs = {k: moved(v, "cpu", dtype) for k, v in case.kwargs.items()}
    torch.library.opcheck(
        operator(case.fn.__name__),
        operator_args(case.fn.__name__, [*inputs, *case.extra], kwargs),
        test_utils=("test_faketensor",),
    )
    torch._dynamo.reset()

    def run(f):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = f(*leaves, *case.extra, **kwargs)
        return out.detach(), torch.autograd.grad(out, leaves)

    got, want = run(torch.compile(case.fn, fullgraph=True, backend=AOT)), run(case.fn)
    assert got[0].dtype == want[0].dtype
    assert torch.equal(got[0], want[0])  # the same eager computation inside the operator
    for a, e in zip(got[1], want[1]):
        assert a.dtype == e.dtype and torch.equal(a, e)


def test_no_grad_forms_no_gradient_and_equals_eager() -> None:
    torch._dynamo.reset()
    x = torch.randn(12, 6, requires_grad=True)
    labels = torch.arange(12) % 3
    loss = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)
    with torch.no_grad():
        got = loss(x, labels)
        args = operator_args("supcon_loss", [x, labels], {})
    assert not got.requires_grad
    assert not any(args[-2])  # no input is marked for a gradient inside the operator
    assert_close(got, flashcl.supcon_loss(x.detach(), labels), "no_grad value", *TOL[torch.float32])


def test_an_option_its_slot_does_not_take_is_named_when_compiled() -> None:
    """The operator's arguments are typed: an option of another type is refused where the
    call is traced, naming the option and what it takes (eagerly: the loss's own error)."""
    torch._dynamo.reset()
    x, labels = torch.randn(8, 4), torch.arange(8) % 2
    with pytest.raises(TypeError, match="temperature"):
        flashcl.supcon_loss(x, labels, temperature="0.1")
    loss = torch.compile(flashcl.supcon_loss, fullgraph=True, backend=AOT)
    with pytest.raises(Exception, match="temperature of type str cannot enter a compiled flashcl loss"):
        loss(x, labels, temperature="0.1")
    with pytest.raises(Exception, match="matryoshka_dims of type int"):
        torch.compile(flashcl.clip_loss, fullgraph=True, backend=AOT)(x, x, 10.0, matryoshka_dims=4)


def test_each_loss_has_its_own_typed_operator() -> None:
    """One operator per public loss, its schema the loss's parameters, typed (a process
    group by its name); a number travels as a 0-dim tensor beside its kind."""
    from flashcl.compiled import LOSSES

    for name, fn in LOSSES.items():
        schema = str(operator(name)._schema)
        assert schema.startswith(f"flashcl::{name}("), schema
        for param in inspect.signature(fn).parameters:
            assert param in schema, (name, param)
        if "process_group" in inspect.signature(fn).parameters:
            assert "str? process_group" in schema, schema
    schema = str(operator("clip_loss")._schema)
    assert "Tensor? image_embeds" in schema and "str? reduction" in schema and "str logit_scale__kind" in schema
    assert "SymInt[]? matryoshka_dims" in schema and "float[]? matryoshka_weights" in schema
