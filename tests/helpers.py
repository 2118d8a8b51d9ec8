"""Helpers the tests share: one tolerance table, a comparison that names the worst
index, the table of cases over every loss and option, and the comparison with
the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch

import flashcl

# Absolute/relative tolerance per dtype, for a fast backend against the float64 reference.
TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-5),
}

BACKENDS = ("dense", "tiled")
REDUCTIONS = ("mean", "sum", "none")


def spawn(fn: Any, args: tuple, nprocs: int, join: bool = True) -> None:
    """``torch.multiprocessing.spawn`` for the tests' workers, by fork where the platform
    has it: a child does not import torch, flashcl and the test's peers again (a
    spawned one does, about a second of CPU each, for each of the suite's ~40 process
    groups). The workers set one thread each (:func:`init_gloo`) before any parallel op."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=method)


def init_gloo(rank: int, world: int, out_dir: str) -> None:
    """A test worker's gloo process group, rendezvous through a file in ``out_dir``
    (no port to pick), one thread per process."""
    import datetime
    import os

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)


def close_group() -> None:
    """Ends a test's process group on every rank together, after freeing what no
    longer refers to it: a gloo group freed during interpreter shutdown, or while a
    peer still runs, can abort the process."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    """Like torch.testing.assert_close, but the message names the worst index."""
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    err = torch.where(both_nan, torch.zeros_like(actual), (actual - expected).abs())
    bound = atol + rtol * expected.abs()
    excess = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err - bound)
    if excess.numel() and float(excess.max()) > 0:
        flat = int(excess.reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape)) if actual.dim() else ()
        raise AssertionError(
            f"{what}: worst index {idx}: got {float(actual[idx]):.10g}, "
            f"expected {float(expected[idx]):.10g} (|err| {float(err[idx]):.3g}, "
            f"atol {atol}, rtol {rtol})"
        )


@dataclass
class Case:
    """One call of a flashcl loss: the function, its inputs (the differentiable ones
    first) and its keyword arguments."""

    name: str
    fn: Callable[..., torch.Tensor]
    tensors: List[torch.Tensor]
    extra: List[Any] = field(default_factory=list)
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # name of the keyword holding a learnable scalar, if any
    scalar_kw: str = ""
    # the Triton kernels compute it (False: masks computed from the data, no kernel)
    kernels: bool = True

    def run(
        self,
        backend: str,
        reduction: str,
        dtype: torch.dtype = torch.float64,
        grad_seed: int = 0,
        device: str = "cpu",
        **more: Any,
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Loss and the gradients of (loss * w).sum() w.r.t. every float input,
        with a fixed random w (so grad_output != 1); all returned on the CPU."""
        inputs = [t.detach().to(device=device, dtype=dtype).requires_grad_(True) for t in self.tensors]
        extra = [x.to(device) if isinstance(x, torch.Tensor) else x for x in self.extra]
        kwargs = {k: moved(v, device, dtype) for k, v in dict(self.kwargs, **more).items()}
        scalar = None
        if self.scalar_kw:
            scalar = torch.tensor(float(kwargs[self.scalar_kw]), dtype=torch.float64, device=device, requires_grad=True)
            kwargs[self.scalar_kw] = scalar
        loss = self.fn(*inputs, *extra, reduction=reduction, backend=backend, **kwargs)
        g = torch.Generator().manual_seed(grad_seed)
        w = torch.rand(loss.shape, generator=g, dtype=torch.float64).to(device=loss.device, dtype=loss.dtype) + 0.5
        wrt = inputs + ([scalar] if scalar is not None else [])
        grads = torch.autograd.grad((loss * w).sum(), wrt)
        return loss.detach().cpu(), [gr.detach().cpu() for gr in grads]


def moved(value: Any, device: str, dtype: torch.dtype) -> Any:
    """A keyword argument on the run's device: floating tensors (keys without
    gradient) in the run's dtype, tuples (a guide model's embeddings) moved only."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, tuple):
        return tuple(v.to(device) for v in value)
    return value


def _labels(n: int, classes: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=g)


def make_cases(seed: int = 0, scale: int = 1) -> List[Case]:
    """Every loss and option, at odd sizes (scale multiplies the batch sizes)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b = 13 * scale
    lab = _labels(b, 4, g)
    lab_singletons = torch.cat([torch.tensor([100, 101]), _labels(b - 2, 3, g)])
    n = 11 * scale
    cases = [
        Case("supcon", flashcl.supcon_loss, [r(b, 6)], [lab], {"temperature": 0.3}, "temperature"),
        Case(
            "supcon_sum_self",
            flashcl.supcon_loss,
            [r(b, 6)],
            [lab],
            {"temperature": 0.05, "positives": "sum", "include_self": True},
            "temperature",
        ),
        Case("supcon_sum", flashcl.supcon_loss, [r(b, 6)], [lab_singletons], {"temperature": 0.2, "positives": "sum"}),
        Case("supcon_no_pos_anchors", flashcl.supcon_loss, [r(b, 6)], [lab_singletons], {"temperature": 0.2}),
        # 2 * max|s| = 2000 > 700: the tiled self-contrast path cannot use the fixed
        # exp shift and falls back to per-row maxima.
        Case("supcon_tiny_temperature", flashcl.supcon_loss, [r(b, 6)], [lab], {"temperature": 0.001}),
        Case(
            "supcon_views",
            flashcl.supcon_loss,
            [r(5 * scale, 3, 6)],
            [_labels(5 * scale, 2, g)],
            {"temperature": 0.5},
            "temperature",
        ),
        Case(
            "supcon_unnormalized", flashcl.supcon_loss, [0.3 * r(b, 6)], [lab], {"temperature": 0.7, "normalize": False}
        ),
        Case(
            "nt_xent", flashcl.nt_xent_loss, [r(7 * scale, 6), r(7 * scale, 6)], [], {"temperature": 0.2}, "temperature"
        ),
        Case(
            "info_nce",
            flashcl.info_nce_loss,
            [r(9 * scale, 6), r(9 * scale, 6)],
            [],
            {"temperature": 0.1},
            "temperature",
        ),
        Case(
            "info_nce_hard_neg",
            flashcl.info_nce_loss,
            [r(9 * scale, 6), r(9 * scale + 8, 6)],
            [torch.randint(0, 9 * scale + 8, (9 * scale,), generator=g)],
            {"temperature": 0.1},
        ),
        Case("clip", flashcl.clip_loss, [r(10 * scale, 6), r(10 * scale, 6)], [], {"logit_scale": 7.0}, "logit_scale"),
        # 2 * max|s| > 700: the tiled paths fall back from the fixed exp shift to row maxima
        Case("clip_large_scale", flashcl.clip_loss, [r(10 * scale, 6), r(10 * scale, 6)], [], {"logit_scale": 400.0}),
        Case(
            "info_nce_tiny_temperature",
            flashcl.info_nce_loss,
            [r(9 * scale, 6), r(12 * scale, 6)],
            [],
            {"temperature": 0.002},
        ),
        Case(
            "clip_labels",
            flashcl.clip_loss,
            [r(10 * scale, 6), r(10 * scale, 6)],
            [],
            {"logit_scale": 5.0, "labels": _labels(10 * scale, 4, g)},
            "logit_scale",
        ),
        Case(
            "siglip",
            flashcl.siglip_loss,
            [0.4 * r(10 * scale, 6), 0.4 * r(10 * scale, 6)],
            [],
            {"logit_scale": 3.0, "logit_bias": -1.5},
            "logit_scale",
        ),
        Case(
            "siglip_labels_normalized",
            flashcl.siglip_loss,
            [r(10 * scale, 6), r(10 * scale, 6)],
            [],
            {"logit_scale": 8.0, "logit_bias": -4.0, "labels": _labels(10 * scale, 3, g), "normalize": True},
        ),
        Case("neighbor", flashcl.neighbor_loss, [r(n, n)], [flashcl.sample_neighbors(n, 3, generator=g)], {}),
        Case(
            "neighbor_diag_repeats",
            flashcl.neighbor_loss,
            [r(n, n)],
            [torch.stack([torch.arange(n), torch.arange(n), torch.zeros(n, dtype=torch.long)], 1)],
            {"exclude_diagonal": True},
        ),
        Case(
            "neighbor_with_diag",
            flashcl.neighbor_loss,
            [r(n, n)],
            [flashcl.sample_neighbors(n, 2, generator=g)],
            {"exclude_diagonal": False},
        ),
    ]
    cases += _beyond_the_batch_cases(g, scale)
    cases += _matryoshka_cases(g, scale)
    return cases


def _matryoshka_cases(g: torch.Generator, scale: int) -> List[Case]:
    """Every prefix width in one pass (the reference: one call per width)."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b = 11 * scale
    return [
        Case(
            "supcon_matryoshka",
            flashcl.supcon_loss,
            [r(b, 6)],
            [_labels(b, 3, g)],
            {"temperature": 0.3, "matryoshka_dims": [6, 2, 4]},
            "temperature",
            kernels=False,
        ),
        Case(
            "info_nce_matryoshka",
            flashcl.info_nce_loss,
            [r(9 * scale, 6), r(14 * scale, 6)],
            [torch.randint(0, 14 * scale, (9 * scale,), generator=g)],
            {"temperature": 0.1, "matryoshka_dims": [1, 3, 6], "matryoshka_weights": [0.5, 1.0, 2.0]},
            kernels=False,
        ),
        Case(
            "clip_matryoshka",
            flashcl.clip_loss,
            [r(10 * scale, 6), r(10 * scale, 6)],
            [],
            {"logit_scale": 7.0, "matryoshka_dims": [4, 5], "labels": _labels(10 * scale, 4, g)},
            "logit_scale",
            kernels=False,
        ),
    ]


def _beyond_the_batch_cases(g: torch.Generator, scale: int) -> List[Case]:
    """Keys without gradient, labels across the two sides, the NT-Xent estimators
    and the guide model's false negatives."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b, n_ref = 13 * scale, 22 * scale
    lab = _labels(b, 4, g)
    ref_labels = _labels(n_ref, 4, g)
    ref_self = torch.randperm(n_ref, generator=g)[:b]
    ref_labels[ref_self] = lab  # the queue holds the batch: its labels at the anchors' slots
    ref_self[3] = -1  # and one anchor that is not in it
    q, k = 9 * scale, 12 * scale
    key_labels = _labels(k, 3, g)
    index = torch.randint(0, k, (q,), generator=g)
    labelled = {"temperature": 0.2, "query_labels": key_labels[index], "key_labels": key_labels}
    p = 10 * scale
    guide = (r(p, 4), r(p, 4))
    return [
        Case(
            "supcon_ref",
            flashcl.supcon_loss,
            [r(b, 6)],
            [lab],
            {"temperature": 0.3, "ref": r(17 * scale, 6), "ref_labels": _labels(17 * scale, 4, g)},
            "temperature",
        ),
        Case(
            "supcon_ref_self",
            flashcl.supcon_loss,
            [r(b, 6)],
            [lab],
            {"temperature": 0.3, "ref": r(n_ref, 6), "ref_labels": ref_labels, "ref_self": ref_self},
        ),
        Case(
            "info_nce_negatives",
            flashcl.info_nce_loss,
            [r(q, 6), r(q, 6)],
            [],
            {"temperature": 0.1, "negatives": r(14 * scale, 6)},
            "temperature",
        ),
        Case(
            "info_nce_moco",
            flashcl.info_nce_loss,
            [r(q, 6), r(q, 6)],
            [],
            {"temperature": 0.2, "negatives": r(14 * scale, 6), "in_batch_negatives": False},
        ),
        Case("info_nce_duplicates_mask", flashcl.info_nce_loss, [r(q, 6), r(k, 6)], [index], labelled, kernels=False),
        Case(
            "info_nce_duplicates_positive",
            flashcl.info_nce_loss,
            [r(q, 6), r(k, 6)],
            [index],
            dict(labelled, duplicates="positive"),
        ),
        Case(
            "nt_xent_debiased",
            flashcl.nt_xent_loss,
            [r(7 * scale, 6), r(7 * scale, 6)],
            [],
            {"temperature": 0.5, "estimator": "debiased", "tau_plus": 0.1},
            "temperature",
            kernels=False,
        ),
        Case(
            "nt_xent_hard",
            flashcl.nt_xent_loss,
            [r(7 * scale, 6), r(7 * scale, 6)],
            [],
            {"temperature": 0.5, "estimator": "hard", "tau_plus": 0.1, "beta": 1.0},
            "temperature",
            kernels=False,
        ),
        Case(
            "nt_xent_decoupled",
            flashcl.nt_xent_loss,
            [r(7 * scale, 6), r(7 * scale, 6)],
            [],
            {"temperature": 0.3, "decoupled": True},
            "temperature",
        ),
        Case(
            "nt_xent_dclw",
            flashcl.nt_xent_loss,
            [r(7 * scale, 6), r(7 * scale, 6)],
            [],
            {"temperature": 0.3, "decoupled": True, "weighting": "vmf", "sigma": 0.5},
        ),
        Case(
            "gist",
            flashcl.gist_loss,
            [r(p, 6), r(p, 6)],
            [],
            {"temperature": 0.1, "guide": guide},
            "temperature",
            kernels=False,
        ),
        Case(
            "gist_negative_relative",
            flashcl.gist_loss,
            [r(p, 6), r(p, 6), r(8 * scale, 6)],
            [],
            {
                "temperature": 0.05,
                "guide": guide + (r(8 * scale, 4),),
                "margin": 0.1,
                "margin_strategy": "relative",
                "contrast_positives": False,
            },
            kernels=False,
        ),
    ]


CASES = {c.name: c for c in make_cases()}


def compare_to_reference(
    case: Case,
    backend: str,
    reduction: str,
    dtype: torch.dtype,
    atol: float,
    rtol: float,
    device: str = "cpu",
    **more: Any,
) -> None:
    ref_loss, ref_grads = case.run("reference", reduction, torch.float64)
    loss, grads = case.run(backend, reduction, dtype, device=device, **more)
    assert_close(loss, ref_loss, f"{case.name}/{backend}/{reduction}: loss", atol, rtol)
    for i, (a, e) in enumerate(zip(grads, ref_grads)):
        assert_close(a, e, f"{case.name}/{backend}/{reduction}: grad of input {i}", atol, rtol)
