"""The flex losses' formulas written out densely (float64), from the issue's definitions,
with nothing of flashcl's engine: the oracle of tests/test_flex*.py. The functions are
called once on the whole (M, N) matrix, with views shaped as the tiles' ((M, 1, ...) and
(1, N, ...))."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def views(rows: Dict[str, Tensor], cols: Dict[str, Tensor], m: int, n: int, row_base: int = 0) -> Any:
    a = SimpleNamespace(**{k: v.unsqueeze(1) for k, v in rows.items()})
    b = SimpleNamespace(**{k: v.unsqueeze(0) for k, v in cols.items()})
    a.index = (torch.arange(m) + row_base).unsqueeze(1)
    b.index = torch.arange(n).unsqueeze(0)
    return a, b


def rows_of(
    q: Tensor,
    k: Optional[Tensor],
    rows: Dict[str, Tensor],
    cols: Optional[Dict[str, Tensor]],
    positive: Optional[Callable[..., Any]] = None,
    exclude: Optional[Callable[..., Any]] = None,
    score_mod: Optional[Callable[..., Any]] = None,
    weight: Optional[Callable[..., Any]] = None,
    kind: str = "softmax",
    positives: str = "mean",
    include_self: bool = False,
    temperature: Any = 0.1,
    bias: Any = 0.0,
    normalize: bool = True,
    scores: Optional[Tensor] = None,
    pos_mod: Optional[Callable[..., Any]] = None,
    neg_mod: Optional[Callable[..., Any]] = None,
    constants: Optional[Dict[str, float]] = None,
) -> Any:
    """(each anchor's loss (M,), each anchor's counting in a "mean" (M,) bool); ``scores``:
    a given score matrix instead of ``q`` and ``k`` (self-contrast unless ``cols``).
    The row statistics are fields of the views (``b``'s with self-contrast);
    ``kind="multi_similarity"`` / ``"circle"`` with their ``constants`` (alpha, beta, base;
    m, gamma) as pytorch-metric-learning 2.9 writes them."""
    if scores is not None:
        own = cols is None
        cd = rows if own else cols
        s = scores / temperature
    else:
        own = k is None
        kk = q if own else k
        cd = rows if own else (cols or {})
        qn = F.normalize(q, dim=-1) if normalize else q
        kn = qn if own and normalize else (F.normalize(kk, dim=-1) if normalize else kk)
        s = qn @ kn.T / temperature
    m_, n_ = s.shape
    self_pair = torch.eye(m_, n_, dtype=torch.bool) if own else torch.zeros(m_, n_, dtype=torch.bool)
    a, b = views(rows, cd, m_, n_)
    stats = statistics(s.detach(), positive, a, b, self_pair)
    a, b = views({**rows, **stats}, {**cd, **stats} if own else cd, m_, n_)
    out = torch.zeros(m_, n_, dtype=torch.bool)
    if not include_self:
        out |= self_pair
    if exclude is not None:
        takes_s = len(inspect.signature(exclude).parameters) >= 3
        out |= (exclude(a, b, s.detach()) if takes_s else exclude(a, b)).expand(m_, n_)
    m = (positive(a, b) if positive is not None else a.index == b.index).expand(m_, n_).to(s.dtype)
    m = torch.where(out | self_pair, torch.zeros_like(m), m)  # the self pair is never a positive
    sp = s if score_mod is None else score_mod(s, a, b).expand(m_, n_)
    w = torch.ones_like(s) if weight is None else weight(a, b).expand(m_, n_).to(s.dtype)
    if kind in ("multi_similarity", "circle"):
        return _two_sets(s, a, b, m > 0, ~(out | self_pair) & (m == 0), w, kind, constants or {}, pos_mod, neg_mod)
    if kind == "sigmoid":
        t = sp + bias
        terms = w * (m * _softplus(-t) + (1 - m) * _softplus(t))
        return torch.where(out, torch.zeros_like(terms), terms).sum(1), torch.ones(m_, dtype=torch.bool)
    z = torch.where(out | (w == 0), torch.full_like(sp, float("-inf")), sp + torch.log(w))
    has_den = ~torch.isneginf(z).all(1)
    lse = torch.logsumexp(torch.where(has_den.unsqueeze(1), z, torch.zeros_like(z)), 1)
    per_pair = m * (lse.unsqueeze(1) - torch.where(m > 0, sp, torch.zeros_like(sp)))
    npos, msum = (m > 0).sum(1), m.sum(1)
    if positives == "sum":
        loss = lse - (m * torch.where(m > 0, sp, torch.zeros_like(sp))).sum(1)
        valid = has_den
    elif positives == "mean":
        loss = per_pair.sum(1) / npos.clamp_min(1)
        valid = has_den & (npos > 0)
    elif positives == "weighted_mean":
        loss = per_pair.sum(1) / torch.where(msum > 0, msum, torch.ones_like(msum))
        valid = has_den & (msum > 0)
    else:  # pairs
        loss = per_pair.sum(1)
        valid = has_den & (npos > 0)
    return torch.where(valid, loss, torch.zeros_like(loss)), valid


def statistics(s: Tensor, positive: Any, a: Any, b: Any, self_pair: Tensor) -> Dict[str, Tensor]:
    """Each anchor's hardest positive (lowest s), hardest negative (highest s among the
    other pairs) and weighted mean positive score, the self pair left out; +inf (-inf)
    for none."""
    m = (positive(a, b) if positive is not None else a.index == b.index).expand(s.shape).to(s.dtype)
    m = torch.where(self_pair, torch.zeros_like(m), m)
    pos, neg = m > 0, (m == 0) & ~self_pair
    inf = torch.tensor(float("inf"), dtype=s.dtype)
    msum = m.sum(1)
    mean = (m * torch.where(pos, s, torch.zeros_like(s))).sum(1) / torch.where(msum > 0, msum, torch.ones_like(msum))
    return {
        "hardest_positive": torch.where(pos, s, inf).amin(1),
        "hardest_negative": torch.where(neg, s, -inf).amax(1),
        "positive_score": torch.where(msum > 0, mean, inf),
    }


def _two_sets(
    s: Tensor, a: Any, b: Any, pos: Tensor, neg: Tensor, w: Tensor, kind: str, c: Dict[str, float], pm: Any, nm: Any
) -> Any:
    """Multi-Similarity or Circle over the sets ``pos`` and ``neg``, each term weighted by ``w``."""
    ninf = torch.full_like(s, float("-inf"))
    lw = torch.log(w)
    if kind == "multi_similarity":
        alpha, beta, base = c.get("alpha", 2.0), c.get("beta", 50.0), c.get("base", 0.5)
        xp = pm(s, a, b) if pm is not None else -alpha * (s - base)
        xn = nm(s, a, b) if nm is not None else beta * (s - base)
        zero = torch.zeros(s.shape[0], 1, dtype=s.dtype)
        lp = torch.logsumexp(torch.cat([torch.where(pos, xp + lw, ninf), zero], 1), 1)
        ln = torch.logsumexp(torch.cat([torch.where(neg, xn + lw, ninf), zero], 1), 1)
        return lp / alpha + ln / beta, torch.ones(s.shape[0], dtype=torch.bool)
    m, gamma = c.get("m", 0.4), c.get("gamma", 80.0)
    ap = torch.relu(-s.detach() + 1 + m)
    an = torch.relu(s.detach() + m)
    xp = pm(s, a, b) if pm is not None else -ap * (s - (1 - m)) * gamma
    xn = nm(s, a, b) if nm is not None else an * (s - m) * gamma
    has = pos.any(1) & neg.any(1)
    lp = torch.logsumexp(torch.where(pos, xp + lw, ninf), 1)
    ln = torch.logsumexp(torch.where(neg, xn + lw, ninf), 1)
    loss = _softplus(torch.where(has, lp + ln, torch.zeros_like(lp)))
    return torch.where(has, loss, torch.zeros_like(loss)), has


def reduce(loss: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp_min(1)


def _softplus(t: Tensor) -> Tensor:
    """``log(1 + e^t)`` without F.softplus's cut-off (linear above t = 20)."""
    return torch.logaddexp(t, torch.zeros_like(t))


def positives_forms(request: Any, monkeypatch: Any) -> None:
    """The flex head's two forms of binary positives, for a parametrized autouse fixture:
    ``"as_needed"`` (sparse while at most 1/16 of a tile is positive, the default) and
    ``"sparse"`` (always: the small tiles of the tests are otherwise mostly dense)."""
    from flashcl.losses import flex_head as flex

    if request.param == "sparse":
        monkeypatch.setattr(flex, "SPARSE_POSITIVES_MAX_DENSITY", 1.0)


def sample_data(seed: int, m: int = 13, n: int = 17, d: int = 6) -> Dict[str, Any]:
    """Embeddings and per-sample data of the flex tests (float64, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(m, d, generator=g, dtype=torch.float64),
        "k": torch.randn(n, d, generator=g, dtype=torch.float64),
        "y": torch.randint(0, 4, (m,), generator=g),
        "ky": torch.randint(0, 4, (n,), generator=g),
        "t": torch.randn(m, generator=g, dtype=torch.float64).cumsum(0),
        "soft": torch.rand(m, 3, generator=g, dtype=torch.float64),
        "ksoft": torch.rand(n, 3, generator=g, dtype=torch.float64),
        "doc": torch.randint(0, 5, (m,), generator=g),
        "kdoc": torch.randint(0, 5, (n,), generator=g),
    }


#: the flex tests' tolerances (float64) and backends with their block sizes
TOL = (1e-10, 1e-9)
BACKENDS = [("reference", None), ("dense", None), ("tiled", 5), ("tiled", None)]


def grads(loss: Tensor, leaves: Any, up: Any = None) -> Any:
    """``loss``'s gradients with respect to ``leaves`` (zeros where it does not reach one)."""
    got = torch.autograd.grad(loss, leaves, up, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)]
