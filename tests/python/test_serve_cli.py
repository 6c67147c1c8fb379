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
                 "chunked prefill under a budget of 512 tokens per step", "engine steps", "prompt chunks",
                 "mixed decode + prefill", "prefill-chunk",
                 "against dense float64 attention: all within tolerance"):  # fmt: skip
        assert text in out.stdout, (text, out.stdout)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["requests"] == 8 and report["tokens_generated"] > 0
    assert report["checked_decode_outputs"] > 0
    assert len(report["timeline"]["used_blocks"]) == report["iterations"]
    # The step mix agrees with the per-step record in the same file.
    mx, steps = report["step_mix"], report["steps"]
    assert mx["token_budget"] == 512 and mx["steps"] == len(steps["step"]) > 0
    assert mx["decode_tokens"] == sum(steps["decode_tokens"])
    assert mx["prefill_chunk_tokens"] == sum(steps["prefill_tokens"]) == report["prefill_tokens_computed"]
    assert mx["prompt_chunks"] == sum(steps["chunks"])
    assert report["checked_prefill_outputs"] == 2 * mx["prefill_chunk_tokens"]  # every row, both layers
    assert f"{mx['decode_tokens']} decode + {mx['prefill_chunk_tokens']} prefill-chunk" in out.stdout


def test_cli_token_budget_splits_prompts(tmp_path):
    path = tmp_path / "r.json"
    rc = main([*SMALL, "--quiet", "--max-num-batched-tokens", "24", "--max-batch", "16", "--json", str(path)])
    assert rc == 0
    mx = json.loads(path.read_text())["step_mix"]
    assert mx["token_budget"] == 24 and mx["peak_tokens_per_step"] == 24
    assert mx["chunked_prefills"] > 0 and mx["chunks_per_prefill_max"] >= 3 and mx["mixed_steps"] > 0
    assert sum(int(k) * v for k, v in mx["chunks_per_prefill_histogram"].items()) == mx["prompt_chunks"]


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


def test_cli_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "plot_unavailable_reason", lambda: "--plot needs matplotlib, which is not installed")
    rc = main([*SMALL, "--quiet", "--plot", str(tmp_path / "m.png")])
    captured = capsys.readouterr()
    assert rc == 2
    assert "error: --plot needs matplotlib" in captured.err
    assert "served" not in captured.out  # nothing ran
    assert not (tmp_path / "m.png").exists()


def test_cli_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    rc = main([*SMALL, "--quiet", "--plot", str(path)])
    assert rc == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # Two panels (KV memory, step mix): 8 x 7 inches at 120 dpi.
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (960, 840)


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


@pytest.mark.parametrize(
    "text", ["", "four", "1.5blocks", "-3", "4GB", "1e30", "12345678901234567890blocks", f"{2**20 + 1}MB"]
)
def test_parse_memory_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_memory(text, 16384)


def test_parse_memory_refuses_blocks_totalling_more_than_the_bound():
    assert cli.parse_memory("1000blocks", 2**20) == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="exceed"):
        cli.parse_memory(f"{cli.MAX_POOL_MB + 1}blocks", 2**20)


# (arguments, option the one-line error must name). Every case must fail in argument
# checking, before the model, the pools or the benchmark exist.
BAD_COMMAND_LINES = [
    (["--memory", "-5"], "--memory"),
    (["--memory", "abc"], "--memory"),
    (["--memory", "1e30"], "--memory"),
    (["--memory", "2.5blocks"], "--memory"),
    (["--memory", f"{2**20 + 1}"], "--memory"),
    (["--memory", "12345678901234567890blocks"], "--memory"),
    (["--cpu-memory", "abc"], "--cpu-memory"),
    (["--cpu-memory", "12345678901234567890blocks"], "--cpu-memory"),
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "2000"], "--block-size"),
    (["--block-size", "sixteen"], "--block-size"),
    (["--requests", "1000000000"], "--requests"),
    (["--requests", "0"], "--requests"),
    (["--rate", "nan"], "--rate"),
    (["--rate", "0"], "--rate"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", "-5"], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", "many"], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", "2.5"], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", str(2**20 + 1)], "--max-num-batched-tokens"),
    (["--max-num-batched-tokens", "64"], "--max-num-batched-tokens"),  # smaller than --max-batch (128)
    (["--max-num-batched-tokens", "20", "--max-batch", "21"], "--max-num-batched-tokens"),
    (["--check", "1.5"], "--check"),
    (["--seed", "-5"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--blas-threads", "-1"], "--blas-threads"),
    (["--json", "/nonexistent-folder-of-pagedattn/r.json"], "--json"),
    (["--json", "."], "--json"),
    (["--plot", "/nonexistent-folder-of-pagedattn/m.png"], "--plot"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--reps", "-3"], "--reps"),
    (["bench", "--json", "/nonexistent-folder-of-pagedattn/b.json"], "--json"),
    (["selfcheck", "--seed", "-5"], "--seed"),
]


@pytest.mark.parametrize("args, option", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_line_is_one_line_and_exit_code_2(args, option, tmp_path):
    if args[0] not in ("bench", "selfcheck"):
        args = ["--device", "cpu", "--requests", "4", *args] if "--requests" not in args else ["--device", "cpu", *args]
    out = subprocess.run([sys.executable, "-m", "pagedattn", *args], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # no traceback, no usage block
    assert "error:" in lines[0] and option in lines[0], lines[0]
    assert "Traceback" not in out.stderr
    # Nothing ran: no header, report or benchmark table, and no file written.
    assert out.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_help_states_the_bounds():
    out = run_cli("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for bound in (f"1 to {cli.MAX_REQUESTS}", f"at most {cli.MAX_POOL_MB} MB", f"1 to {cli.MAX_BLOCK_SIZE} on the CPU",
                  "0 to 2^63 - 1", f"1 to {cli.MAX_NUM_BATCHED_TOKENS}"):  # fmt: skip
        assert bound in text, bound
    bench = run_cli("bench", "--device", "cpu", "--help")
    assert "1 to 100000" in " ".join(bench.stdout.split())


def test_cuda_block_size_is_checked_before_the_backend_is_built(monkeypatch, capsys):
    parser = cli.ArgumentParser()
    cli.add_serve_arguments(parser)
    args = parser.parse_args(["--requests", "4", "--block-size", "48", "--quiet"])  # not a power of two
    monkeypatch.setattr(cli, "_resolve_device", lambda device, lib: "cuda")
    monkeypatch.setattr(cli, "make_backend", lambda *a: pytest.fail("the backend must not be built"))
    assert cli.serve(args) == 2
    err = capsys.readouterr().err
    assert "--block-size" in err and "48" in err and len(err.strip().splitlines()) == 1


def test_a_pool_that_cannot_be_allocated_is_a_clean_error(monkeypatch, capsys):
    parser = cli.ArgumentParser()
    cli.add_serve_arguments(parser)
    args = parser.parse_args(["--requests", "4", "--device", "cpu", "--quiet"])

    def no_memory(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(cli, "Engine", no_memory)
    assert cli.serve(args) == 2
    err = capsys.readouterr().err
    assert "cannot allocate the KV pools" in err and "--memory" in err


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
