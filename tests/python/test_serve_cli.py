"""`python -m pagedattn` (the serving demo), `python -m pagedattn bench` and
`python -m pagedattn selfcheck` from the command line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import pagedattn
from pagedattn.__main__ import main
from pagedattn.demo import cli

SMALL = ["--requests", "8", "--device", "cpu", "--seed", "3"]


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedattn", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_serves_and_prints_the_report(tmp_path):
    out = run_cli(*SMALL, "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    for text in ("serving demo on cpu", "served 8 requests", "tokens generated", "tokens/s", "peak",
                 "preemptions", "prefix-cache hits", "paged", "contiguous", "largest batch",
                 "against dense float64 attention: all within tolerance"):  # fmt: skip
        assert text in out.stdout, (text, out.stdout)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["requests"] == 8 and report["tokens_generated"] > 0
    assert report["checked_decode_outputs"] > 0
    assert len(report["timeline"]["used_blocks"]) == report["iterations"]


def test_cli_quiet_prints_only_the_report():
    out = run_cli(*SMALL, "--quiet")
    assert out.returncode == 0, out.stderr
    assert "serving demo on" not in out.stdout and "served 8 requests" in out.stdout
    assert "requests |" not in out.stderr  # no progress bar


def test_cli_fails_loudly_on_a_wrong_attention_output(monkeypatch, capsys):
    real = pagedattn.paged_attention

    def wrong(*args, **kw):
        out = real(*args, **kw)
        out[-1, 0, 0] = -out[-1, 0, 0] + 1.0
        return out

    monkeypatch.setattr(pagedattn, "paged_attention", wrong)
    rc = main([*SMALL, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "CHECK FAILED" in err and "differs from dense float64 attention" in err


def test_cli_refuses_a_pool_smaller_than_one_sequence(capsys):
    rc = main([*SMALL, "--memory", "10blocks"])
    assert rc == 2
    assert "raise --memory" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "plot_unavailable_reason", lambda: "--plot needs matplotlib, which is not installed")
    rc = main([*SMALL, "--quiet", "--plot", str(tmp_path / "m.png")])
    captured = capsys.readouterr()
    assert rc == 0
    assert "needs matplotlib" in captured.err and "served 8 requests" in captured.out
    assert not (tmp_path / "m.png").exists()


def test_cli_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    rc = main([*SMALL, "--quiet", "--plot", str(path)])
    assert rc == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_other_options_and_cmake_dir(capsys):
    assert main(["--cmake-dir"]) == 0
    assert capsys.readouterr().out.strip() == pagedattn.cmake_dir()
    assert main(["--include-dir"]) == 0
    assert capsys.readouterr().out.strip() == pagedattn.include_dir()
    rc = main(["serve", *SMALL, "--quiet", "--dtype", "float32", "--preempt", "recompute", "--memory", "4MB",
               "--no-prefix-caching", "--check", "0.5", "--block-size", "32"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "float32" in out and "prefix-cache hits     off" in out and "(a 50% sample per step)" in out


@pytest.mark.parametrize(
    "text, blocks",
    [("4", 4 * 2**20 // 16384), ("4MB", 256), ("0.5mb", 32), ("300blocks", 300), ("7b", 7), (" 2 MiB ", 128)],
)
def test_parse_memory(text, blocks):
    assert cli.parse_memory(text, 16384) == blocks


@pytest.mark.parametrize("text", ["", "four", "1.5blocks", "-3", "4GB"])
def test_parse_memory_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_memory(text, 16384)


def test_selfcheck_command_still_works():
    out = run_cli("selfcheck", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "self-check passed" in out.stdout


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_bench_on_cpu(tmp_path, device):
    if device == "auto" and pagedattn.built_with_cuda():
        pytest.skip("with CUDA, `bench` runs the GPU benchmark (tests/python/test_cuda_*.py cover the kernels)")
    path = tmp_path / "bench.json"
    args = ["--device", device] if device != "auto" else []
    out = run_cli("bench", *args, "--reps", "1", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "GB/s" in out.stdout and "NumPy" in out.stdout and "speed-up" in out.stdout
    rows = json.loads(path.read_text())["rows"]
    assert rows and all(r["pagedattn_gbps"] > 0 and r["numpy_gbps"] > 0 for r in rows)


def test_bench_plot_on_cpu(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gbs.png"
    out = run_cli("bench", "--device", "cpu", "--reps", "1", "--plot", str(path))
    assert out.returncode == 0, out.stderr
    assert "context  8192" in out.stdout
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
