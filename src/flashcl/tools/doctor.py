"""``flashcl doctor``: tell a user why their own loss is slow.

Runs a loss function at several input sizes and reports forward/backward time,
peak memory and how they grow, inspects the autograd graph (nodes by type,
largest saved tensors), flags the patterns that make backward slow with the
fix for each, and, where the function computes a loss flashcl has, names the
call that replaces it with the measured speedup.

    >>> def my_loss(x):   # a softmax cross-entropy on the diagonal, through exp and log
    ...     return -torch.log(torch.exp(x.diagonal()) / torch.exp(x).sum(1)).sum()
    >>> report = flashcl.doctor(my_loss, torch.randn(64, 64, requires_grad=True), repeats=3)
    >>> [f.pattern for f in report.findings]
    ['exp followed by log', 'an n x n matrix held for backward']
    >>> text = report.text()   # the whole report, for people; report.to_json() for tools
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .families import candidates as _candidates
from .families import families as _families
from .families import flex_template
from .procmem import reset_peak, status_mb

LossFn = Callable[..., Tensor]

# Graph node types that element-wise indexing in Python loops leaves behind.
_INDEXING_NODES = (
    "CopySlices",
    "SelectBackward",
    "IndexBackward",
    "AsStridedBackward",
    "SliceBackward",
    "IndexPutBackward",
    "UnbindBackward",
)


@dataclass
class SizeRun:
    size: int
    forward_s: float
    backward_s: float
    peak_mb: Optional[float]
    graph_nodes: int
    loss: float
    #: gradient elements the backward pass writes (the sum over the graph's edges
    #: of each gradient's size): a measure of backward work that does not depend
    #: on the machine's speed
    backward_elements: int = 0


@dataclass
class Finding:
    pattern: str
    evidence: str
    fix: str


@dataclass
class Replacement:
    """The flashcl call that computes the same loss, and forward+backward times of
    both, measured alternately (``user_times[i]`` beside ``flashcl_times[i]``)."""

    call: str
    loss: float
    user_times: List[float]
    flashcl_times: List[float]

    @property
    def user_s(self) -> float:
        return statistics.median(self.user_times)

    @property
    def flashcl_s(self) -> float:
        return statistics.median(self.flashcl_times)

    @property
    def speedup(self) -> float:
        """Median of the per-round ratios user / flashcl."""
        return statistics.median(self._ratios())

    @property
    def speedup_range(self) -> Tuple[float, float]:
        """(smallest, largest) per-round ratio: the spread of :attr:`speedup`."""
        ratios = self._ratios()
        return min(ratios), max(ratios)

    def _ratios(self) -> List[float]:
        return [u / f if f > 0 else math.inf for u, f in zip(self.user_times, self.flashcl_times)]


@dataclass
class CandidateCheck:
    """A user's candidate (a flex call, say) against their function at one size:
    the two values, the largest gradient difference relative to the function's
    largest gradient entry and where it is (``input i[index]``)."""

    size: int
    loss: float
    candidate_loss: float
    grad_error: float
    where: str
    same: bool


@dataclass
class Report:
    """What :func:`doctor` found; ``text()`` for people, ``to_json()`` for tools."""

    runs: List[SizeRun]
    forward_exponent: Optional[float]
    backward_exponent: Optional[float]
    nodes_exponent: Optional[float]
    #: growth of :attr:`SizeRun.backward_elements` (deterministic)
    backward_elements_exponent: Optional[float]
    nodes_by_type: Dict[str, int]
    largest_saved: List[Tuple[str, List[int], float]]
    findings: List[Finding] = field(default_factory=list)
    replacement: Optional[Replacement] = None
    #: what the search for a replacement compared (when none matched: why not)
    tried: List[str] = field(default_factory=list)
    #: when nothing matched: the loss as a flex call in the function's names, to fill in
    flex_template: Optional[str] = None
    #: ``candidate=``: the candidate against the function at each size
    candidate_checks: List[CandidateCheck] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        if self.replacement is not None:
            r = self.replacement
            d["replacement"].update(
                user_s=r.user_s, flashcl_s=r.flashcl_s, speedup=r.speedup, speedup_range=list(r.speedup_range)
            )
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def text(self) -> str:
        lines = [
            "flashcl doctor",
            "",
            "size      forward     backward    peak mem    graph nodes  backward grad elements",
        ]
        for r in self.runs:
            mem = f"{r.peak_mb:8.1f} MB" if r.peak_mb is not None else "       n/a"
            lines.append(
                f"{r.size:<9} {r.forward_s * 1e3:9.1f} ms {r.backward_s * 1e3:9.1f} ms {mem}  "
                f"{r.graph_nodes:>10}  {r.backward_elements:>22}"
            )
        if self.backward_exponent is not None:

            def power(value: Optional[float]) -> str:
                return "n/a" if value is None else f"n^{value:.1f}"

            lines.append(
                f"growth over the last size step: forward ~ {power(self.forward_exponent)}, backward ~ "
                f"{power(self.backward_exponent)}, graph nodes ~ {power(self.nodes_exponent)}, backward "
                f"gradient elements ~ {power(self.backward_elements_exponent)}"
            )
        top = sorted(self.nodes_by_type.items(), key=lambda kv: -kv[1])[:8]
        lines += ["", "autograd graph at the largest size, nodes by type: " + ", ".join(f"{k} x{v}" for k, v in top)]
        if self.largest_saved:
            lines.append(
                "largest tensors saved for backward: "
                + ", ".join(f"{name} {tuple(shape)} {mb:.1f} MB" for name, shape, mb in self.largest_saved[:4])
            )
        lines.append("")
        if not self.findings:
            lines.append("no slow pattern found")
        for f in self.findings:
            lines += [f"[!] {f.pattern}", f"    seen: {f.evidence}", f"    fix:  {f.fix}"]
        if self.replacement is not None:
            rep = self.replacement
            lo, hi = rep.speedup_range
            lines += [
                "",
                f"same loss and gradient as: {rep.call}",
                f"    loss {rep.loss:.6g}; forward+backward {rep.user_s * 1e3:.1f} ms -> "
                f"{rep.flashcl_s * 1e3:.1f} ms at the largest size (medians of {len(rep.user_times)} "
                f"alternating runs): {speed_words(rep.speedup)} (per-run ratios {lo:.2g}x-{hi:.2g}x)",
            ]
        elif self.tried:
            lines += ["", "no flashcl loss matched the value and gradient at every size; tried:"]
            lines += [f"    {t}" for t in self.tried]
        if self.candidate_checks:
            lines += ["", "your candidate against your function (value; gradient: largest difference / largest entry):"]
            for c in self.candidate_checks:
                verdict = "same" if c.same else "DIFFERS"
                lines.append(
                    f"    n = {c.size:<6} loss {c.loss:.8g} vs {c.candidate_loss:.8g}; gradient {c.grad_error:.2g} "
                    f"(worst at {c.where}): {verdict}"
                )
        if self.flex_template is not None and self.replacement is None:
            lines += [
                "",
                "as a flex loss in your names (exact, O(batch) memory): fill in the functions, then check it",
                "with flashcl.doctor(your_loss, ..., candidate=lambda ...: <this call>) or --candidate:",
                "",
                self.flex_template,
            ]
        return "\n".join(lines)


def speed_words(ratio: float) -> str:
    """``user time / flashcl time`` in words: "12x faster", "1.5x slower"."""
    if ratio >= 1:
        return f"{ratio:.2g}x faster" if ratio < 10 else f"{ratio:.0f}x faster"
    return f"{1 / ratio:.2g}x slower"


# ----------------------------------------------------------------------------- inputs


def scale_inputs(example: Sequence[Any], size: int, seed: int = 0) -> List[Any]:
    """Inputs like ``example`` with every dimension equal to the example's batch
    size (dim 0 of the first tensor) replaced by ``size``: random normal floats
    (keeping requires_grad), random integers in the example's range."""
    first = next(t for t in example if isinstance(t, Tensor))
    base = first.shape[0]
    g = torch.Generator().manual_seed(seed)
    out: List[Any] = []
    for t in example:
        if not isinstance(t, Tensor):
            out.append(t)
            continue
        shape = [size if s == base else s for s in t.shape]
        if t.is_floating_point():
            x = torch.randn(shape, generator=g, dtype=t.dtype)
            out.append(x.requires_grad_(t.requires_grad))
        else:
            hi = int(t.max()) + 1 if t.numel() else 1
            lo = min(int(t.min()), 0) if t.numel() else 0
            if hi == base:  # indices into the batch scale with it
                hi = size
            out.append(torch.randint(lo, max(hi, lo + 1), shape, generator=g, dtype=t.dtype))
    return out


# ----------------------------------------------------------------------------- graph


def _walk(root: Any) -> List[Any]:
    seen, stack, nodes = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return nodes


def counts_gradient_elements() -> bool:
    """Whether this torch's autograd nodes give their inputs' shapes (``_input_metadata``,
    newer releases): without them the gradient elements of a backward pass are not
    counted (reported as n/a)."""
    x = torch.ones(2, requires_grad=True)
    node = (x * 2).sum().grad_fn
    return node is not None and hasattr(node, "_input_metadata")


def _backward_elements(nodes: List[Any]) -> int:
    """Gradient elements a backward pass over ``nodes`` writes: for every edge, the
    size of the gradient sent along it (the next node's input metadata). Element-wise
    indexing shows here: each selected element sends back a gradient of its
    source's full size."""
    total = 0
    for node in nodes:
        for nxt, slot in getattr(node, "next_functions", ()):
            meta = getattr(nxt, "_input_metadata", None) if nxt is not None else None
            if meta and slot < len(meta):
                total += math.prod(getattr(meta[slot], "shape", ()) or (1,))
    return total


def _base_name(node: Any) -> str:
    return re.sub(r"\d+$", "", type(node).__name__)


def _saved_tensors(node: Any) -> List[Tuple[str, Tensor]]:
    out = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                v = getattr(node, attr)
            except Exception:  # noqa: BLE001 - some saved values raise once freed
                continue
            if isinstance(v, Tensor):
                out.append((f"{_base_name(node)}.{attr[7:]}", v))
    return out


def _reaches(node: Any, names: Tuple[str, ...], depth: int) -> bool:
    """Does a path of at most ``depth`` edges from node reach a node named in names?"""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for child, _ in getattr(n, "next_functions", ()):
                if child is None:
                    continue
                if _base_name(child) in names:
                    return True
                nxt.append(child)
        frontier = nxt
    return False


def _graph_findings(nodes: List[Any], size: int, nodes_exponent: Optional[float]) -> List[Finding]:
    findings = []
    by_type: Dict[str, int] = {}
    for n in nodes:
        by_type[_base_name(n)] = by_type.get(_base_name(n), 0) + 1
    indexing = sum(v for k, v in by_type.items() if k.startswith(_INDEXING_NODES))
    if indexing >= max(64, size // 2):
        findings.append(
            Finding(
                "element-wise indexing/assignment in Python loops",
                f"{indexing} index/select/copy-slices nodes in the graph at n = {size}; in backward each one "
                "builds a gradient of its source's full size, so backward costs O(nodes x n^2)",
                "index all at once: x.gather(1, idx), x.index_select, or a boolean mask",
            )
        )
    if nodes_exponent is not None and nodes_exponent > 0.7:
        findings.append(
            Finding(
                "a Python loop over the batch",
                f"the autograd graph grows with the batch (nodes ~ n^{nodes_exponent:.1f})",
                "vectorise: one matmul for all scores, masks for positives, logsumexp over rows",
            )
        )
    exp_log = [n for n in nodes if _base_name(n) == "LogBackward" and _reaches(n, ("ExpBackward",), 3)]
    if exp_log:
        findings.append(
            Finding(
                "exp followed by log",
                f"{len(exp_log)} log node(s) fed by exp within 3 steps: overflows past ~88 in float32",
                "stay in log space: log(exp(a) / b) = a - log(b), and torch.logsumexp for log(sum(exp))",
            )
        )
    diag_sub = [
        n
        for n in nodes
        if _base_name(n) == "SubBackward" and _reaches(n, ("SumBackward",), 1) and _reaches(n, ("DiagonalBackward",), 2)
    ]
    if diag_sub:
        findings.append(
            Finding(
                "sum(exp(x)) - exp(diag(x))",
                "a subtraction of the diagonal's exp from a row sum: cancels catastrophically when the diagonal "
                "dominates, and exp overflows",
                "mask the diagonal to -inf and take torch.logsumexp over the row",
            )
        )
    big = [
        (name, t)
        for n in nodes
        for name, t in _saved_tensors(n)
        if t.dim() >= 2 and t.shape[-1] >= size and t.shape[-2] >= size and t.numel() >= size * size
    ]
    if big:
        name, t = big[0]
        findings.append(
            Finding(
                "an n x n matrix held for backward",
                f"{len(big)} saved tensor(s) of shape >= ({size}, {size}), e.g. {name} {tuple(t.shape)}: memory "
                "grows with the batch squared",
                "flashcl's tiled backend computes the same loss in O(n) memory (see the replacement below, if any)",
            )
        )
    return findings


# ----------------------------------------------------------------------------- measuring


def _call(fn: LossFn, inputs: Sequence[Any], seed: int) -> Tensor:
    random.seed(seed)
    torch.manual_seed(seed)
    return fn(*inputs)


def _run(fn: LossFn, inputs: Sequence[Any], seed: int = 0) -> Tuple[SizeRun, Any]:
    for t in inputs:
        if isinstance(t, Tensor):
            t.grad = None
    base = reset_peak()
    t0 = time.perf_counter()
    loss = _call(fn, inputs, seed)
    fwd = time.perf_counter() - t0
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError("the loss function must return a scalar tensor")
    nodes = _walk(loss.grad_fn)
    t0 = time.perf_counter()
    if loss.requires_grad:
        loss.backward(retain_graph=True)
    bwd = time.perf_counter() - t0
    peak = status_mb("VmHWM")
    run = SizeRun(
        inputs[0].shape[0] if isinstance(inputs[0], Tensor) else 0,
        fwd,
        bwd,
        None if base is None or peak is None else peak - base,
        len(nodes),
        float(loss.detach()),
        _backward_elements(nodes),
    )
    return run, (loss, nodes)


def _slope(xs: List[float], ys: List[float]) -> Optional[float]:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


# ----------------------------------------------------------------------------- replacements


def _close(a: float, b: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= 1e-4 * max(1.0, abs(b))


def _grads(make_loss: Callable[[], Tensor], inputs: Sequence[Any]) -> Tuple[float, List[Tensor]]:
    """(value, gradients of the floating inputs that require grad)."""
    leaves = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    loss = make_loss()
    grads = list(torch.autograd.grad(loss, leaves, allow_unused=True)) if loss.requires_grad and leaves else []
    return float(loss.detach()), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _same_gradients(a: List[Tensor], b: List[Tensor]) -> bool:
    for x, y in zip(a, b):
        scale = max(float(y.abs().max()) if y.numel() else 0.0, 1e-30)
        if not bool(torch.isfinite(x).all()) or float((x - y).abs().max()) > 1e-4 * scale + 1e-6:
            return False
    return len(a) == len(b)


def _find_replacement(
    fn: LossFn, every_size: Sequence[Sequence[Any]], seed: int, repeats: int
) -> Optional[Replacement]:
    """The flashcl call whose value and gradient equal the function's at every size
    (``every_size``: the inputs at each size, the largest last), the candidates
    whose value at the smallest size is closest tried first; timed at the largest."""
    inputs = every_size[-1]
    user = [_grads(functools.partial(_call, fn, ins, seed), ins) for ins in every_size]
    with torch.no_grad():  # the values at the smallest size first: the candidates are many
        values = []
        for i, (_, cand) in enumerate(_candidates(every_size[0], seed)):
            try:
                value = float(cand())
            except (ValueError, TypeError):
                continue
            if _close(value, user[0][0]):  # the closest first; those equal to rounding in the families' order
                rel = abs(value - user[0][0]) / max(1.0, abs(user[0][0]))
                values.append((rel if rel > 1e-5 else 0.0, i))
    names = parameter_names(fn, len(inputs))
    per_size = [_candidates(ins, seed, names) for ins in every_size]
    for _, i in sorted(values):
        if all(
            _close(v, uv) and _same_gradients(g, ug)
            for (v, g), (uv, ug) in ((_grads(cands[i][1], ins), u) for cands, ins, u in zip(per_size, every_size, user))
        ):
            call, cand = per_size[-1][i]
            value = user[-1][0]
            break
    else:
        return None
    return _timed(call, fn, lambda *_: cand(), inputs, seed, repeats, value)


def _timed(
    call: str, fn: LossFn, other: LossFn, inputs: Sequence[Any], seed: int, repeats: int, value: float
) -> Replacement:
    """The function and its replacement timed in alternating rounds, so that a shared
    machine's drift weighs on both alike; at least 3, and no new round once 20 s are spent."""
    user_times: List[float] = []
    flashcl_times: List[float] = []
    start = time.perf_counter()
    while len(user_times) < repeats and (len(user_times) < 3 or time.perf_counter() - start < 20.0):
        user_times.append(_time_fwd_bwd(lambda: _call(fn, inputs, seed), inputs))
        flashcl_times.append(_time_fwd_bwd(lambda: _call(other, inputs, seed), inputs))
    return Replacement(call, value, user_times, flashcl_times)


def _check_candidate(
    fn: LossFn, candidate: LossFn, every_size: Sequence[Sequence[Any]], seed: int, names: Optional[List[str]]
) -> List[CandidateCheck]:
    """The candidate's value and gradients against the function's at every size."""
    checks = []
    for inputs in every_size:
        value, grads = _grads(functools.partial(_call, fn, inputs, seed), inputs)
        try:
            cvalue, cgrads = _grads(functools.partial(_call, candidate, inputs, seed), inputs)
        except Exception as e:  # noqa: BLE001 - the candidate's own error is the finding
            raise ValueError(f"the candidate failed at n = {_size_of(inputs)}: {type(e).__name__}: {e}") from e
        leaves = [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
        error, where = 0.0, "-"
        for i, a, b in zip(leaves, cgrads, grads):
            scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-30)
            diff = (a - b).abs().nan_to_num(nan=math.inf)
            if diff.numel() and float(diff.max()) / scale > error:
                error = float(diff.max()) / scale
                index = tuple(int(v) for v in torch.unravel_index(diff.argmax(), diff.shape))
                where = f"{names[i] if names else f'input {i}'}{list(index)}"
        same = _close(cvalue, value) and _same_gradients(cgrads, grads)
        checks.append(CandidateCheck(_size_of(inputs), value, cvalue, error, where, same))
    return checks


def _size_of(inputs: Sequence[Any]) -> int:
    return next(t for t in inputs if isinstance(t, Tensor)).shape[0]


def parameter_names(fn: Callable[..., Any], count: int) -> Optional[List[str]]:
    """The names the function gives its first ``count`` positional arguments
    (``*args``: ``args[i]``), so that a suggested call runs as printed inside it;
    None where the signature cannot be read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names: List[str] = []
    for p in params:
        if len(names) == count:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            start = len(names)
            names += [f"{p.name}[{i - start}]" for i in range(start, count)]
    return names if len(names) == count else None


def _time_fwd_bwd(make_loss: Callable[[], Tensor], inputs: Sequence[Any]) -> float:
    for t in inputs:
        if isinstance(t, Tensor):
            t.grad = None
    t0 = time.perf_counter()
    loss = make_loss()
    if loss.requires_grad:
        loss.backward()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- entry point


def doctor(
    fn: LossFn,
    *example_inputs: Any,
    sizes: Optional[Sequence[int]] = None,
    seed: int = 0,
    repeats: int = 5,
    progress: Optional[Callable[[str], None]] = None,
    candidate: Optional[LossFn] = None,
) -> Report:
    """Diagnose a loss function: timing and growth, graph, slow patterns, replacement.

    Args:
        fn: the loss, called as ``fn(*inputs)``; returns a scalar tensor.
        *example_inputs: one set of inputs. Every dimension equal to the first
            tensor's dim 0 (the batch size) is scaled to each of ``sizes``.
        sizes: batch sizes to run at (default: the example's size, x2, x4).
        seed: ``random`` and ``torch`` are seeded with it before every call, so
            that a loss that samples (its own neighbours, say) can be matched.
        repeats: rounds of timing the function and its flashcl replacement,
            alternately (at least 3; fewer than ``repeats`` once 20 s are spent).
            The report gives the medians and the spread of the ratios.
        progress: called with a line of text before each stage (e.g. ``print``).
        candidate: your own replacement (a :func:`flashcl.flex_loss` call, say), called
            as ``fn`` is: checked against ``fn`` at every size, value and gradient (the
            report says where they differ), and timed against it when they agree.
            When no replacement is found and none is given, the report prints the loss
            as a flex call in the function's own names, to fill in.

    A flashcl call is named as the replacement only when its value and its
    gradient equal the function's at every size tried; otherwise the report says
    which calls were tried.

    Returns:
        A :class:`Report`: ``print(report)`` (its text) or ``report.to_json()``.

    Shape:
        - example inputs: any; the first tensor's dim 0 is the batch size n
        - at each size, every dimension equal to n becomes that size

    Examples::

        >>> def my_loss(x):
        ...     return -torch.log(torch.exp(x.diagonal()) / torch.exp(x).sum(1)).sum()
        >>> report = flashcl.doctor(my_loss, torch.randn(64, 64, requires_grad=True), repeats=3)
        >>> report.runs[-1].size, report.nodes_exponent < 0.5
        (256, True)
    """
    if not example_inputs or not any(isinstance(t, Tensor) for t in example_inputs):
        raise ValueError("doctor needs example inputs, at least one tensor")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    base = next(t for t in example_inputs if isinstance(t, Tensor)).shape[0]
    sizes = list(sizes) if sizes else [base, 2 * base, 4 * base]
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be positive ints, got {sizes}")
    runs: List[SizeRun] = []
    last = None
    every_size = []
    for s in sizes:
        if progress is not None:
            progress(f"n = {s}: timing forward and backward, twice")
        inputs = scale_inputs(example_inputs, s, seed)
        every_size.append(inputs)
        run, graph = _run(fn, inputs, seed)
        # timings: the better of two runs (a shared machine's noise would otherwise
        # bend the fitted exponent); memory and graph from the first
        again, _ = _run(fn, inputs, seed)
        run.forward_s, run.backward_s = min(run.forward_s, again.forward_s), min(run.backward_s, again.backward_s)
        runs.append(run)
        last = (inputs, graph)
    assert last is not None
    inputs, (loss, nodes) = last
    # growth over the last doubling(s): small sizes are dominated by per-op overhead
    tail = runs[-2:] if len(runs) > 2 else runs
    ns = [float(r.size) for r in tail]
    fwd_e = _slope(ns, [r.forward_s for r in tail])
    bwd_e = _slope(ns, [r.backward_s for r in tail])
    nodes_e = _slope(ns, [float(r.graph_nodes) for r in tail])
    elements_e = _slope(ns, [float(r.backward_elements) for r in tail])
    by_type: Dict[str, int] = {}
    for n in nodes:
        by_type[_base_name(n)] = by_type.get(_base_name(n), 0) + 1
    saved = sorted(
        ((name, list(t.shape), t.numel() * t.element_size() / 2**20) for n in nodes for name, t in _saved_tensors(n)),
        key=lambda x: -x[2],
    )
    findings = _graph_findings(nodes, runs[-1].size, nodes_e)
    names = parameter_names(fn, len(inputs))
    checks: List[CandidateCheck] = []
    replacement = None
    if candidate is not None:
        if not callable(candidate):
            raise TypeError(f"candidate must be a function called as fn is, got {type(candidate).__name__}")
        if progress is not None:
            progress("checking your candidate against your function at every size")
        checks = _check_candidate(fn, candidate, every_size, seed, names)
        if all(c.same for c in checks):
            replacement = _timed(
                "your candidate " + getattr(candidate, "__name__", "function"),
                fn,
                candidate,
                inputs,
                seed,
                repeats,
                checks[-1].loss,
            )
    if replacement is None:
        if progress is not None:
            progress("looking for a flashcl loss with the same value and gradient at every size")
        replacement = _find_replacement(fn, every_size, seed, repeats)
    del loss
    tried = [] if replacement is not None else _families(inputs)
    template = None if replacement is not None else flex_template(inputs, names)
    return Report(
        runs, fwd_e, bwd_e, nodes_e, elements_e, by_type, saved[:6], findings, replacement, tried, template, checks
    )


def parse_shape(spec: str) -> Tuple[List[str], str, int]:
    """``"n,n"`` -> float (n, n); ``"n:int:5"`` -> int64 (n,) in [0, 5); dims are ints or ``n``."""
    parts = spec.split(":")
    dims = [d.strip() for d in parts[0].split(",") if d.strip()]
    kind = parts[1] if len(parts) > 1 else "float"
    high = int(parts[2]) if len(parts) > 2 else 0
    if kind not in ("float", "int") or not dims or not all(d == "n" or d.isdigit() for d in dims):
        raise ValueError(f"bad shape {spec!r}: use e.g. 'n,n' or 'n,128' or 'n:int:5'")
    if kind == "int" and high < 1:
        raise ValueError(f"bad shape {spec!r}: integer inputs need a range, e.g. 'n:int:5'")
    return dims, kind, high


def inputs_from_shapes(shapes: Sequence[str], n: int, seed: int = 0) -> List[Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in shapes:
        dims, kind, high = parse_shape(spec)
        shape = [n if d == "n" else int(d) for d in dims]
        if kind == "float":
            out.append(torch.randn(shape, generator=g).requires_grad_(True))
        else:
            out.append(torch.randint(0, high, shape, generator=g))
    return out
