"""flashcl doctor on the seeds' own programs and on an already vectorised loss."""

from __future__ import annotations

import inspect
import json
import random
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from seeds import naive_supervised_simcse_loss, vectorized_supervised_simcse_loss

import flashcl
from flashcl.__main__ import main
from flashcl.tools.doctor import counts_gradient_elements, scale_inputs
from rnc_forms import rnc_published


def seed1_as_function(x: torch.Tensor) -> torch.Tensor:
    """The first seed's program, as a function of its score matrix (neighbors = 2)."""
    n, neighbors = x.shape[0], 2
    row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
    y = torch.zeros((n, neighbors))
    for i in range(n):
        for j in range(neighbors):
            y[i][j] = x[i][random.randrange(0, n)]
    return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))


def pasted_into(call: str, names: list, inputs: list) -> torch.Tensor:
    """The suggested call pasted as the body of a function with the user's parameters
    (``flashcl``, ``torch`` and ``random`` imported in its module), called on ``inputs``."""
    namespace = {"flashcl": flashcl, "torch": torch, "random": random}
    exec(f"def user_loss({', '.join(names)}):\n    return {call}\n", namespace)
    return namespace["user_loss"](*inputs)


def test_seed1_program_is_diagnosed() -> None:
    x = torch.randn(100, 100, requires_grad=True)
    report = flashcl.doctor(seed1_as_function, x, sizes=[100, 200, 400], repeats=3)
    patterns = {f.pattern for f in report.findings}
    assert "element-wise indexing/assignment in Python loops" in patterns
    assert "exp followed by log" in patterns
    assert "sum(exp(x)) - exp(diag(x))" in patterns
    # Growth measured on what does not depend on the machine's speed: the graph has
    # ~ 6 nodes per row (n^1), and every indexed element sends back a gradient of the
    # whole n x n input, so the gradient elements backward writes grow as n^3.
    assert report.nodes_exponent is not None and abs(report.nodes_exponent - 1.0) < 0.05, report.text()
    if counts_gradient_elements():  # a torch whose nodes give their inputs' shapes (not torch 2.4)
        assert report.backward_elements_exponent is not None and report.backward_elements_exponent > 2.9, report.text()
    assert report.runs[-1].backward_elements > 2 * 400**3  # two selected elements per row, n^2 each
    assert report.replacement is not None and "flashcl.neighbor_loss" in report.replacement.call
    assert "range(2)" in report.replacement.call and "random.randrange" in report.replacement.call
    assert len(report.replacement.user_times) == len(report.replacement.flashcl_times) == 3
    assert "neighbor_loss" in report.text()
    # the named call computes the program's loss and gradient on the inputs it was found on
    (x400,) = scale_inputs([x], 400, seed=0)
    x400 = x400.detach().requires_grad_(True)
    random.seed(0)
    torch.manual_seed(0)
    user = seed1_as_function(x400)
    user.backward()
    random.seed(0)
    nb = torch.tensor([[random.randrange(0, 400) for _ in range(2)] for _ in range(400)])
    x2 = x400.detach().clone().requires_grad_(True)
    ours = flashcl.neighbor_loss(x2, nb, exclude_diagonal=True, reduction="sum")
    ours.backward()
    assert abs(float(ours.detach()) - report.replacement.loss) < 1e-3
    assert torch.allclose(ours, user, rtol=1e-5) and torch.allclose(x2.grad, x400.grad, atol=1e-5)
    # the call as printed, pasted where the function's loss was (its parameter's name)
    random.seed(0)
    torch.manual_seed(0)
    name = list(inspect.signature(seed1_as_function).parameters)[0]
    pasted = pasted_into(report.replacement.call, [name], [x400])
    assert torch.allclose(pasted, user, rtol=1e-5), report.replacement.call


def test_seed2_naive_loop_names_the_supcon_call() -> None:
    emb, labels = torch.randn(64, 16, requires_grad=True), torch.randint(0, 4, (64,))
    report = flashcl.doctor(naive_supervised_simcse_loss, emb, labels, sizes=[64, 128, 256])
    assert report.replacement is not None
    assert "positives='sum', include_self=True" in report.replacement.call
    assert "temperature=0.05" in report.replacement.call
    assert "a Python loop over the batch" in {f.pattern for f in report.findings}


def test_vectorised_loss_flags_nothing_false() -> None:
    emb, labels = torch.randn(64, 16, requires_grad=True), torch.randint(0, 4, (64,))
    report = flashcl.doctor(vectorized_supervised_simcse_loss, emb, labels, sizes=[64, 128])
    patterns = {f.pattern for f in report.findings}
    assert not patterns & {
        "element-wise indexing/assignment in Python loops",
        "a Python loop over the batch",
        "exp followed by log",
        "sum(exp(x)) - exp(diag(x))",
    }, report.text()
    assert report.replacement is not None and "flashcl.supcon_loss" in report.replacement.call

    def clean(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.1, torch.arange(q.shape[0]))

    report = flashcl.doctor(
        clean, torch.randn(32, 8, requires_grad=True), torch.randn(32, 8, requires_grad=True), sizes=[32, 64]
    )
    assert not [f for f in report.findings if f.pattern != "an n x n matrix held for backward"], report.text()
    assert report.replacement is not None and "info_nce_loss" in report.replacement.call


def test_cli_doctor_on_a_file(tmp_path, capsys) -> None:
    src = tmp_path / "my_loss.py"
    src.write_text(
        textwrap.dedent("""
        import torch
        def loss(x):
            return torch.logsumexp(x, 1).sum() - x.diagonal().sum()
    """)
    )
    out = tmp_path / "report.json"
    assert main(["doctor", f"{src}:loss", "--shape", "n,n", "--sizes", "50,100", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["size"] for r in data["runs"]] == [50, 100]
    assert "flashcl doctor" in capsys.readouterr().out


def test_cli_doctor_bad_target(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no such file"):
        main(["doctor", f"{tmp_path}/nope.py:f", "--shape", "n,n"])
    with pytest.raises(SystemExit, match="bad shape"):
        src = tmp_path / "f.py"
        src.write_text("def f(x):\n    return x.sum()\n")
        main(["doctor", f"{src}:f", "--shape", "n;n"])


def one_directional_info_nce(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """InfoNCE from queries to keys (positives on the diagonal) written with a mask loop:
    CLIP's value is close on random data, its gradient is not."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    logits = q @ k.T / 0.07
    n = q.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
    return -(logits[mask] - torch.logsumexp(logits, dim=1)).mean()


def test_doctor_names_the_loss_with_the_same_gradient_not_a_close_value() -> None:
    q, k = torch.randn(100, 32, requires_grad=True), torch.randn(100, 32, requires_grad=True)
    report = flashcl.doctor(one_directional_info_nce, q, k, sizes=[100, 200, 400], repeats=3)
    assert report.replacement is not None
    assert report.replacement.call.startswith("flashcl.info_nce_loss("), report.replacement.call
    assert "temperature=0.07" in report.replacement.call
    assert "same loss and gradient as: flashcl.info_nce_loss" in str(report)


def test_doctor_says_what_it_tried_when_nothing_matches() -> None:
    def odd_loss(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.T).pow(2).mean()

    q, k = torch.randn(50, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    report = flashcl.doctor(odd_loss, q, k, sizes=[50, 100], repeats=3)
    assert report.replacement is None
    text = str(report)
    assert "no flashcl loss matched" in text and "info_nce_loss at temperatures 0.05" in text


def test_speed_ratio_below_one_reads_slower() -> None:
    from flashcl.tools.doctor import speed_words

    assert speed_words(0.65) == "1.5x slower"
    assert speed_words(2.5) == "2.5x faster"
    assert speed_words(266.4) == "266x faster"


def test_cli_too_few_shapes_is_a_clear_error(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "loss.py"  # type: ignore[operator]
    path.write_text("def loss(e, y):\n    return e.sum()\n")
    with pytest.raises(SystemExit, match="takes 2 input.*got 1 --shape: give one --shape per input"):
        main(["doctor", f"{path}:loss", "--shape", "n,8", "--sizes", "10,20"])


def batch_hard_triplet_loops(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A batch-hard triplet loss as users write it: torch.cdist, then Python loops for
    each anchor's hardest positive and hardest negative (margin 0.3)."""
    d = torch.cdist(emb, emb)
    losses = []
    for i in range(emb.shape[0]):
        pos = [d[i, j] for j in range(emb.shape[0]) if j != i and labels[j] == labels[i]]
        neg = [d[i, j] for j in range(emb.shape[0]) if labels[j] != labels[i]]
        if pos and neg:
            losses.append(torch.relu(torch.stack(pos).max() - torch.stack(neg).min() + 0.3))
        else:
            losses.append(emb.sum() * 0)
    return torch.stack(losses).mean()


def cosent_loops(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """CoSENT as first written: loops over the ordered pairs (scale 20)."""
    s = F.cosine_similarity(a, b) * 20.0
    terms = [torch.zeros((), dtype=a.dtype)]
    for i in range(a.shape[0]):
        for j in range(a.shape[0]):
            if scores[i] < scores[j]:
                terms.append(s[i] - s[j])
    return torch.logsumexp(torch.stack(terms), 0)


def cosface_by_hand(emb: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """CosFace with the class weights held (D, C) as pytorch-metric-learning holds them."""
    cos = F.normalize(emb, dim=1) @ F.normalize(w, dim=0)
    logits = 30.0 * (cos - 0.35 * F.one_hot(labels, w.shape[1]))
    return F.cross_entropy(logits, labels)


@pytest.mark.parametrize(
    "fn, make, want",
    [
        (
            batch_hard_triplet_loops,
            lambda: (torch.randn(48, 8, requires_grad=True), torch.randint(0, 6, (48,))),
            [
                "flashcl.triplet_loss(emb, labels,",
                "margin=0.3",
                "mining='hard'",
                "distance='euclidean'",
            ],
        ),
        (
            cosent_loops,
            lambda: (torch.randn(24, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True), torch.rand(24)),
            ["flashcl.cosent_loss(a, b, scores,", "scale=20", "similarity='cosine'"],
        ),
        (
            cosface_by_hand,
            lambda: (torch.randn(32, 8, requires_grad=True), torch.randint(0, 10, (32,)), torch.randn(8, 10)),
            ["flashcl.cosface_loss(emb, labels, w.T,", "margin=0.35", "scale=30"],
        ),
    ],
    ids=["batch-hard triplet", "CoSENT", "CosFace"],
)
def test_doctor_names_a_replacement_in_every_family(fn, make, want) -> None:
    """The triplet, pairwise-ranking and margin families are candidates too: the call
    with the parameters the user wrote, matched in value and gradient at every size."""
    inputs = make()
    base = inputs[0].shape[0]
    report = flashcl.doctor(fn, *inputs, sizes=[base, 2 * base], repeats=3)
    assert report.replacement is not None, report.text()
    for part in want:
        assert part in report.replacement.call, report.replacement.call
    assert "a Python loop over the batch" in {f.pattern for f in report.findings} or fn is cosface_by_hand
    # the call runs as printed inside the function: its parameters' names, the same value
    names = list(inspect.signature(fn).parameters)
    pasted = pasted_into(report.replacement.call, names, list(inputs))
    value, want = float(pasted.detach()), float(fn(*inputs).detach())
    assert abs(value - want) <= 1e-4 * max(1.0, abs(want)), report.replacement.call


FAMILY_INPUTS = {
    "a score matrix": lambda: [torch.randn(7, 7)],
    "embeddings and labels": lambda: [torch.randn(9, 4), torch.randint(0, 3, (9,))],
    "class weights (C, D) and (D, C)": lambda: [torch.randn(9, 4), torch.randint(0, 4, (9,)), torch.randn(4, 4)],
    "two towers": lambda: [torch.randn(6, 4), torch.randn(6, 4)],
    "pairs with scores": lambda: [torch.randn(6, 4), torch.randn(6, 4), torch.rand(6)],
    "views and regression targets": lambda: [torch.randn(9, 2, 4), torch.rand(9, 1)],
}


@pytest.mark.parametrize("kind", sorted(FAMILY_INPUTS))
def test_every_suggested_call_runs_as_printed_with_the_users_names(kind: str) -> None:
    """Every candidate of every family, printed with the user's own parameter names
    (odd ones here), evaluates inside that function to the candidate's value."""
    from flashcl.tools.families import candidates

    inputs = FAMILY_INPUTS[kind]()
    names = [f"my_arg_{i}" for i in range(len(inputs))]
    found = candidates(inputs, 3, names)
    assert found, kind
    for call, fn in found:
        assert all(word not in call for word in ("embeddings,", "(scores,", "class_weights", "(a, b")), call
        random.seed(3)
        torch.manual_seed(3)
        pasted = pasted_into(call, names, inputs)
        assert torch.allclose(pasted, fn(), rtol=1e-5, atol=1e-6), call


WINDOW_LOSS = '''
import torch
import torch.nn.functional as F
import flashcl


def window_loss(emb, stamps):
    """SupCon whose positives are the samples within one time unit: a loop per anchor."""
    z = F.normalize(emb, dim=-1)
    losses = []
    for i in range(emb.shape[0]):
        s = z[i] @ z.T / 0.1
        pos = (stamps - stamps[i]).abs() <= 1.0
        pos[i] = False
        if not bool(pos.any()):
            continue
        keep = torch.ones_like(pos)
        keep[i] = False
        losses.append((torch.logsumexp(s[keep], 0) - s[pos]).mean())
    return torch.stack(losses).mean()


def as_flex(emb, stamps):
    return flashcl.flex_loss(
        emb, rows={"stamps": stamps}, positive=lambda a, b: (a.stamps - b.stamps).abs() <= 1.0, temperature=0.1
    )


def as_flex_too_warm(emb, stamps):
    return flashcl.flex_loss(
        emb, rows={"stamps": stamps}, positive=lambda a, b: (a.stamps - b.stamps).abs() <= 1.0, temperature=0.2
    )
'''


def _window_module(tmp_path: Any) -> Any:
    import importlib.util

    path = tmp_path / "window_loss.py"
    path.write_text(WINDOW_LOSS)
    spec = importlib.util.spec_from_file_location("window_loss", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return path, module


def test_a_loss_no_built_in_matches_gets_the_flex_call_that_equals_it(tmp_path: Any) -> None:
    """A time-window SupCon written as a loop: no built-in matches; the doctor names the flex
    call (its window and temperature found) whose value and gradient equal the loop's at every
    size, in the function's names, and it runs as printed."""
    _, mod = _window_module(tmp_path)
    emb, stamps = torch.randn(48, 8, requires_grad=True), torch.randn(48)
    report = flashcl.doctor(mod.window_loss, emb, stamps, sizes=[48, 96], repeats=3)
    assert report.replacement is not None, report.text()
    call = report.replacement.call
    assert call.startswith("flashcl.flex_loss(emb, ") and 'rows={"stamps": stamps}' in call
    assert "<= 1," in call and "temperature=0.1," in call, call
    printed = pasted_into(call, ["emb", "stamps"], [emb, stamps])
    assert torch.allclose(printed, mod.window_loss(emb, stamps), rtol=1e-5)


def test_a_constant_it_cannot_infer_is_named_in_the_template(tmp_path: Any) -> None:
    """A window no tried width has (0.37): the report prints the flex call to fill in, in the
    function's names, and says which part it could not infer; with the window filled in as
    the loop has it, it is the loop's loss."""
    _, mod = _window_module(tmp_path)
    odd = mod.window_loss.__globals__
    code = WINDOW_LOSS.replace("<= 1.0", "<= 0.37")
    exec(code, odd)
    emb, stamps = torch.randn(48, 8, requires_grad=True), torch.randn(48)
    report = flashcl.doctor(odd["window_loss"], emb, stamps, sizes=[48, 96], repeats=3)
    assert report.replacement is None and report.flex_template is not None
    text = report.text()
    assert "as a flex loss in your names" in text and 'rows={"stamps": stamps}' in report.flex_template
    assert "could not infer: tried a window" in report.flex_template
    filled = report.flex_template.replace("<= 0.1,", "<= 0.37,")
    printed = pasted_into(filled, ["emb", "stamps"], [emb, stamps])
    assert torch.allclose(printed, odd["window_loss"](emb, stamps), rtol=1e-5)


# Losses as users write them, from published code (not ours): the doctor must print a flex
# call that runs and equals each one.
PUBLISHED = '''
import torch
import torch.nn.functional as F


def multilabel_supcon(features, labels):
    """Supervised contrastive loss of SupContrast (Khosla et al.; HobbitLong/SupContrast's
    losses.py, one view, contrast_mode 'all'), its mask from multi-hot labels (a shared
    label), as multi-label users adapt it, the features normalised first."""
    temperature, base_temperature = 0.07, 0.07
    features = F.normalize(features, dim=1)
    batch_size = features.shape[0]
    labels = labels.float()
    mask = (torch.matmul(labels, labels.T) > 0).float()
    anchor_dot_contrast = torch.div(torch.matmul(features, features.T), temperature)
    logits_max, _ = torch.max(anchor_dot_contrast, dim=1, keepdim=True)
    logits = anchor_dot_contrast - logits_max.detach()
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(batch_size).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mask_pos_pairs = mask.sum(1)
    mask_pos_pairs = torch.where(mask_pos_pairs < 1e-6, 1, mask_pos_pairs)
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask_pos_pairs
    loss = -(temperature / base_temperature) * mean_log_prob_pos
    return loss.view(1, batch_size).mean()


def age_window(z_i, z_j, age):
    """Two towers whose positives are the pairs within two years of age (the age of a
    subject, as in age-aware contrastive learning), a loop over the anchors."""
    z_i, z_j = F.normalize(z_i, dim=1), F.normalize(z_j, dim=1)
    logits = z_i @ z_j.T / 0.1
    losses = []
    for i in range(z_i.shape[0]):
        pos = (age - age[i]).abs() <= 2.0
        losses.append(-torch.log_softmax(logits[i], 0)[pos].mean())
    return torch.stack(losses).mean()
'''


def _published(tmp_path: Any) -> Any:
    import importlib.util

    path = tmp_path / "published.py"
    path.write_text(PUBLISHED)
    spec = importlib.util.spec_from_file_location("published", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return path, module


def test_the_doctor_prints_a_flex_call_equal_to_a_multilabel_supcon(tmp_path: Any) -> None:
    """Multi-hot labels (ints): a shared label as the positive, the loop's own temperature."""
    _, mod = _published(tmp_path)
    x, labels = torch.randn(40, 8, requires_grad=True), torch.randint(0, 2, (40, 5))
    report = flashcl.doctor(mod.multilabel_supcon, x, labels, sizes=[40, 80], repeats=3)
    assert report.replacement is not None, report.text()
    call = report.replacement.call
    assert "(a.labels & b.labels).any(-1)" in call and "temperature=0.07" in call, call
    assert torch.allclose(pasted_into(call, ["features", "labels"], [x, labels]), mod.multilabel_supcon(x, labels))


def test_the_doctor_gives_two_towers_per_sample_data_to_both(tmp_path: Any) -> None:
    """Two towers and a per-sample age (no gradient): the keys' view reads it too (cols=)."""
    _, mod = _published(tmp_path)
    z_i, z_j, age = torch.randn(40, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True), torch.randn(40)
    report = flashcl.doctor(mod.age_window, z_i, z_j, age, sizes=[40, 80], repeats=3)
    assert report.replacement is not None, report.text()
    call = report.replacement.call
    assert 'rows={"age": age}, cols={"age": age}' in call and "(a.age - b.age).abs() <= 2," in call, call
    printed = pasted_into(call, ["z_i", "z_j", "age"], [z_i, z_j, age])
    assert torch.allclose(printed, mod.age_window(z_i, z_j, age))


def test_cli_doctor_takes_inputs_without_gradient(tmp_path: Any, capsys: Any) -> None:
    """``--no-grad age``: the ages carry no gradient, the comparison leaves them out, and the
    flex call is named; an unknown name or an integer input is a clear error."""
    path, _ = _published(tmp_path)
    args = ["doctor", f"{path}:age_window", "--shape", "n,8", "--shape", "n,8", "--shape", "n", "--sizes", "40,80"]
    assert main(args + ["--no-grad", "age"]) == 0
    out = capsys.readouterr().out
    assert 'same loss and gradient as: flashcl.flex_loss(z_i, z_j, rows={"age": age}, cols={"age": age}' in out
    with pytest.raises(SystemExit, match="not a parameter"):
        main(args + ["--no-grad", "height"])
    with pytest.raises(SystemExit, match="integer"):
        main(["doctor", f"{path}:multilabel_supcon", "--shape", "n,8", "--shape", "n,5:int:2", "--no-grad", "1"])


def test_a_candidate_is_checked_at_every_size_and_timed(tmp_path: Any) -> None:
    _, mod = _window_module(tmp_path)
    emb, stamps = torch.randn(48, 8, requires_grad=True), torch.randn(48)
    good = flashcl.doctor(mod.window_loss, emb, stamps, sizes=[48, 96], repeats=3, candidate=mod.as_flex)
    assert [c.size for c in good.candidate_checks] == [48, 96] and all(c.same for c in good.candidate_checks)
    assert good.replacement is not None and good.replacement.call == "your candidate as_flex"
    assert "same loss and gradient as: your candidate as_flex" in good.text()
    bad = flashcl.doctor(mod.window_loss, emb, stamps, sizes=[48, 96], repeats=3, candidate=mod.as_flex_too_warm)
    assert not any(c.same for c in bad.candidate_checks)
    # the doctor's own search then names the call that does equal the loop
    assert bad.replacement is not None and "temperature=0.1," in bad.replacement.call
    assert all(c.where.startswith("emb[") and c.grad_error > 1e-3 for c in bad.candidate_checks)
    assert "DIFFERS" in bad.text()
    with pytest.raises(TypeError, match="candidate"):
        flashcl.doctor(mod.window_loss, emb, stamps, sizes=[48], candidate="as_flex")  # type: ignore[arg-type]


def test_cli_doctor_takes_a_candidate(tmp_path: Any, capsys: Any) -> None:
    path, _ = _window_module(tmp_path)
    args = ["doctor", f"{path}:window_loss", "--shape", "n,8", "--shape", "n", "--sizes", "40,80"]
    assert main(args + ["--candidate", f"{path}:as_flex"]) == 0
    out = capsys.readouterr().out
    assert "your candidate against your function" in out and "DIFFERS" not in out
    assert "same loss and gradient as: your candidate as_flex" in out


def pml_contrastive_loops(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """pytorch-metric-learning's ContrastiveLoss (defaults: the Euclidean distance of the
    normalised rows, margins 0 and 1, the mean over each set's non-zero terms) as a loop
    over the anchors."""
    d = torch.cdist(F.normalize(emb, dim=1), F.normalize(emb, dim=1))
    pos, neg = [], []
    for i in range(emb.shape[0]):
        same = labels == labels[i]
        same[i] = False
        other = labels != labels[i]
        pos.append(torch.relu(d[i][same] - 0.0))
        neg.append(torch.relu(1.0 - d[i][other]))
    p, n = torch.cat(pos), torch.cat(neg)
    return p[p > 0].mean() + n[n > 0].mean()


def hadsell_squared(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hadsell et al.'s contrastive loss as commonly vectorised: 0.5 d^2 on the positives,
    0.5 relu(m - d)^2 on the negatives, the embeddings as given, the mean over every pair."""
    d = torch.cdist(emb, emb)
    same = (labels[:, None] == labels[None, :]).to(emb.dtype)
    return (0.5 * same * d.pow(2) + 0.5 * (1 - same) * torch.relu(2.0 - d).pow(2)).mean()


def supcon_l_in_loops(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SupCon's L_in (Khosla et al. eq. 3): the log of the positives' mean probability,
    a loop over the anchors."""
    z = F.normalize(features, dim=1)
    losses = []
    for i in range(features.shape[0]):
        s = z[i] @ z.T / 0.1
        others = torch.arange(features.shape[0]) != i
        pos = others & (labels == labels[i])
        if not bool(pos.any()):
            continue
        prob = torch.exp(s[pos]) / torch.exp(s[others]).sum()
        losses.append(-torch.log(prob.mean()))
    return torch.stack(losses).mean()


def snnl_cleverhans(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """cleverhans' soft nearest-neighbour loss (SNNL, cos_distance=True, temperature 0.5)
    written in torch: its STABILITY_EPS of 1e-5 left in."""
    eps, t = 1e-5, 0.5
    cos = F.normalize(x, dim=-1) @ F.normalize(x, dim=-1).T
    f = torch.exp(-(1.0 - cos) / t) - torch.eye(x.shape[0])
    pick = f / (eps + f.sum(1, keepdim=True))
    masked = pick * (y[:, None] == y[None, :])
    return (-torch.log(eps + masked.sum(1))).mean()


@pytest.mark.parametrize(
    "fn, make, want",
    [
        (
            pml_contrastive_loops,
            lambda: (torch.randn(40, 8, requires_grad=True), torch.randint(0, 4, (40,))),
            ["flashcl.contrastive_loss(emb, labels,", "neg_margin=1,", "distance='euclidean'", "'mean_nonzero'"],
        ),
        (
            hadsell_squared,
            lambda: (torch.randn(40, 8, requires_grad=True), torch.randint(0, 4, (40,))),
            [
                "flashcl.FlexPairSum(distance='euclidean')",
                "0.5 * d.pow(2)",
                "0.5 * (2 - d).relu().pow(2)",
                "normalize=False",
                "/ emb.shape[0] ** 2",
            ],
        ),
        (
            supcon_l_in_loops,
            lambda: (torch.randn(40, 8, requires_grad=True), torch.randint(0, 4, (40,))),
            ["flashcl.supcon_loss(features, labels,", "temperature=0.1", "positives='lse'"],
        ),
        (
            snnl_cleverhans,
            lambda: (torch.randn(40, 8, requires_grad=True), torch.randint(0, 4, (40,))),
            ['flashcl.flex_loss(x, rows={"y": y}', "a.y == b.y", "positives='lse'", "temperature=0.5"],
        ),
        (
            rnc_published,
            lambda: (torch.randn(20, 2, 8, requires_grad=True), torch.rand(20, 1)),
            ["flashcl.rank_n_contrast_loss(features, labels, temperature=2, reduction='mean')"],
        ),
    ],
    ids=["PML ContrastiveLoss", "Hadsell squared", "SupCon L_in", "SNNL", "Rank-N-Contrast"],
)
def test_doctor_names_the_pair_sum_positive_lse_and_rank_forms(fn, make, want) -> None:
    """Losses users write by hand as sums of per-pair terms, as the positives' probability
    mass, or with a denominator per pair (the published code of each): the doctor names
    the call (a built-in, or the flex call of the form) equal in value and gradient at
    every size, and it runs as printed in the function's names."""
    inputs = make()
    base = inputs[0].shape[0]
    report = flashcl.doctor(fn, *inputs, sizes=[base, 2 * base], repeats=3)
    assert report.replacement is not None, report.text()
    for part in want:
        assert part in report.replacement.call, report.replacement.call
    names = list(inspect.signature(fn).parameters)[: len(inputs)]
    pasted = pasted_into(report.replacement.call, names, list(inputs))
    value, expected = float(pasted.detach()), float(fn(*inputs).detach())
    assert abs(value - expected) <= 1e-4 * max(1.0, abs(expected)), report.replacement.call
