"""The O(batch) claim, checked: a tiled call completes under an address-space
limit that the dense score matrix alone would exceed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import resource, sys, torch, flashcl
    torch.set_num_threads(1)
    b, d, backend, limit_mb = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(b, d, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (b,), generator=g)
    # Address space in use now (torch's libraries are large), plus the allowance.
    in_use = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (in_use + limit_mb * 2**20, resource.RLIM_INFINITY))
    try:
        loss = flashcl.supcon_loss(emb, labels, backend=backend)
        loss.backward()
    except (MemoryError, RuntimeError) as e:
        print("OOM", str(e)[:200]); sys.exit(3)
    assert torch.isfinite(loss) and torch.isfinite(emb.grad).all()
    print("OK", float(loss))
""")


def _run(b: int, d: int, backend: str, limit_mb: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(b), str(d), backend, str(limit_mb)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize("b", [12_000])
def test_tiled_fits_where_dense_matrix_cannot(b: int) -> None:
    # The dense B x B float32 matrix is 576 MB at B = 12000; allow 256 MB above what is in use.
    limit_mb = 256
    assert b * b * 4 > 2 * limit_mb * 2**20
    tiled = _run(b, 32, "tiled", limit_mb)
    assert tiled.returncode == 0 and "OK" in tiled.stdout, tiled.stdout + tiled.stderr
    dense = _run(b, 32, "dense", limit_mb)
    assert dense.returncode == 3 and "OOM" in dense.stdout, "the limit must be tight enough to stop dense: " + (
        dense.stdout + dense.stderr
    )
