"""Device and dtype selection, placement checks, and memory measurement."""

import re
from dataclasses import dataclass

import psutil
import torch

from rbee_worker.errors import DeviceError, ModelLoadError
from rbee_worker.hardware.cpu_features import cpu_features

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    @property
    def backend(self) -> str:
        return self.device.type


def parse_device(device: str | None, backend: str | None = None, cuda_device: int | None = None) -> torch.device:
    """Resolve the CLI's device flags to a concrete, existing torch.device.

    Accepts `--device auto|cpu|cuda|cuda:N|mps`, the seed style `--backend cuda --device 1`, and `--cuda-device N`.
    """
    device = device.strip().lower() if device is not None else None
    if cuda_device is not None:
        if backend not in (None, "cuda"):
            raise DeviceError(f"--cuda-device {cuda_device} conflicts with --backend {backend}; pass one of them")
        # A different --device next to --cuda-device would otherwise be silently ignored.
        if device not in (None, "auto", "cuda", str(cuda_device), f"cuda:{cuda_device}"):
            raise DeviceError(f"--cuda-device {cuda_device} conflicts with --device {device}; pass one of them")
        backend, device = "cuda", str(cuda_device)
    if backend is not None:
        if backend not in ("cpu", "cuda", "mps"):
            raise DeviceError(f"unknown --backend {backend!r}; use cpu, cuda or mps")
        if device is None or device in ("auto", backend):
            device = backend
        elif device.isdigit():
            # The seed style passes an index for every backend; cpu and mps have only device 0.
            if backend != "cuda" and int(device) != 0:
                raise DeviceError(f"--backend {backend} has only device 0, not {device}; drop --device")
            device = f"cuda:{device}" if backend == "cuda" else backend
        elif not device.startswith(backend):
            raise DeviceError(f"--backend {backend} conflicts with --device {device}; pass one of them")
    device = device or "auto"
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):
        raise DeviceError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = (
                f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch or use --device cpu"
                if torch.version.cuda is None
                else "no CUDA GPU is visible; check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu"
            )
            raise DeviceError(f"device {device} requested but CUDA is not available here: {why}")
        index = int(device.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(f"device cuda:{index} does not exist: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    if device == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device mps requested but Apple MPS is not available here; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA (fp16 on GPUs without bf16), fp16 on MPS, and on CPU what this CPU computes fastest
    (cpu_features: bf16 where it has bf16 instructions, fp32 elsewhere)."""
    name = (dtype or "auto").lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else cpu_features().auto_dtype
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda" and DTYPES[name] is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"{torch.cuda.get_device_name(device)} does not support bfloat16; use --dtype float16")
    return DTYPES[name]


def resolve_placement(
    device: str | None = None, dtype: str | None = None, backend: str | None = None, cuda_device: int | None = None
) -> Placement:
    resolved = parse_device(device, backend, cuda_device)
    return Placement(resolved, resolve_dtype(dtype, resolved))


def available_memory(device: torch.device) -> int:
    """Bytes that a new allocation on `device` can use now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return int(psutil.virtual_memory().available)


def check_fits(needed_bytes: int, device: torch.device, what: str) -> None:
    """Refuse to start a load that cannot fit, instead of dying half-way (or swapping the machine to a halt)."""
    available = available_memory(device)
    if needed_bytes > available:
        raise ModelLoadError(
            f"not enough memory on {device} for {what}: it needs {needed_bytes / 2**30:.1f} GiB, "
            f"{available / 2**30:.1f} GiB is available; use a smaller model, a smaller --dtype or another device"
        )


def check_placement(model: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer must be on the requested device: a silent CPU fallback is an error."""
    misplaced = [
        f"{name} on {tensor.device}"
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if not _same_device(tensor.device, device)
    ]
    if misplaced:
        shown = ", ".join(misplaced[:3]) + (f" and {len(misplaced) - 3} more" if len(misplaced) > 3 else "")
        raise DeviceError(f"model did not load onto {device}: {shown}")


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    return wanted.index is None or actual.index in (None, wanted.index)


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights share one)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
