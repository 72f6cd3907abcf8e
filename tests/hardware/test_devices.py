"""Unit tests of device and dtype selection, placement checks and memory measurement (rbee_worker.hardware.devices).

The CPU-only expectations hide CUDA and MPS with monkeypatch, so they hold on a GPU machine too; the CUDA test at the
end runs only where a GPU is visible.
"""

import pytest
import torch
from torch import nn

from rbee_worker.errors import DeviceError, ModelLoadError
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.hardware.devices import (
    Placement,
    available_memory,
    check_fits,
    check_placement,
    parse_device,
    resolve_dtype,
    resolve_placement,
    tensor_bytes,
)

CPU = torch.device("cpu")


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like a machine without CUDA or MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


# parse_device


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize(
    ("device", "backend", "cuda_device"),
    [
        (None, None, None),
        ("auto", None, None),
        ("cpu", None, None),
        (" CPU ", None, None),
        (None, "cpu", None),
        ("0", "cpu", None),  # the seed style passes an index with every backend
        ("cpu", "cpu", None),
    ],
)
def test_parse_device_cpu(device: str | None, backend: str | None, cuda_device: int | None) -> None:
    assert parse_device(device, backend, cuda_device) == CPU


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize(
    ("device", "backend", "cuda_device", "shown"),
    [
        ("cuda", None, None, "cuda"),
        ("cuda:7", None, None, "cuda:7"),
        ("1", "cuda", None, "cuda:1"),
        (None, "cuda", None, "cuda"),
        (None, None, 3, "cuda:3"),
        ("cuda:3", None, 3, "cuda:3"),
    ],
)
def test_parse_device_cuda_unavailable(
    device: str | None, backend: str | None, cuda_device: int | None, shown: str
) -> None:
    with pytest.raises(DeviceError, match=f"device {shown} requested but CUDA is not available") as caught:
        parse_device(device, backend, cuda_device)
    assert "--device cpu" in str(caught.value)  # says what to do


@pytest.mark.usefixtures("cpu_only")
def test_parse_device_mps_unavailable() -> None:
    with pytest.raises(DeviceError, match="mps requested but Apple MPS is not available"):
        parse_device("mps")
    with pytest.raises(DeviceError, match="mps requested"):
        parse_device(None, "mps")


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "gpu", "cpu:1", "vulkan"])
def test_parse_device_unknown(device: str) -> None:
    with pytest.raises(DeviceError, match=f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps"):
        parse_device(device)


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize(
    ("device", "backend", "cuda_device", "message"),
    [
        (None, "cpu", 0, "--cuda-device 0 conflicts with --backend cpu"),
        (None, "mps", 1, "--cuda-device 1 conflicts with --backend mps"),
        ("cpu", None, 0, "--cuda-device 0 conflicts with --device cpu"),
        ("cuda:1", None, 0, "--cuda-device 0 conflicts with --device cuda:1"),
        ("cuda", "cpu", None, "--backend cpu conflicts with --device cuda"),
        ("mps", "cuda", None, "--backend cuda conflicts with --device mps"),
        ("2", "cpu", None, "--backend cpu has only device 0"),
        (None, "tpu", None, "unknown --backend 'tpu'"),
    ],
)
def test_parse_device_conflicts(device: str | None, backend: str | None, cuda_device: int | None, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        parse_device(device, backend, cuda_device)


# resolve_dtype


def test_resolve_dtype_auto_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # `auto` reads only the device type (and on CUDA whether it has bf16), so any device can be named here.
    assert resolve_dtype("auto", CPU) is cpu_features().auto_dtype  # tests/hardware/test_cpu_features.py: per CPU
    assert resolve_dtype(None, CPU) is cpu_features().auto_dtype
    assert resolve_dtype("auto", torch.device("mps")) is torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # pre-Ampere GPUs
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.float16


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("FLOAT16", torch.float16)]
)
def test_resolve_dtype_explicit(name: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(name, CPU) is dtype


@pytest.mark.parametrize("name", ["int8", "fp32", "float64", "q4_0"])
def test_resolve_dtype_unknown(name: str) -> None:
    with pytest.raises(DeviceError, match=f"unknown dtype '{name}'; use auto, float32, bfloat16 or float16"):
        resolve_dtype(name, CPU)


@pytest.mark.usefixtures("cpu_only")
def test_resolve_placement_cpu() -> None:
    placement = resolve_placement("cpu", "float32")
    assert placement == Placement(CPU, torch.float32)
    assert placement.backend == "cpu"
    assert resolve_placement().device == CPU  # auto without a GPU


# check_placement


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.register_buffer("scale", torch.ones(4))


def test_check_placement_accepts_model_on_device() -> None:
    check_placement(TinyNet(), CPU)


def test_check_placement_names_misplaced_parameters() -> None:
    # Without a GPU, "wanted cuda but everything is on cpu" is the silent-fallback case to refuse.
    with pytest.raises(DeviceError, match=r"model did not load onto cuda:0: embed\.weight on cpu, head\.weight on cpu"):
        check_placement(TinyNet(), torch.device("cuda", 0))


def test_check_placement_checks_buffers() -> None:
    model = TinyNet()
    model.scale = torch.ones(4, device="meta")  # one buffer left behind on another device
    with pytest.raises(DeviceError, match=r"did not load onto cpu: scale on meta$"):
        check_placement(model, CPU)


def test_check_placement_shortens_long_lists() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))  # 6 parameters
    with pytest.raises(DeviceError, match=r"0\.weight on cpu, 0\.bias on cpu, 1\.weight on cpu and 3 more$"):
        check_placement(model, torch.device("mps"))


# tensor_bytes


def test_tensor_bytes_counts_parameters_and_buffers() -> None:
    # embed 10x4 + head 10x4 + scale 4, float32.
    assert tensor_bytes(TinyNet()) == (40 + 40 + 4) * 4


def test_tensor_bytes_counts_tied_weights_once() -> None:
    model = TinyNet()
    model.head.weight = model.embed.weight  # the tie of tie_word_embeddings
    assert tensor_bytes(model) == (40 + 4) * 4


def test_tensor_bytes_counts_shared_storage_once() -> None:
    # Two distinct Parameter objects over one storage (as a loader's tie can leave them): Module.parameters()
    # returns both, so only the storage check keeps the bytes from being counted twice.
    model = TinyNet()
    model.head.weight = nn.Parameter(model.embed.weight.data)
    assert len(list(model.parameters())) == 2
    assert tensor_bytes(model) == (40 + 4) * 4


def test_tensor_bytes_follows_dtype() -> None:
    assert tensor_bytes(TinyNet().to(torch.bfloat16)) == (40 + 40 + 4) * 2


# check_fits / available_memory


def test_available_memory_cpu_is_positive() -> None:
    assert 0 < available_memory(CPU) < 1 << 50


def test_check_fits() -> None:
    check_fits(1 << 20, CPU, "a small model")
    with pytest.raises(ModelLoadError, match=r"not enough memory on cpu for a huge model: it needs 1048576\.0 GiB"):
        check_fits(1 << 50, CPU, "a huge model")


# CUDA, on a machine that has it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_placement() -> None:
    count = torch.cuda.device_count()
    last = torch.device("cuda", count - 1)
    assert parse_device("cuda") == torch.device("cuda", 0)
    assert parse_device(None) == torch.device("cuda", 0)  # auto prefers CUDA
    assert parse_device(str(count - 1), "cuda") == last
    assert parse_device(None, None, count - 1) == last
    with pytest.raises(DeviceError, match=f"device cuda:{count} does not exist: this machine has {count} CUDA"):
        parse_device(f"cuda:{count}")
    with pytest.raises(DeviceError, match=f"device cuda:{count} does not exist"):
        parse_device(None, None, count)

    placement = resolve_placement("cuda", "auto")
    assert placement.dtype is (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert resolve_placement("cuda:0", "float32").dtype is torch.float32

    model = TinyNet().to("cuda")
    check_placement(model, torch.device("cuda"))  # no index: any CUDA device
    check_placement(model, torch.device("cuda", 0))
    assert tensor_bytes(model) == tensor_bytes(TinyNet())
    with pytest.raises(DeviceError, match="did not load onto cpu"):
        check_placement(model, CPU)
    if count > 1:
        with pytest.raises(DeviceError, match="did not load onto cuda:1"):
            check_placement(model, torch.device("cuda", 1))
    model.cpu()
    with pytest.raises(DeviceError, match=r"did not load onto cuda:0: embed\.weight on cpu"):
        check_placement(model, torch.device("cuda", 0))

    free, _total = torch.cuda.mem_get_info(0)
    assert 0 < available_memory(torch.device("cuda", 0)) <= free + (64 << 20)
    with pytest.raises(ModelLoadError, match="not enough memory on cuda:0"):
        check_fits(free * 2, torch.device("cuda", 0), "a model twice the free memory")
