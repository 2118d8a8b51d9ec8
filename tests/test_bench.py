"""The benchmark CLI at tiny sizes: files written, losses that must agree do, caps reported."""

from __future__ import annotations

import json

import pytest

from flashcl.__main__ import main
from flashcl.bench.cli import run_cases
from flashcl.bench.measure import measure


def test_supcon_implementations_agree_and_files_are_written(tmp_path) -> None:
    bound = {"workload": "gemm3", "params": {"B": 64, "D": 8}}
    cases = [
        {
            "group": "supcon",
            "label": impl,
            "workload": "supcon",
            "repeats": 1,
            "bound": bound,
            "params": {"B": 64, "D": 8, "classes": 3, "impl": impl},
        }
        for impl in ("flashcl-tiled", "flashcl-dense", "pml")
    ]
    rows = run_cases(cases, cap_s=120, mem_limit_mb=None)
    assert all(r["status"] == "ok" for r in rows), rows
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
    assert all(r["ratio"] == r["time_s"] / r["bound_s"] for r in rows)


def test_neighbor_implementations_agree() -> None:
    rows = run_cases(
        [
            {
                "group": "nb",
                "label": impl,
                "workload": "neighbor",
                "repeats": 0,
                "params": {"n": 50, "k": 2, "impl": impl},
            }
            for impl in ("python-loops", "gather-fix", "flashcl-tiled", "flashcl-dense")
        ],
        cap_s=120,
        mem_limit_mb=None,
    )
    losses = [r["loss"] for r in rows]
    assert all(r["status"] == "ok" for r in rows), rows
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses


@pytest.mark.parametrize(
    "workload,impls,params",
    [
        ("queue", ("flashcl-tiled", "flashcl-pml-adapter", "pml"), {"B": 16, "D": 8, "Q": 64, "classes": 4}),
        ("gist", ("flashcl-tiled", "flashcl-dense", "sentence-transformers"), {"B": 24, "D": 8, "G": 6}),
        ("ranking", ("flashcl-tiled", "sentence-transformers"), {"B": 40, "D": 8, "loss": "cosent"}),
        (
            "ranking",
            ("flashcl-tiled", "sentence-transformers"),
            {"B": 40, "D": 8, "loss": "triplet", "mining": "hard", "formula": "st"},
        ),
        (
            "ranking",
            ("flashcl-tiled", "pml"),
            {"B": 40, "D": 8, "loss": "triplet", "mining": "all", "formula": "pml"},
        ),
        ("ranking", ("flashcl-tiled", "pml"), {"B": 16, "D": 8, "C": 300, "loss": "cosface"}),
    ],
)
def test_beyond_the_batch_workloads_agree(workload: str, impls: tuple, params: dict) -> None:
    rows = run_cases(
        [
            {"group": workload, "label": impl, "workload": workload, "repeats": 1, "params": dict(params, impl=impl)}
            for impl in impls
        ],
        cap_s=120,
        mem_limit_mb=None,
    )
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(r["status"] in ("ok", "not installed") for r in rows), rows
    assert len(ok) >= 2, rows
    losses = [r["loss"] for r in ok]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses


def test_a_case_past_its_cap_is_reported_capped() -> None:
    """The cap counts the case's timed calls, not the child's start and set-up."""
    res = measure("neighbor", {"n": 3000, "k": 3, "impl": "python-loops"}, repeats=0, cap_s=3)
    assert res == {"status": "capped", "cap_s": 3, "error": "stopped in its timed calls"}


@pytest.mark.parametrize("cap", ["0", "-1", "nan", "inf", "ten"])
def test_a_cap_that_is_not_a_positive_number_of_seconds_is_refused(cap: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--cap", cap])
    assert e.value.code == 2 and "a positive number of seconds" in capsys.readouterr().err


@pytest.mark.slow
def test_the_users_cap_replaces_every_cases_own(tmp_path) -> None:
    """``--cap`` is every case's cap, a suite's own (6 s for the per-sample loop) included."""
    assert main(["bench", "--quick", "--suite", "simcse", "--cap", "0.001", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 8 and {r["cap_s"] for r in rows} == {0.001}, rows
    # the smallest cases finish inside a millisecond or not: none waits for a longer cap
    assert all(r["status"] in ("ok", "capped") for r in rows), rows
    assert any(r["status"] == "capped" and r["label"] == "simcse-per-sample" for r in rows), rows


def test_a_peer_that_is_not_installed_is_reported_not_crashed(monkeypatch) -> None:
    from flashcl.bench import peers
    from flashcl.bench.child import run_spec

    monkeypatch.setattr(peers, "pml_losses", lambda: (None, "pytorch-metric-learning not installed"))
    # in this process (the child's body): a forked child would not see the monkeypatch
    res = run_spec({"workload": "supcon", "params": {"B": 16, "D": 4, "impl": "pml"}, "repeats": 0})
    assert res["status"] == "not installed" and "pytorch-metric-learning" in res["error"]


def test_a_case_past_its_memory_limit_is_reported_oom() -> None:
    res = measure("supcon", {"B": 20000, "D": 8, "impl": "flashcl-dense"}, repeats=0, cap_s=120, mem_limit_mb=200)
    assert res["status"] == "oom", res


@pytest.mark.slow
def test_cli_quick_run_writes_json_and_markdown(tmp_path) -> None:
    # a cap no case of --quick comes near, however busy the machine: this checks the
    # figures and files, not the speed (the cap's own behaviour is tested above)
    assert main(["bench", "--quick", "--cap", "300", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["machine"]["torch"] and data["rows"]
    assert (tmp_path / "report.md").read_text().startswith("Measured")
    suites = {r["suite"] for r in data["rows"]}
    assert suites == {"neighbors", "simcse", "peers", "scale"}
    for suite in suites:
        assert (tmp_path / f"{suite}.png").stat().st_size > 1000
    # the loss values that must agree do: every implementation of one SimCSE size
    for b in {r["params"]["B"] for r in data["rows"] if r["suite"] == "simcse"}:
        vals = [
            r["loss"] for r in data["rows"] if r["suite"] == "simcse" and r["params"]["B"] == b and r["status"] == "ok"
        ]
        assert len(vals) == 4 and max(vals) - min(vals) < 1e-4 * abs(vals[0]), vals


@pytest.mark.slow
def test_dist_suite_runs_both_strategies(tmp_path) -> None:
    from flashcl.bench.suites import dist

    rows = run_cases(dist("quick", "cpu"), cap_s=120, mem_limit_mb=None)
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    for r in rows:
        assert len(r["per_rank"]) == r["params"]["world"]
    # the same global batch gives the same loss whatever the strategy
    by_key = {}
    for r in rows:
        by_key.setdefault((r["group"], r["params"]["B"], r["params"]["world"]), []).append(r["loss"])
    for vals in by_key.values():
        assert max(vals) - min(vals) < 1e-4 * abs(vals[0]), vals


def test_gpu_suite_plots_one_panel_per_loss_and_width(tmp_path) -> None:
    """The GPU suite's plot, from rows shaped as the suite makes them (no GPU needed):
    one panel per (loss, D), each implementation once in the legend."""
    from flashcl.bench.report import plot
    from flashcl.bench.suites import gpu

    cases = gpu("default", "cuda")
    groups = {c["group"] for c in cases}
    assert {"info_nce D=768", "supcon D=4096", "clip D=256", "info_nce D=768 float32"} <= groups
    rows = [
        {**c, "suite": "gpu", "status": "ok", "time_s": 0.01 * (i + 1), "bound_s": 0.005, "peak_mb": 1.0}
        for i, c in enumerate(cases)
    ]
    paths = plot(rows, str(tmp_path))
    assert paths == [str(tmp_path / "gpu.png")] and (tmp_path / "gpu.png").stat().st_size > 10_000


def test_plots_one_panel_per_k_with_a_title_that_states_the_result(tmp_path) -> None:
    """The neighbour loss's rows (as the suite writes them) give one panel per k,
    and each panel's title names flashcl's gap to the slowest implementation."""
    from flashcl.bench.report import panel_finding, panel_key, plot

    rows = []
    for k in (1, 2):
        for n in (1000, 2000):
            for impl, t in (("python-loops", 0.5 * n / 1000), ("gather-fix", 0.004), ("flashcl-tiled", 0.002)):
                rows.append(
                    {
                        "suite": "neighbors",
                        "workload": "neighbor",
                        "group": f"n={n}",
                        "label": impl,
                        "status": "ok",
                        "params": {"n": n, "k": k, "impl": impl},
                        "time_s": t,
                        "peak_mb": 10.0,
                    }
                )
    assert sorted({panel_key(r) for r in rows}) == ["k = 1 neighbours", "k = 2 neighbours"]
    panel = [r for r in rows if r["params"]["k"] == 2]
    assert panel_finding(panel) == (
        "flashcl-tiled 500x faster than python-loops (2000); 2.0x faster than gather-fix (2000)"
    )
    assert plot(rows, str(tmp_path)) == [str(tmp_path / "neighbors.png")]


def _fake_rows(cases, failed_group: str, suite: str) -> list:
    """Rows shaped as run_cases makes them for ``cases``: every case measured, except
    every implementation of ``failed_group`` in ``suite``, capped."""
    rows = []
    for i, case in enumerate(cases):
        if case["suite"] == suite and case["group"] == failed_group:
            rows.append({**case, "status": "capped", "cap_s": 10.0, "wall_s": 10.0})
            continue
        t = 0.01 * (1 + i % 7)
        rows.append(
            {
                **case,
                "status": "ok",
                "fwd_s": t / 2,
                "bwd_s": t / 2,
                "time_s": t,
                "bound_s": t / 2,
                "ratio": 2.0,
                "peak_mb": 10.0 + i,
                "steady_peak_mb": 5.0,
                "grad_mb": 1.0,
                "loss": 1.5,
                "wall_s": 1.0,
            }
        )
    return rows


def test_default_run_writes_its_whole_report_when_a_panel_has_no_result(tmp_path, monkeypatch) -> None:
    """The default suites' report, results and plots, from rows shaped as the default
    run makes them, where every implementation of one panel (SigLIP) was capped: the
    report, results.json and every plot are written, and the empty panel says why."""
    from flashcl.bench import cli
    from flashcl.bench.suites import DEFAULT_SUITES, SUITES

    cases = [{**c, "suite": name} for name in DEFAULT_SUITES for c in SUITES[name]("default", "cpu")]
    assert any(c["suite"] == "peers" and c["group"] == "siglip" for c in cases)
    rows = _fake_rows(cases, "siglip", "peers")
    monkeypatch.setattr(cli, "run_cases", lambda *a, **k: rows)
    assert main(["bench", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == len(rows) and data["plot_errors"] == {}
    report = (tmp_path / "report.md").read_text()
    assert "**siglip**: no result: flashcl-tiled capped at 10.0 s; open_clip capped at 10.0 s" in report
    for suite in DEFAULT_SUITES:
        assert (tmp_path / f"{suite}.png").stat().st_size > 1000, suite


def test_a_failing_plot_loses_neither_the_report_nor_the_other_plots(tmp_path, monkeypatch) -> None:
    from flashcl.bench import cli

    cases = [
        {"suite": s, "group": "g", "label": "flashcl-tiled", "workload": "supcon", "params": {"B": b, "D": 4}}
        for s in ("one", "two")
        for b in (8, 16)
    ]
    rows = _fake_rows(cases, "", "")
    real = cli.plot

    def plot(rows, out):
        if rows[0]["suite"] == "one":
            raise RuntimeError("broken plot")
        return real(rows, out)

    monkeypatch.setattr(cli, "run_cases", lambda *a, **k: rows)
    monkeypatch.setattr(cli, "plot", plot)
    assert main(["bench", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["plot_errors"] == {"one": "RuntimeError: broken plot"}
    assert data["plots"] == [str(tmp_path / "two.png")] and len(data["rows"]) == 4
    assert (tmp_path / "report.md").read_text().startswith("Measured")


def test_late_interaction_workloads_agree_with_their_peers() -> None:
    """Every implementation of the late-interaction suite runs, and each peer's value
    equals its flashcl drop-in's (the peers' padding convention), the tiled loss the
    dense one's."""
    from flashcl.bench import late
    from flashcl.bench.workloads import NotInstalled

    values = {}
    for impl in ("flashcl-tiled", "flashcl-dense", "pylate", "flashcl-pylate", "colpali-engine", "flashcl-colpali"):
        try:
            step, grad_bytes = late.late_interaction({"B": 12, "Lq": 6, "Ld": 10, "D": 8, "impl": impl})
        except NotInstalled:
            continue
        values[impl] = step()[0]
        assert grad_bytes == 12 * (6 + 10) * 8 * 4
    assert values["flashcl-tiled"] == pytest.approx(values["flashcl-dense"], rel=1e-5)
    for peer, ours in (("pylate", "flashcl-pylate"), ("colpali-engine", "flashcl-colpali")):
        if peer in values:
            assert values[peer] == pytest.approx(values[ours], rel=1e-5), peer
    with pytest.raises(NotInstalled, match="CUDA"):
        late.late_interaction({"B": 4, "Lq": 2, "Ld": 3, "D": 4, "impl": "flash-maxsim"})


@pytest.mark.parametrize(
    "params,impls",
    [
        ({"B": 96, "D": 16, "loss": "supcon"}, ("builtin", "flex", "dense")),
        ({"B": 96, "D": 16, "loss": "supcon", "symmetric": True}, ("flex",)),
        ({"B": 96, "D": 16, "loss": "info_nce"}, ("builtin", "flex", "dense")),
        ({"B": 600, "D": 16, "loss": "window", "window": 40}, ("flex", "flex-blocks", "dense")),
        ({"B": 96, "D": 16, "loss": "window", "window": 30, "duplicates": True}, ("flex", "dense")),
    ],
)
def test_the_flex_suites_implementations_agree(params: dict, impls: tuple) -> None:
    """Each flex workload's implementations (the flex call, the built-in it equals, the
    dense masked formula as written without flashcl, the block mask) give one loss."""
    from flashcl.bench.flex import flex, flex_workload

    reference = flex_workload({**params, "impl": "dense" if "dense" in impls else "builtin"})[0]()[0]
    for impl in impls:
        loss, _ = flex_workload({**params, "impl": impl})[0]()
        assert abs(loss - reference) < 1e-4 * max(1.0, abs(reference)), (params, impl, loss, reference)
    assert {c["params"]["impl"] for c in flex("quick", "cpu")} == {"flex", "flex-blocks", "dense"}


@pytest.mark.slow
def test_metric_suite_agrees_with_pml(tmp_path) -> None:
    """``--suite metric --quick``: every loss by flashcl and by pytorch-metric-learning's
    classes (with its miner), the same values; the bound row against the three GEMMs."""
    pytest.importorskip("pytorch_metric_learning")
    assert main(["bench", "--quick", "--suite", "metric", "--cap", "300", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert any(r.get("bound_s") for r in rows)
    for loss in ("multi_similarity", "circle", "proxy_anchor"):
        vals = {r["label"]: r["loss"] for r in rows if r["params"]["loss"] == loss and "bound" not in r}
        assert set(vals) == {"flashcl-tiled", "pml"} and abs(vals["pml"] - vals["flashcl-tiled"]) < 1e-4 * abs(
            vals["pml"]
        ), (loss, vals)
