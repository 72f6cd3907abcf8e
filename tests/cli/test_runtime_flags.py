"""Flags that only one runtime honours are never ignored in silence. Under `--runtime auto` such a flag picks the
runtime that honours it, and the log says why; under the other runtime it is a usage error (exit 2, one `error:`
line) before anything loads. Only the torch runtime has such flags (cli.torch_only_flags): --dtype and --quantize
(the llama.cpp runtime keeps the GGUF file's types) and --compile.
"""

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from conftest import cli, needs_llama_cpp
from serving import running
from test_load_errors import assert_error
from transformers import AutoModelForCausalLM, AutoTokenizer

from rbee_worker.cli.flags import build_parser
from rbee_worker.cli.model_flags import check_runtime_flags, resolve_model
from rbee_worker.hardware.devices import Placement

PROMPT = "Once upon a time, in a small village by the sea,"
NEW_TOKENS = 64
CPU = torch.device("cpu")
# A model path that does not exist: a flag error must be reported before the model is looked at.
MISSING = "/nonexistent/model.gguf"
# Every flag that only the torch runtime honours, with the name the error line gives it, per command.
TORCH_ONLY = [
    ("generate", ("--dtype", "float32"), "--dtype float32"),
    ("generate", ("--dtype", "bfloat16"), "--dtype bfloat16"),
    ("generate", ("--dtype", "float16"), "--dtype float16"),
    ("generate", ("--quantize", "none"), "--quantize none"),
    ("generate", ("--quantize", "int8"), "--quantize int8"),
    ("generate", ("--quantize", "int4"), "--quantize int4"),
    ("serve", ("--dtype", "float32"), "--dtype float32"),
    ("serve", ("--quantize", "int4"), "--quantize int4"),
    ("serve", ("--compile",), "--compile"),
]


def command(name: str, *flags: str) -> list[str]:
    """`generate` or `serve` on MISSING with `flags` (serve on a free port, so that nothing else decides)."""
    extra = ["--prompt", "hi", "--max-tokens", "2"] if name == "generate" else ["--port", "0"]
    return [name, "--model", MISSING, *extra, *flags]


@needs_llama_cpp
def test_explicit_dtype_runs_on_torch_and_gives_transformers_float32_greedy_tokens(demo_hf_dir: Path) -> None:
    """`--dtype float32` on the demo GGUF (which `auto` alone runs on llama.cpp, in the file's quantized types) runs on
    the torch runtime with every weight in float32 (not the int4 / int8 kernels, which compute in bfloat16): the greedy
    tokens are transformers' own on the weights dequantized by its GGUF loader, in float32."""
    result = cli(
        "generate", "--model", "demo", "--prompt", PROMPT, "--dtype", "float32", "--temperature", "0",
        "--max-tokens", str(NEW_TOKENS), "--json", "--log-level", "info", "--log-format", "json", fork=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    messages = [json.loads(line)["msg"] for line in result.stderr.splitlines() if line.startswith("{")]
    reason = "runtime: torch, because --dtype float32 was given and the llama.cpp runtime keeps the GGUF file's types"
    assert messages.count(reason) == 1, messages
    dequantized = "quantize: none, because --dtype float32 was given and the int4 / int8 kernels compute in bfloat16"
    assert messages.count(dequantized) == 1, messages
    assert any("(torch runtime) as float32" in m for m in messages), messages
    summary = json.loads(result.stdout)

    tokenizer = AutoTokenizer.from_pretrained(demo_hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(demo_hf_dir, dtype=torch.float32).eval()
    prompt_ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    assert summary["prompt_tokens"] == prompt_ids.shape[1]
    with torch.inference_mode():
        output = reference.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[2])
    expected = output[0, prompt_ids.shape[1] :].tolist()
    expected = expected[: expected.index(2)] if 2 in expected else expected
    assert summary["token_ids"] == expected


@pytest.mark.parametrize(("name", "flags", "written"), TORCH_ONLY, ids=[f"{n}{''.join(f)}" for n, f, _ in TORCH_ONLY])
def test_torch_only_flag_under_llama_cpp_is_a_usage_error_before_loading(
    name: str, flags: tuple[str, ...], written: str
) -> None:
    started = time.perf_counter()
    result = cli(*command(name, "--runtime", "llama.cpp", *flags))
    elapsed = time.perf_counter() - started
    line = assert_error(result, "--runtime llama.cpp", f"{written} cannot be honoured", "--runtime torch")
    assert "does not exist" not in line
    assert elapsed < 15, f"the refusal took {elapsed:.1f} s: it must come before anything heavy is imported or loaded"


def test_several_torch_only_flags_under_llama_cpp_are_named_together() -> None:
    flags = ("--dtype", "float32", "--quantize", "int8", "--compile")
    line = assert_error(cli(*command("serve", "--runtime", "llama.cpp", *flags)))
    assert "--dtype float32 and --quantize int8 cannot be honoured" in line
    assert "--compile cannot be honoured" in line
    assert "drop --dtype, --quantize and --compile or use --runtime torch" in line


@pytest.mark.parametrize(
    "flags", [(), ("--dtype", "auto"), ("--quantize", "auto"), ("--no-compile",), ("--no-cuda-graphs",)]
)
def test_defaults_and_what_llama_cpp_does_anyway_are_not_refused(flags: tuple[str, ...]) -> None:
    args = build_parser().parse_args(command("serve", "--runtime", "llama.cpp", *flags))
    check_runtime_flags(args)  # no SystemExit


@needs_llama_cpp
@pytest.mark.parametrize(
    ("flags", "runtime"),
    [
        ((), "llama.cpp"),
        (("--runtime", "llama.cpp"), "llama.cpp"),
        (("--no-compile", "--threads", "2", "--deterministic"), "llama.cpp"),
        (("--dtype", "bfloat16"), "torch"),
        (("--quantize", "none"), "torch"),
        (("--compile",), "torch"),
        (("--runtime", "torch", "--dtype", "float32"), "torch"),
    ],
)
def test_auto_picks_torch_for_a_flag_only_torch_honours(
    demo_gguf: Path, caplog: pytest.LogCaptureFixture, flags: tuple[str, ...], runtime: str
) -> None:
    args = build_parser().parse_args(["serve", "--model", str(demo_gguf), *flags])
    with caplog.at_level(logging.INFO, logger="rbee_worker"):
        assert resolve_model(args, Placement(CPU, torch.float32)).runtime == runtime
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("runtime: ")]
    if runtime == "torch" and "--runtime" not in flags:
        assert len(reasons) == 1 and "was given and the llama.cpp runtime" in reasons[0], reasons
    else:
        assert reasons == []


def test_auto_logs_no_reason_where_it_picks_torch_anyway(demo_hf_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model directory, or a CUDA device, runs on torch whatever the flags: no line claims the flag decided it."""
    for model, device in ((str(demo_hf_dir), CPU), ("demo", torch.device("cuda"))):
        args = build_parser().parse_args(["generate", "--model", model, "--prompt", "hi", "--dtype", "float32"])
        with caplog.at_level(logging.INFO, logger="rbee_worker"):
            assert resolve_model(args, Placement(device, torch.float32)).runtime == "torch"
    assert [r for r in caplog.records if r.getMessage().startswith("runtime: ")] == []


@needs_llama_cpp
def test_serve_under_auto_with_quantize_runs_on_torch(tmp_path: Path) -> None:
    """`serve --quantize none` on the demo GGUF on a CPU: /health reports the torch runtime, the log says why."""
    import httpx

    flags = ("--device", "cpu", "--quantize", "none", "--max-batch", "1", "--log-format", "json")
    with running(tmp_path, *flags, fork=True) as w:
        assert httpx.get(f"{w.url}/health", timeout=10).json()["runtime"] == "torch"
        messages = [json.loads(line)["msg"] for line in w.stderr().splitlines() if line.startswith("{")]
    reason = "runtime: torch, because --quantize none was given and the llama.cpp runtime keeps the GGUF file's types"
    assert messages.count(reason) == 1, messages
