"""`rbee-worker generate` as a real process on the demo model."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RUNTIMES, cli

from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def tokenizer(demo_gguf: Path):
    return build_tokenizer(read_gguf(demo_gguf).metadata)


def generate_json(*args: str) -> dict:
    result = cli("generate", "--model", "demo", "--json", *args, fork=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def test_json_summary(tokenizer) -> None:
    summary = generate_json("--prompt", PROMPT, "--temperature", "0", "--max-tokens", "24")
    assert set(summary) == {"text", "token_ids", "prompt_tokens", "tokens_out", "stop_reason", "seed"}
    assert summary["stop_reason"] == "MAX_TOKENS"
    assert summary["tokens_out"] == len(summary["token_ids"]) == 24
    assert summary["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])
    assert summary["text"] == tokenizer.decode(summary["token_ids"], skip_special_tokens=True)
    assert isinstance(summary["seed"], int)


def test_streamed_text_equals_json_text_and_arrives_incrementally() -> None:
    args = ["generate", "--model", "demo", "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "64"]
    process = subprocess.Popen([sys.executable, "-m", "rbee_worker", *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = process.stdout.read(1)
    first_at = time.perf_counter()
    rest = process.stdout.read()
    assert process.wait(timeout=300) == 0
    # 64 tokens take well over a second here: text that only appeared at exit would arrive all at once.
    assert time.perf_counter() - first_at > 0.3
    streamed = (first + rest).removesuffix("\n")
    assert streamed == generate_json("--prompt", PROMPT, "--temperature", "0", "--max-tokens", "64")["text"]


def test_chat_applies_the_template(tokenizer) -> None:
    summary = generate_json("--chat", "--prompt", "Say hello.", "--temperature", "0", "--max-tokens", "64")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    assert summary["prompt_tokens"] == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert summary["stop_reason"] == "EOS"
    assert 2 not in summary["token_ids"]


def test_seed_replays_and_stop_cuts() -> None:
    sampled = ["--prompt", PROMPT, "--temperature", "0.8", "--max-tokens", "24"]
    first = generate_json(*sampled)
    assert generate_json(*sampled, "--seed", str(first["seed"]))["token_ids"] == first["token_ids"]
    stop = first["text"][5:9]
    stopped = generate_json(*sampled, "--seed", str(first["seed"]), "--stop", stop)
    assert stopped["stop_reason"] == "STOP_SEQUENCE"
    assert stopped["text"] == first["text"][: first["text"].index(stop)]


def test_context_overflow_is_a_usage_error() -> None:
    result = cli("generate", "--model", "demo", "--prompt", "word " * 8000, "--max-tokens", "2048", fork=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "context" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_cache_is_sized_for_the_one_request(runtime: str) -> None:
    """generate's KV pool holds the blocks of the prompt and --max-tokens (not --max-batch contexts of the model's 8192
    tokens), and its summary line reports the KV bytes held: llama.cpp reserves its cells whole (at least 256), the
    torch runtime on a CPU holds the blocks it has written (the scratch block and the request's, of 16 tokens)."""
    max_tokens = 24
    result = cli(
        "generate", "--model", "demo", "--runtime", runtime, "--prompt", PROMPT, "--temperature", "0",
        "--max-tokens", str(max_tokens), fork=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = re.search(
        r"(\d+) prompt tokens, .* memory: \d+ MiB weights \+ ([\d.]+) MiB KV cache \(a context of (\d+) tokens\)",
        result.stderr,
    )
    assert summary, result.stderr
    prompt_tokens, kv_mib, context = int(summary[1]), float(summary[2]), int(summary[3])
    assert context == prompt_tokens + max_tokens
    # The demo's keys and values: 30 layers x 3 KV heads x 64 x 2, in F16 on llama.cpp, on torch in the CPU's
    # `--dtype auto` (bfloat16 where it computes bfloat16 natively, float32 elsewhere).
    element = 2 if runtime == "llama.cpp" else cpu_features().auto_dtype.itemsize
    bytes_per_token = 30 * 3 * 64 * 2 * element
    held_tokens = 256 if runtime == "llama.cpp" else (1 + -(-context // 16)) * 16
    assert kv_mib == round(held_tokens * bytes_per_token / 2**20, 1), result.stderr


@pytest.mark.parametrize(
    ("device", "flags", "compiled"),
    [("cuda", [], True), ("cpu", [], False), ("cuda", ["--deterministic"], False),
     ("cuda", ["--no-cuda-graphs"], False), ("cpu", ["--compile"], True), ("cuda", ["--no-compile"], False)],
)  # fmt: skip
def test_compile_defaults_to_on_inside_cuda_graphs_only(device: str, flags: list[str], compiled: bool) -> None:
    import torch

    from rbee_worker.cli.flags import build_parser
    from rbee_worker.cli.model_flags import compile_model
    from rbee_worker.hardware.devices import Placement

    args = build_parser().parse_args(["serve", "--model", "demo", *flags])
    assert compile_model(Placement(torch.device(device), torch.bfloat16), args) is compiled


@pytest.mark.parametrize(
    ("flags", "block_size", "prefix_caching"),
    [([], 16, True), (["--block-size", "32"], 32, True), (["--no-prefix-cache", "--block-size", "1"], 1, False)],
)
def test_block_size_and_prefix_cache_flags_reach_the_engine_config(
    flags: list[str], block_size: int, prefix_caching: bool
) -> None:
    import torch

    from rbee_worker.cli.flags import build_parser
    from rbee_worker.cli.serve import engine_config
    from rbee_worker.hardware.devices import Placement

    args = build_parser().parse_args(["serve", "--model", "demo", *flags])
    config = engine_config(args, Placement(torch.device("cpu"), torch.float32))
    assert (config.block_size, config.prefix_caching) == (block_size, prefix_caching)


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--block-size", "0"], "argument --block-size: 0 is outside [1, ∞]"),
        (["--block-size", "-16"], "argument --block-size: -16 is outside [1, ∞]"),
        (["--block-size", "16.5"], "argument --block-size: '16.5' is not a valid int"),
        (["--block-size"], "argument --block-size: expected one argument"),
        (["--no-prefix-cache=yes"], "argument --no-prefix-cache: ignored explicit argument 'yes'"),
    ],
)
def test_bad_kv_block_flags_are_one_line_usage_errors(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rbee_worker.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "demo", *flags])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and fragment in stderr and len(stderr.strip().splitlines()) == 1, stderr
