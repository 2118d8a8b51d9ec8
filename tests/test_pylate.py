"""flashcl.integrations.pylate against pylate's own loss classes, float64, on a small
token-embedding model with pylate's model attributes (skiplist, do_query_expansion):
Contrastive, CachedContrastive and Distillation with every constructor option,
padding of different lengths and skiplisted tokens, hard negatives, every backend: the
value and every parameter's gradient; gather_across_devices on 2 gloo processes."""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from helpers import assert_close, close_group, init_gloo, spawn

try:
    import pylate.losses as pl_losses
except ImportError as e:  # the true reason: pylate missing, or one of its own imports failing
    pytest.skip(f"pylate.losses cannot be imported: {type(e).__name__}: {e}", allow_module_level=True)
from flashcl.integrations import pylate as ours  # noqa: E402

BACKENDS = ("reference", "dense", "tiled")
SKIP = [3, 7]  # token ids the model's skiplist masks in documents


class TinyColBERT(nn.Module):
    """Token embeddings from token ids, with pylate's model attributes."""

    def __init__(self, do_query_expansion: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(20, 12).double()
        self.proj = nn.Linear(12, 8).double()
        self.skiplist = list(SKIP)
        self.do_query_expansion = do_query_expansion

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {"token_embeddings": self.proj(torch.tanh(self.embed(features["input_ids"])))}


def tokenized(rows: int, length: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (rows, length), generator=g)
    attention = (torch.arange(length) < torch.randint(1, length + 1, (rows, 1), generator=g)).long()
    return {"input_ids": ids, "attention_mask": attention}


def one_step(loss: Any, features: List[Dict[str, torch.Tensor]], labels: Any = None) -> tuple:
    """The value and every parameter's gradient of one backward pass."""
    loss.model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = loss(features, labels)
        value.backward()
    return value.detach(), [p.grad.clone() for p in loss.model.parameters()]


def _same(got: tuple, want: tuple, what: str) -> None:
    assert_close(got[0], want[0], f"{what}: value", 1e-12, 1e-10)
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        assert_close(a, b, f"{what}: parameter {i} grad", 1e-12, 1e-10)


CONTRASTIVE = [
    {},
    {"temperature": 0.05},
    {"size_average": False, "temperature": 0.5},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", CONTRASTIVE, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("expansion", [False, True], ids=["query-mask", "query-expansion"])
@pytest.mark.parametrize("columns", [1, 2], ids=["positives", "hard-negatives"])
def test_contrastive_equals_pylate(backend: str, options: Dict[str, Any], expansion: bool, columns: int) -> None:
    b = 3
    features = [tokenized(b, 5, 0)] + [tokenized(b, 7, 1 + c) for c in range(columns)]
    model = TinyColBERT(expansion)
    want = one_step(pl_losses.Contrastive(model, **options), features)
    got = one_step(ours.Contrastive(model, **options, backend=backend, block_size=2), features)
    _same(got, want, f"Contrastive {options}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size_average", [True, False])
def test_cached_contrastive_equals_pylate(backend: str, size_average: bool) -> None:
    b = 5
    features = [tokenized(b, 5, 3), tokenized(b, 6, 4), tokenized(b, 6, 5)]
    model = TinyColBERT()
    options = {"mini_batch_size": 2, "size_average": size_average, "temperature": 0.1}
    want = one_step(pl_losses.CachedContrastive(model, **options), features)
    got = one_step(ours.CachedContrastive(model, **options, backend=backend), features)
    _same(got, want, f"CachedContrastive size_average={size_average}")
    # the plain loss's value, and its gradient up to pylate's caching of the sum's
    plain = one_step(ours.Contrastive(model, size_average=size_average, temperature=0.1), features)
    assert_close(got[0], plain[0], "cached = plain value", 1e-12, 1e-10)
    factor = b if size_average else 1
    assert_close(got[1][1], plain[1][1] * factor, "cached = the sum's gradient", 1e-12, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"normalize_scores": False}, {"size_average": False}], ids=str)
@pytest.mark.parametrize("expansion", [False, True], ids=["query-mask", "query-expansion"])
def test_distillation_equals_pylate(backend: str, options: Dict[str, Any], expansion: bool) -> None:
    b, n = 3, 4
    features = [tokenized(b, 5, 6), tokenized(b * n, 7, 7)]
    labels = torch.randn(b, n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    model = TinyColBERT(expansion)
    want = one_step(pl_losses.Distillation(model, **options), features, labels)
    got = one_step(ours.Distillation(model, **options, backend=backend, block_size=2), features, labels)
    _same(got, want, f"Distillation {options}")


def test_distillation_with_a_teacher_score_of_minus_inf_is_finite() -> None:
    """A ruled-out candidate (teacher score -inf) has target probability 0: the drop-in
    gives the formula's finite value and gradients (pylate's KLDivLoss(log_target=True)
    gives NaN there: exp(-inf) x (-inf - input)); elsewhere it equals pylate."""
    b, n = 3, 4
    features = [tokenized(b, 5, 6), tokenized(b * n, 7, 7)]
    labels = torch.randn(b, n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    model = TinyColBERT()
    finite = one_step(ours.Distillation(model, normalize_scores=False), features, labels)
    _same(finite, one_step(pl_losses.Distillation(model, normalize_scores=False), features, labels), "finite labels")
    ruled = labels.clone()
    ruled[0, 2] = ruled[1, 0] = float("-inf")
    value, grads = one_step(ours.Distillation(model, normalize_scores=False), features, ruled)
    assert bool(torch.isfinite(value)) and all(bool(torch.isfinite(g).all()) for g in grads)
    # the formula: the student's MaxSim softmax over every candidate, the teacher's over the finite ones
    q = torch.nn.functional.normalize(model(features[0])["token_embeddings"], dim=-1)
    docs = torch.nn.functional.normalize(model(features[1])["token_embeddings"], dim=-1).view(b, n, 7, -1)
    from pylate.scores import colbert_kd_scores

    qmask = features[0]["attention_mask"]
    dmask = (features[1]["attention_mask"] * ~torch.isin(features[1]["input_ids"], torch.tensor(SKIP))).view(b, n, 7)
    scores = colbert_kd_scores(q, docs, queries_mask=qmask, documents_mask=dmask)
    student = torch.log_softmax(scores, -1)
    want = 0.0
    for i in range(b):
        keep = torch.isfinite(ruled[i])
        p = torch.softmax(ruled[i, keep], 0)
        want = want + (p * (p.log() - student[i, keep])).sum()
    assert_close(value, (want / b).detach(), "the formula", 1e-12, 1e-10)
    ruled[2] = float("-inf")
    with pytest.raises(ValueError, match="all -inf"):
        ours.Distillation(model)(features, ruled)


def test_a_subclass_of_colbert_scores_is_honoured() -> None:
    """A ColBERTScores subclass that overrides __call__ is pylate's computation (with a
    warning), not silently the default; one that overrides nothing is flashcl's."""
    from pylate.scores import ColBERTScores

    class Doubled(ColBERTScores):
        def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return 2 * super().__call__(*args, **kwargs)

    class Same(ColBERTScores):
        pass

    features = [tokenized(3, 5, 0), tokenized(3, 7, 1)]
    model = TinyColBERT()
    for cls in ("Contrastive", "CachedContrastive"):
        extra: Dict[str, Any] = {"mini_batch_size": 2} if cls == "CachedContrastive" else {}
        want = one_step(getattr(pl_losses, cls)(model, score_metric=Doubled(), **extra), features)
        with pytest.warns(UserWarning, match="pylate's own implementation"):
            mine = getattr(ours, cls)(model, score_metric=Doubled(), **extra)
            got = (mine(features, None).detach(), None)
        assert_close(got[0], want[0], f"{cls}: a subclass that doubles the scores", 1e-12, 1e-10)
        default = one_step(getattr(pl_losses, cls)(model, **extra), features)
        assert not torch.allclose(want[0], default[0]), "the override changes the value"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback for a subclass that changes nothing
            same = one_step(getattr(ours, cls)(model, score_metric=Same(), **extra), features)
        _same(same, default, f"{cls}: a subclass that overrides nothing")


def test_a_missing_dependency_of_pylate_is_named() -> None:
    """pylate installed, one of its own imports failing: the error says so, not 'needs pylate'."""
    from flashcl.base import peer_import_error

    missing = ModuleNotFoundError("No module named 'datasets'", name="datasets")
    message = str(peer_import_error("pylate", "pylate", "pylate", missing))
    assert "installed but failed to import" in message and "datasets" in message
    absent = ModuleNotFoundError("No module named 'pylate'", name="pylate")
    assert "needs pylate (pip install pylate)" in str(peer_import_error("pylate", "pylate", "pylate", absent))


def test_a_custom_score_metric_is_pylates_with_a_warning() -> None:
    from pylate.scores import colbert_kd_scores

    calls = []

    def metric(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return colbert_kd_scores(*args, **kwargs)

    features = [tokenized(2, 5, 9), tokenized(4, 7, 10)]
    labels = torch.randn(2, 2, dtype=torch.float64)
    model = TinyColBERT()
    with pytest.warns(UserWarning, match="pylate's own implementation"):
        value = ours.Distillation(model, score_metric=metric)(features, labels)
    assert calls and torch.isfinite(value)


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    model = TinyColBERT()
    features = [tokenized(3, 5, 20 + rank), tokenized(3, 6, 30 + rank), tokenized(3, 6, 40 + rank)]
    results = {}
    for name, cls in (("Contrastive", "Contrastive"), ("Cached", "CachedContrastive")):
        options: Dict[str, Any] = {"gather_across_devices": True, "temperature": 0.2}
        if name == "Cached":
            options["mini_batch_size"] = 2
        results[name] = (
            one_step(getattr(pl_losses, cls)(model, **options), features),
            one_step(getattr(ours, cls)(model, **options, backend="tiled"), features),
        )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def test_gather_across_devices_equals_pylate_on_two_processes(tmp_path) -> None:
    spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, (want, got) in results.items():
            _same(got, want, f"{name}, rank {rank}")


@pytest.mark.parametrize("cls", ["Contrastive", "CachedContrastive", "Distillation"])
def test_flashcl_options_are_checked_when_made(cls: str) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        getattr(ours, cls)(TinyColBERT(), backend="triton")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        getattr(ours, cls)(TinyColBERT(), block_size=-1)
