"""What the CPU can do (rbee_worker/hardware/cpu_features.py) and the paths chosen from it.

The suite runs on the machine's own CPU and, with `RBEE_CPU_ISA=avx2`, as on an AVX2-only x86 CPU (most laptops): the
tests here hold in both, and those that force an instruction set themselves run the worker in a child process, since
torch fixes its kernels' instruction set once per process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import cli, engine_config, greedy
from serving import execute, running

from rbee_worker.engine.engine import Engine
from rbee_worker.hardware.cpu_features import FORCE_VARIABLE, CpuFeatures, cpu_features
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.layers.cpu_linear import PackedLinear
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.loading.loader import load_model

X86 = pytest.mark.skipif(cpu_features().arch not in ("x86_64", "amd64"), reason="forcing an x86 instruction set")


def features(arch: str, flags: set[str], onednn_bf16: bool) -> CpuFeatures:
    return CpuFeatures(arch=arch, isa="x", flags=frozenset(flags), onednn_bf16=onednn_bf16, forced=None)


@pytest.mark.parametrize(
    ("arch", "flags", "onednn_bf16", "dtype"),
    [
        ("x86_64", {"avx2", "fma"}, False, torch.float32),  # most laptops, AMD Zen 2/3
        ("x86_64", {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, True, torch.float32),  # Skylake-X
        ("x86_64", {"avx2", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, True, torch.bfloat16),  # Zen 4
        ("x86_64", {"avx2", "avx512bw", "avx512vl", "avx512dq", "amx_bf16", "amx_tile"}, True, torch.bfloat16),
        ("aarch64", {"asimd"}, False, torch.float32),  # ARM without BF16
        ("aarch64", {"asimd", "bf16", "sve"}, True, torch.bfloat16),  # Graviton 3 and later
        ("arm64", {"asimd", "bf16"}, True, torch.bfloat16),  # Apple M2 and later, --device cpu
    ],
)
def test_auto_dtype_is_bfloat16_only_with_bfloat16_instructions(
    arch: str, flags: set[str], onednn_bf16: bool, dtype: torch.dtype
) -> None:
    assert features(arch, flags, onednn_bf16).auto_dtype is dtype


def test_float32_products_go_to_onednn_everywhere_bfloat16_only_where_it_computes_them() -> None:
    emulated, onednn = features("x86_64", {"avx2"}, False), features("x86_64", {"avx512bw"}, True)
    assert emulated.onednn_runs(torch.float32) and onednn.onednn_runs(torch.float32)
    assert not emulated.onednn_runs(torch.bfloat16) and onednn.onednn_runs(torch.bfloat16)
    assert not onednn.onednn_runs(torch.float16)


def test_this_cpu_is_read_from_its_flags() -> None:
    """Without forcing, the flags are /proc/cpuinfo's (on Linux); with it, a subset of them, and torch's and oneDNN's
    dispatch capped to match (what the package sets before torch runs a kernel)."""
    cpu = cpu_features()
    if Path("/proc/cpuinfo").is_file():
        line = next(li for li in Path("/proc/cpuinfo").read_text().splitlines() if li.split(":")[0].strip() in
                    ("flags", "Features"))  # fmt: skip
        assert cpu.flags <= set(line.partition(":")[2].split())
        if cpu.forced is None and "avx512_bf16" in line.split():
            assert cpu.native_bf16 and cpu.auto_dtype is torch.bfloat16
    if cpu.forced == "avx2":
        assert cpu.isa == "avx2" and not cpu.onednn_bf16 and cpu.auto_dtype is torch.float32
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN itself is capped
    assert cpu.describe()["forced"] == os.environ.get(FORCE_VARIABLE)


def forced_features(isa: str) -> dict:
    """cpu_features().describe() in a child process forced to `isa`, and the inductor cache directory it gets."""
    script = (
        "import json, os; from rbee_worker.hardware.cpu_features import cpu_features as f; "
        "print(json.dumps({**f().describe(), 'inductor_cache': os.environ.get('TORCHINDUCTOR_CACHE_DIR')}))"
    )
    env = {**os.environ, FORCE_VARIABLE: isa}
    for variable in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(variable, None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout)


@X86
def test_forcing_avx2_hides_every_flag_beyond_it_and_caps_torch() -> None:
    described = forced_features("avx2")
    assert described["isa"] == "avx2" and described["forced"] == "avx2"
    # Compiled kernels apart from the unforced ones: inductor's cache key does not include the instruction set.
    assert described["inductor_cache"].endswith("_avx2")
    assert set(described["flags"]) <= {"avx", "avx2", "fma", "f16c"} and described["bf16"] == "emulated"


@X86
def test_forcing_avx512_drops_bfloat16_instructions() -> None:
    described = forced_features("avx512")
    assert not {"avx512_bf16", "amx_bf16", "amx_tile"} & set(described["flags"])
    assert described["bf16"] in ("onednn", "emulated")  # oneDNN's bf16 needs AVX-512 BW/VL/DQ, which stay if present


def test_an_unknown_forced_instruction_set_is_one_line_and_exit_2() -> None:
    result = cli("generate", "--model", "demo", "--prompt", "x", env={FORCE_VARIABLE: "avx9"})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "RBEE_CPU_ISA='avx9'" in result.stderr, result.stderr


PROMPT = "The capital of France is"


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["auto", "none", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_a_bfloat16_directory_generates_in_every_dtype_and_quantize_mode(
    demo_hf_bf16_dir: Path, dtype: str, quantize: str
) -> None:
    """Every mode loads and answers on this CPU, its linear layers of the kinds chosen for it: oneDNN-packed only in
    a dtype oneDNN computes here, int4 / int8 layers (which compute in bfloat16) in a model of any dtype."""
    placement = resolve_placement("cpu", dtype)
    engine = Engine(lambda: load_model(str(demo_hf_bf16_dir), placement, quantize=quantize), engine_config())
    try:
        ids, end = greedy(engine, engine.model.tokenize(PROMPT), 8)
        model = engine.loaded.model
    finally:
        engine.close()
    assert end.tokens_out == 8 and "Paris" in engine.model.detokenize(tuple(ids))
    kinds = {type(m) for m in model.modules()}
    assert (PackedLinear in kinds) == cpu_features().onednn_runs(placement.dtype)
    assert (Int8Linear in kinds) == (quantize == "int8") and (Int4Linear in kinds) == (quantize == "int4")


@pytest.mark.slow
def test_the_demo_file_generates_dequantized_in_every_dtype(demo_gguf: Path) -> None:
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        result = cli("generate", "--model", str(demo_gguf), "--quantize", "none", "--dtype", dtype, "--json",
                     "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0", fork=True)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "Paris" in json.loads(result.stdout)["text"], dtype


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "quantize"), [("auto", "auto"), ("bfloat16", "int4"), ("float32", "int8")])
def test_a_bfloat16_directory_serves(demo_hf_bf16_dir: Path, tmp_path: Path, dtype: str, quantize: str) -> None:
    flags = ("--model", str(demo_hf_bf16_dir), "--dtype", dtype, "--quantize", quantize)
    with running(tmp_path, *flags, fork=True) as worker, httpx.Client(base_url=worker.url, timeout=60) as client:
        stream = execute(client, prompt=PROMPT, max_tokens=8, temperature=0)
        health = client.get("/health").json()
    assert stream.terminal["type"] == "end" and "Paris" in stream.text, stream.events
    assert health["cpu"] == cpu_features().describe()
