"""flashcl doctor on the seeds' own programs and on an already vectorised loss."""
from __future__ import annotations

import json
import random
import textwrap

import pytest
import torch
import torch.nn.functional as F

import flashcl
from flashcl.__main__ import main
from seeds import naive_supervised_simcse_loss, vectorized_supervised_simcse_loss


def seed1_as_function(x: torch.Tensor) -> torch.Tensor:
    """The first seed's program, as a function of its score matrix (neighbors = 2)."""
    n, neighbors = x.shape[0], 2
    row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
    y = torch.zeros((n, neighbors))
    for i in range(n):
        for j in range(neighbors):
            y[i][j] = x[i][random.randrange(0, n)]
    return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))


def test_seed1_program_is_diagnosed() -> None:
    x = torch.randn(250, 250, requires_grad=True)
    report = flashcl.doctor(seed1_as_function, x, sizes=[250, 500, 1000])
    patterns = {f.pattern for f in report.findings}
    assert "element-wise indexing/assignment in Python loops" in patterns
    assert "exp followed by log" in patterns
    assert "sum(exp(x)) - exp(diag(x))" in patterns
    # each indexed element makes an n x n gradient: backward grows ~ n^3 asymptotically (measured
    # here: n^2.8 from 1000 to 2000); from 500 to 1000 per-node overheads still weigh, so > 2
    assert report.backward_exponent is not None and report.backward_exponent > 2.0, report.text()
    assert report.replacement is not None and "flashcl.neighbor_loss" in report.replacement.call
    assert "(1000, 2)" in report.replacement.call
    assert report.replacement.speedup > 1.0
    assert "neighbor_loss" in report.text()


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
    assert not patterns & {"element-wise indexing/assignment in Python loops", "a Python loop over the batch",
                           "exp followed by log", "sum(exp(x)) - exp(diag(x))"}, report.text()
    assert report.replacement is not None and "flashcl.supcon_loss" in report.replacement.call

    def clean(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.1, torch.arange(q.shape[0]))
    report = flashcl.doctor(clean, torch.randn(32, 8, requires_grad=True), torch.randn(32, 8, requires_grad=True),
                            sizes=[32, 64])
    assert not [f for f in report.findings if f.pattern != "an n x n matrix held for backward"], report.text()
    assert report.replacement is not None and "info_nce_loss" in report.replacement.call


def test_cli_doctor_on_a_file(tmp_path, capsys) -> None:
    src = tmp_path / "my_loss.py"
    src.write_text(textwrap.dedent('''
        import torch
        def loss(x):
            return torch.logsumexp(x, 1).sum() - x.diagonal().sum()
    '''))
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
