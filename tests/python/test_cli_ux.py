"""Small things a new user of the command line meets: plurals, --quiet, --plot refused up
front, benchmark progress and its JSON, PAGEDATTN_NUM_THREADS refused when not a number,
and the `pagedattn` console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import pagedattn
from pagedattn import __main__ as cli_main
from pagedattn.demo import report

SMALL = ["--requests", "8", "--device", "cpu", "--seed", "3"]


def run(args, env=None, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})  # fmt: skip


def test_plural():
    assert report.plural(1, "block") == "1 block"
    assert report.plural(0, "block") == "0 blocks"
    assert report.plural(2, "sequence") == "2 sequences"


def test_report_says_one_request_not_one_requests():
    out = run(["-m", "pagedattn", "--requests", "1", "--device", "cpu", "--quiet"])
    assert out.returncode == 0, out.stderr
    assert "served 1 request (" in out.stdout
    assert "1 requests" not in out.stdout and "1 sequences" not in out.stdout and "1 blocks" not in out.stdout
    assert "for 1 prefill " in out.stdout and "1 prefills" not in out.stdout  # one request: one prefill


def test_quiet_output_starts_with_the_report():
    out = run(["-m", "pagedattn", *SMALL, "--quiet"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("served 8 requests"), out.stdout[:80]


def test_header_and_report_are_separated_by_one_blank_line():
    out = run(["-m", "pagedattn", *SMALL])
    assert out.returncode == 0, out.stderr
    assert "\n\nserved 8 requests" in out.stdout and "\n\n\nserved" not in out.stdout


def test_bench_plot_without_matplotlib_fails_before_the_benchmark(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(report, "plot_unavailable_reason", lambda: "--plot needs matplotlib, which is not installed")
    rc = cli_main.main(["bench", "--device", "cpu", "--reps", "1", "--json", str(tmp_path / "b.json"),
                        "--plot", str(tmp_path / "b.png")])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2
    assert "error: --plot needs matplotlib" in captured.err
    assert "GB/s" not in captured.out and not (tmp_path / "b.json").exists()  # nothing ran


def test_bench_reports_progress_and_its_json_holds_the_plotted_sweep(monkeypatch, capsys, tmp_path):
    plotted = {}

    def fake_plot(series, path, title):
        plotted.update(series=series, path=path, title=title)

    monkeypatch.setattr(report, "plot_unavailable_reason", lambda: None)
    monkeypatch.setattr(cli_main, "_plot_gbs", fake_plot)
    path = tmp_path / "b.json"
    rc = cli_main.main(["bench", "--device", "cpu", "--reps", "1", "--json", str(path),
                        "--plot", str(tmp_path / "b.png")])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0
    assert "[1/4] " in captured.err and "[4/4] " in captured.err  # one progress line per shape
    result = json.loads(path.read_text())
    sweep = result["context_sweep"]
    assert sweep["shape"] == cli_main.SWEEP_SHAPE
    assert set(sweep["series"]) == set(plotted["series"])
    for label, points in plotted["series"].items():
        assert [(p["context"], p["gbs"]) for p in sweep["series"][label]] == points
        assert [c for c, _ in points] == list(cli_main.SWEEP_CONTEXTS)
    assert "head size 128" in plotted["title"]  # the plot names the shape


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "4 threads"])
def test_num_threads_env_that_is_not_a_count_is_refused(value):
    out = run(["-c", "import pagedattn; print(pagedattn._core.num_threads())"], env={"PAGEDATTN_NUM_THREADS": value})
    assert out.returncode != 0
    assert "ValueError: PAGEDATTN_NUM_THREADS: expected a whole number of threads" in out.stderr
    assert f"got '{value}'" in out.stderr


@pytest.mark.parametrize("value, threads", [("3", 3), (" 2 ", 2), ("100000", 256), ("", None)])
def test_num_threads_env_accepted(value, threads):
    out = run(["-c", "import pagedattn; print(pagedattn._core.num_threads())"], env={"PAGEDATTN_NUM_THREADS": value})
    assert out.returncode == 0, out.stderr
    expected = threads if threads is not None else min(os.cpu_count() or 1, 256)
    assert int(out.stdout) == expected


def test_console_script_names_itself():
    exe = shutil.which("pagedattn", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the pagedattn console script is not installed beside this Python")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pagedattn ")
    bench = subprocess.run([exe, "bench", "--device", "cpu", "--help"], capture_output=True, text=True, timeout=120)
    assert "usage: pagedattn bench" in bench.stdout


def test_module_usage_names_python_m():
    out = run(["-m", "pagedattn", "--help"])
    assert out.stdout.startswith("usage: python -m pagedattn ")
    assert pagedattn.__version__
