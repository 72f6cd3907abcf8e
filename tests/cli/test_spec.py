"""`serve`'s flags are resolved once (cli/serve.py resolve) into one WorkerConfig, whose ModelSpec (loading/spec.py) the
loader, the tensor-parallel ranks and /health take as it is: the model is probed once, every check runs against that
probe, and the runtime is never `auto` once resolved."""

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rbee_worker.cli.flags import build_parser
from rbee_worker.cli.model_flags import resolve_model
from rbee_worker.cli.serve import resolve
from rbee_worker.engine.parallel.tp_messages import Topology
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading import loader
from rbee_worker.loading.gguf.llama_cpp_model import llama_cpp_installed
from rbee_worker.loading.spec import ModelSpec

CPU_FP32 = Placement(torch.device("cpu"), torch.float32)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How often the model probe's steps run: MODEL's path looked up, its runtime resolved."""
    counts: Counter = Counter()

    def counting(name: str) -> Callable[..., object]:
        original = getattr(loader, name)

        def counted(*args: object) -> object:
            counts[name] += 1
            return original(*args)

        return counted

    for name in ("resolve_model_path", "resolve_runtime"):
        monkeypatch.setattr(loader, name, counting(name))
    return counts


def test_serve_resolves_the_model_once_and_checks_the_split_against_it(demo_hf_dir: Path, probes: Counter) -> None:
    args = build_parser().parse_args([*serve_flags(demo_hf_dir), "--tensor-parallel", "3", "--master-port", "29501"])
    config = resolve(args)
    assert probes == {"resolve_model_path": 1, "resolve_runtime": 1}  # the split's config read from that probe
    assert config.model == ModelSpec(str(demo_hf_dir), demo_hf_dir, False, CPU_FP32, "torch", "none")
    assert config.topology == Topology(3, master_port=29501)


@pytest.mark.parametrize("model", ["gguf", "directory"])
def test_auto_resolves_to_a_runtime_and_a_quantization(demo_gguf: Path, demo_hf_dir: Path, model: str) -> None:
    path = demo_gguf if model == "gguf" else demo_hf_dir
    config = resolve(build_parser().parse_args(["serve", "--model", str(path), "--device", "cpu"]))
    on_llama_cpp = model == "gguf" and llama_cpp_installed()
    assert config.model.runtime == ("llama.cpp" if on_llama_cpp else "torch")
    assert config.model.quantize in (("none",) if on_llama_cpp or model == "directory" else ("int4",))
    assert (config.model.path, config.model.gguf) == (path, model == "gguf")


def test_the_spec_loads_as_it_is(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """load_spec reads the spec without probing MODEL again, and keeps its context cap."""
    directory = tiny_models["mistral"]
    args = build_parser().parse_args(["generate", "--model", str(directory), "--prompt", "hi", "--device", "cpu"])
    spec = resolve_model(args, CPU_FP32, max_context=32)

    def probed_again(*_: object) -> None:
        raise AssertionError("MODEL probed again")

    monkeypatch.setattr(loader, "resolve_model_path", probed_again)
    monkeypatch.setattr(loader, "resolve_runtime", probed_again)
    info = loader.load_spec(spec).info
    assert (info.runtime, info.context_length, info.dtype) == ("torch", 32, torch.float32)


def serve_flags(model: Path) -> list[str]:
    return ["serve", "--model", str(model), "--device", "cpu", "--dtype", "float32"]
