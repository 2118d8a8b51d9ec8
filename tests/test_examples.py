"""The digits example (real data shipped in scikit-learn), in its fast mode."""
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
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "digits_supcon.py"), "--fast",
                          "--out", str(png)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    acc = {name: float(v) for name, v in re.findall(r"(raw pixels|cross-entropy encoder|supcon encoder) ([0-9.]+)",
                                                    out.stdout)}
    assert set(acc) == {"raw pixels", "cross-entropy encoder", "supcon encoder"}, out.stdout
    assert acc["supcon encoder"] > acc["raw pixels"], acc
    assert png.stat().st_size > 10_000
