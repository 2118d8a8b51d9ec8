"""``flashcl check``: every public loss has an example; on the CPU every row passes or
is n/a (Triton without its interpreter); a wrong backend is a FAIL row and exit
status 1; a crash is an error row, not the end of the table; the rows stream."""

from __future__ import annotations

import pytest
import torch

import flashcl
from flashcl.__main__ import main
from flashcl.tools import selfcheck


def test_every_public_loss_is_checked() -> None:
    assert set(selfcheck.examples()) == {name for name in flashcl.__all__ if name.endswith("_loss")}


def test_the_cli_passes_on_the_cpu_and_streams_its_table(capsys: pytest.CaptureFixture) -> None:
    code = main(["check", "--device", "cpu", "--dtype", "float32", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].endswith("_loss")]
    assert len(lines) == len(selfcheck.examples()) * 2 * len(selfcheck.BACKENDS), out
    statuses = {line.split()[3] for line in lines}
    assert statuses <= {"pass", "n/a"} and "pass" in statuses, statuses
    assert out.rstrip().endswith("0 FAIL, 0 error"), out


def test_a_wrong_backend_is_a_failed_row_and_exit_status_1(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    real = flashcl.supcon_loss

    def off_by_a_little(*args, backend: str = "auto", **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, backend=backend, **kwargs)
        return out * (1.0 + 1e-3) if backend == "tiled" else out  # 1e-3: above float32's tolerance

    monkeypatch.setattr(flashcl.losses.supcon, "supcon_loss", off_by_a_little)
    code = main(["check", "--device", "cpu", "--dtype", "float32", "--loss", "supcon_loss"])
    out = capsys.readouterr().out
    assert code == 1, out
    rows = {tuple(line.split()[:4]) for line in out.splitlines() if line.startswith("supcon_loss")}
    assert ("supcon_loss", "tiled", "float32", "FAIL") in rows and ("supcon_loss", "dense", "float32", "pass") in rows


def test_a_crash_is_an_error_row_and_the_table_goes_on(monkeypatch) -> None:
    real = flashcl.triplet_loss

    def crashes_on_dense(*args, backend: str = "auto", **kwargs):  # noqa: ANN002, ANN003, ANN202
        if backend == "dense":
            raise RuntimeError("an illegal memory access")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(flashcl.losses.triplet, "triplet_loss", crashes_on_dense)
    seen = []
    rows = selfcheck.run_checks("cpu", [torch.float32], ["triplet_loss", "cosent_loss"], report=seen.append)
    assert [r.status for r in rows if r.loss == "triplet_loss"] == ["error", "pass", "n/a"]
    assert "illegal memory access" in next(r.note for r in rows if r.loss == "triplet_loss")
    assert all(r.status in ("pass", "n/a") for r in rows if r.loss == "cosent_loss")
    assert seen == rows


def test_unknown_losses_and_devices_are_clear_errors() -> None:
    with pytest.raises(SystemExit, match="unknown loss"):
        main(["check", "--device", "cpu", "--loss", "sup_con"])


def test_a_device_torch_cannot_use_is_one_clear_error(capsys: pytest.CaptureFixture) -> None:
    """--device is validated before any row: an unknown name, a backend with no device,
    a meta device: one message on stderr, exit status 2, no table (every row read
    "error" before)."""
    bad = ["bogus", "meta"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    for device in bad:
        assert main(["check", "--device", device, "--loss", "supcon_loss"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"--device {device!r}" in err, (out, err)
    assert "no CUDA device" in (err if not torch.cuda.is_available() else "no CUDA device")
