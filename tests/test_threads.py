"""The thread count of the CPU block loops (flashcl.threads): chosen by timing,
restored after the loop; the losses' values do not depend on it."""

from __future__ import annotations

import time
from typing import List

import pytest
import torch

import flashcl
from flashcl.engine import threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    threads._STATE.clear()
    yield
    threads._STATE.clear()
    torch.set_num_threads(before)


def _loop(kind: str, slow_when_many: bool, seen: List[int]) -> None:
    for _ in threads.blocks(kind, range(8), lambda start: 1.0, "cpu"):
        seen.append(torch.get_num_threads())
        # a contended machine: parallel regions slow; a quiet one: one thread slow
        many = torch.get_num_threads() > 1
        time.sleep(0.02 if many == slow_when_many else 0.005)


def test_one_thread_when_it_is_clearly_faster_and_restored_after(two_threads: None) -> None:
    seen: List[int] = []
    _loop("contended", True, seen)
    assert seen[1:3] == [1, 1] and torch.get_num_threads() == 2  # the probe, then restored
    seen.clear()
    _loop("contended", True, seen)
    assert seen == [1] * 8 and torch.get_num_threads() == 2


def test_every_thread_on_a_quiet_machine(two_threads: None) -> None:
    seen: List[int] = []
    for _ in range(3):
        seen.clear()
        _loop("quiet", False, seen)
    assert seen == [2] * 8


def test_restored_when_the_loop_body_raises(two_threads: None) -> None:
    seen: List[int] = []
    _loop("raises", True, seen)
    with pytest.raises(RuntimeError):
        loop = threads.blocks("raises", range(8), lambda start: 1.0, "cpu")
        for _ in loop:
            raise RuntimeError("stop")
    loop.close()
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("choice", [1, 2])
def test_losses_do_not_depend_on_the_thread_choice(
    two_threads: None, choice: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads._Estimates, "best", lambda self, full: choice)
    monkeypatch.setattr(threads, "PROBE_EVERY", 1)  # and every loop probes the other count on two blocks
    g = torch.Generator().manual_seed(0)
    e = torch.randn(700, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(700, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (700,), generator=g)
    for fn in (
        lambda backend: flashcl.supcon_loss(e, y, backend=backend, block_size=64),
        lambda backend: flashcl.clip_loss(e, k, 10.0, backend=backend, block_size=64),
    ):
        expected = fn("dense")
        want = torch.autograd.grad(expected, (e, k), allow_unused=True)
        got = fn("tiled")
        grads = torch.autograd.grad(got, (e, k), allow_unused=True)
        torch.testing.assert_close(got, expected)
        for a, b in zip(grads, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
    assert torch.get_num_threads() == 2
