"""`rbee-worker bench`: how the rounds' figures and ratios are combined; what the llama.cpp peer's bare loop times."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli

from rbee_worker.benchmark.llama_cpp import batched_decode
from rbee_worker.benchmark.run import combine, paired_figures, ratios


def test_rounds_combine_by_median_and_join_runs() -> None:
    rounds = [
        {"decode_tok_s": 100.0, "aggregate_tok_s": {"16": 200.0}, "runs": {"ttft_s": [1.0]}, "amx": False},
        {"decode_tok_s": 80.0, "aggregate_tok_s": {"16": 260.0}, "runs": {"ttft_s": [2.0]}, "amx": False},
        {"decode_tok_s": 120.0, "aggregate_tok_s": {"16": 210.0}, "runs": {"ttft_s": [3.0]}, "amx": False},
    ]
    assert combine(rounds) == {
        "decode_tok_s": 100.0,
        "aggregate_tok_s": {"16": 210.0},
        "runs": {"ttft_s": [1.0, 2.0, 3.0]},
        "amx": False,
    }
    assert combine([rounds[0], {"error": "out of memory"}]) == {"error": "out of memory"}


def test_ratios_pair_each_peer_figure_with_the_workers() -> None:
    worker = {"decode_tok_s": 110.0, "aggregate_tok_s": {"1": 100.0, "16": 200.0}}
    peers = {
        "llama.cpp": {"decode_tok_s": 100.0, "aggregate_tok_s": {"16": 250.0}},
        "rbee-torch": {"decode_tok_s": 55.0, "aggregate_tok_s": {"1": 50.0, "16": 100.0}},
        "transformers": {"error": "failed"},
    }
    assert ratios(worker, peers) == {
        "decode_ratio_vs_llama.cpp": 1.1,
        "aggregate_ratio_vs_llama.cpp@16": 0.8,
        "decode_ratio_vs_rbee-torch": 2.0,
        "aggregate_ratio_vs_rbee-torch@1": 2.0,
        "aggregate_ratio_vs_rbee-torch@16": 2.0,
    }


def test_a_paired_peers_ratio_is_the_median_of_its_pairs() -> None:
    """The bare loop's runs, one a call after each of the worker's, joined in order; each ratio is the median of the
    pairs' ratios (1.0, 0.5, 0.9 at 4 streams: 0.9), where the medians' ratio would be 100 / 100 = 1.0."""
    worker = {
        "decode_tok_s": 100.0,
        "aggregate_tok_s": {"4": 100.0},
        "runs": {"aggregate_tok_s@4": [100.0, 50.0, 135.0]},
    }
    bare = [
        {"aggregate_tok_s": {"4": rate}, "decode_aggregate_tok_s": {"4": rate + 10}, "runs": {}}
        for rate in (100.0, 100.0, 150.0)
    ]  # fmt: skip
    figures = paired_figures({"decode_tok_s": 50.0, "runs": {"decode_tok_s": [50.0]}}, bare)
    assert figures["runs"] == {
        "decode_tok_s": [50.0],
        "aggregate_tok_s@4": [100.0, 100.0, 150.0],
        "decode_aggregate_tok_s@4": [110.0, 110.0, 160.0],
    }
    assert figures["aggregate_tok_s"] == {"4": 100.0}
    assert figures["decode_aggregate_tok_s"] == {"4": 110.0}
    assert ratios(worker, {"llama.cpp": figures}) == {
        "decode_ratio_vs_llama.cpp": 2.0,
        "aggregate_ratio_vs_llama.cpp@4": 0.9,
    }
    assert paired_figures({"decode_tok_s": 50.0}, [*bare, {"error": "crashed"}]) == {"error": "crashed"}


def test_bench_rejects_fewer_than_one_round_or_repeat() -> None:
    for flag in ("--rounds", "--repeats"):
        result = cli("bench", flag, "0")
        assert result.returncode == 2
        assert f"argument {flag}: 0 is outside [1," in result.stderr.strip().splitlines()[-1]


def test_bench_help_shows_every_default_and_the_work_of_a_default_run() -> None:
    result = cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    shown = [
        "default: demo", "default: cpu", "default: auto", "default: 512", "default: 128", "default: 1,4,16,64",
        "default: greedy", "default: 3", "default: 1)", "default: transformers", "default: a new directory rbee-bench-",
        "default: warning", "33,152 generated tokens",
    ]  # fmt: skip
    for default in shown:
        assert default in text, (default, text)


def test_bench_writes_to_a_new_directory_outside_the_repository_by_default(tmp_path: Path) -> None:
    """A tiny run (the worker alone) from a directory that has a bench/results of its own: the results go to a new
    rbee-bench-<date>-<time> directory there, and bench/results is left alone."""
    recorded = tmp_path / "bench" / "results"
    recorded.mkdir(parents=True)
    tiny = ["--gen-tokens", "4", "--prompt-tokens", "16", "--concurrency", "1", "--repeats", "1", "--peers="]
    command = [sys.executable, "-m", "rbee_worker", "bench", *tiny]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert not any(recorded.iterdir())
    [out] = tmp_path.glob("rbee-bench-*")
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".md"]
    assert f"results: {out.name}/bench_demo_cpu_auto_c1_" in result.stdout
    assert "leaked" not in result.stderr  # its frozen heap is given back before the interpreter's finalization


def test_llama_cpp_batched_decode_counts_the_prompts_as_the_workers_aggregate_does(demo_gguf: Path) -> None:
    """The bare llama_decode loop's aggregate covers the work the worker's aggregate covers (the prompts' batch and
    every token), so it is below its figure over the decode steps alone, which leaves the prompts out."""
    pytest.importorskip("llama_cpp")
    prompts = [[*range(1000, 1200), i] for i in range(4)]
    run = batched_decode(str(demo_gguf), 2, prompts, 8)
    assert 0 < run.aggregate_tok_s < run.decode_aggregate_tok_s
    assert [len(tokens) for tokens in run.tokens] == [8] * 4


def test_llama_cpp_batched_decode_samples_with_llama_cpps_sampler_chain(demo_gguf: Path) -> None:
    """Sampled, each sequence draws from its own seeded chain: two sequences of one prompt part ways (greedy, they
    stay the same), and a second run draws the same tokens."""
    pytest.importorskip("llama_cpp")
    prompts = [[*range(1000, 1020)]] * 2
    greedy = batched_decode(str(demo_gguf), 2, prompts, 16, {"temperature": 0.0, "top_p": 1.0}).tokens
    chat = {"temperature": 0.7, "top_p": 0.9}
    sampled = batched_decode(str(demo_gguf), 2, prompts, 16, chat).tokens
    assert greedy[0] == greedy[1]
    assert sampled[0] != sampled[1]
    assert sampled != greedy
    assert batched_decode(str(demo_gguf), 2, prompts, 16, chat).tokens == sampled


def test_cold_start_bench_reports_first_over_last_round_and_the_ratio_to_greedy() -> None:
    """bench/cold_start.py's figures from fake rounds: the cold ratio (round 1 over the last), the steady aggregate
    (median of rounds 2..N) against greedy's, the must-show checks and the table; fewer than two rounds refused."""
    import importlib.util

    path = Path(__file__).parents[2] / "bench" / "cold_start.py"
    module_spec = importlib.util.spec_from_file_location("cold_start", path)
    cold_start = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(cold_start)

    def rounds(walls: list[float], tokens: int) -> list[dict]:
        return [
            {"wall_s": w, "aggregate_tok_s": tokens / w, "ttft_s": 0.1, "decode_tok_s": 50.0, "tokens": tokens}
            for w in walls
        ]

    result = {
        "spec": {"rounds": 5},
        "modes": {
            "greedy": {"1": cold_start.summarize(rounds([2.0, 1.0, 1.0, 1.0, 1.0], 100)),
                       "64": cold_start.summarize(rounds([3.0, 2.0, 2.0, 2.0, 2.0], 6400))},
            "chat+logprobs5": {"1": cold_start.summarize(rounds([1.05, 1.0, 1.0, 1.0, 1.0], 100)),
                               "64": cold_start.summarize(rounds([2.5, 2.5, 2.5, 2.5, 2.5], 6400))},
        },
    }  # fmt: skip
    assert result["modes"]["greedy"]["1"]["cold_ratio"] == 2.0
    assert result["modes"]["greedy"]["64"]["steady_aggregate_tok_s"] == 3200.0
    checks = cold_start.checks(result, 64)
    assert checks["worst_cold_ratio"] == (2.0, "greedy@1") and not checks["cold_ratios_ok"]
    assert checks["logprobs5_over_greedy@64"] == 0.8 and not checks["logprobs_ok"]
    table = cold_start.table(result).splitlines()
    assert len(table) == 2 + 4 and "| chat+logprobs5 | 64 | 2.500 | 2.500 | 1.00 |" in table[-1]
    assert table[-1].endswith("| 0.800 |")
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--model", "demo", "--rounds", "1"])
    assert cold_start.parse_args(["--model", "demo"]).modes == list(cold_start.MODES)
