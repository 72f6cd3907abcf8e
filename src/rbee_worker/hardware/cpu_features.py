"""What this CPU can compute fast: the one place every CPU fast path asks.

The worker's CPU paths depend on instructions that many CPUs lack:
- oneDNN's reordered weights (layers/cpu_linear.py) take bfloat16 only where oneDNN computes it (AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT on x86, BF16 on ARM); torch raises on every other CPU.
- bfloat16 is fast only where the CPU has bfloat16 dot products (AVX512_BF16 or AMX-BF16 on x86, BF16 on ARM);
  elsewhere torch converts every element to float32 and back, and float32 is the fast dtype.
- Long prompts' int4 / int8 products are dequantized for oneDNN only where oneDNN runs the activations' dtype.

`RBEE_CPU_ISA=avx2` (or `avx512`) makes an x86 CPU behave as one that stops at that instruction set: it hides the
flags beyond it from these checks and, for this process, caps torch's own kernels (ATEN_CPU_CAPABILITY) and oneDNN's
(ONEDNN_MAX_CPU_ISA), unless those are already set. `force_isa_environment` applies it; it runs when the package is
imported, before torch dispatches any kernel (torch reads both variables once, at its first use of them), which is
why this module imports torch only inside the functions that need it. What the cap cannot reach: code that reads the
CPU's flags itself (torch.cpu._is_avx512_bf16_supported and the like, and llama.cpp, which picks its kernels from the
real CPU). This module never asks those for a decision.
"""

import functools
import getpass
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rbee_worker.errors import DeviceError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORCE_VARIABLE = "RBEE_CPU_ISA"

# The x86 flags that decide a path here, as /proc/cpuinfo names them.
X86_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
# The ARM flags that decide a path here ("asimd" is NEON), as /proc/cpuinfo names them.
ARM_FLAGS = ("asimd", "sve", "sve2", "bf16", "i8mm", "asimdhp")

# Forcible instruction sets: the flags each keeps, and the caps for torch's and oneDNN's dispatch.
_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
FORCIBLE = {
    "avx2": (_AVX2_FLAGS, "avx2", "AVX2"),
    "avx512": (_AVX512_FLAGS, "avx512", "AVX512_CORE_VNNI"),
}


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # platform.machine(): x86_64, aarch64, arm64, ...
    isa: str  # the vector level torch's kernels dispatch to: avx512, avx2, default, sve256, ...
    flags: frozenset[str]  # of X86_FLAGS / ARM_FLAGS, those this CPU has (and RBEE_CPU_ISA keeps)
    onednn_bf16: bool  # oneDNN computes bfloat16 products (and reorders bfloat16 weights)
    forced: str | None  # RBEE_CPU_ISA, when set

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware: where bfloat16 is the fast dtype."""
        hardware = {"avx512_bf16", "amx_bf16", "bf16"} & self.flags
        return bool(hardware) and self.onednn_bf16

    @property
    def auto_dtype(self) -> "torch.dtype":
        """`--dtype auto` on this CPU: bfloat16 where the CPU computes it natively (half the bytes a decode step reads,
        and oneDNN's fast products), float32 elsewhere, where every bfloat16 product is converted element by element
        and a prompt's products run several times slower (bench/cpu_dtype.py; bench/results/README.md)."""
        import torch

        return torch.bfloat16 if self.native_bf16 else torch.float32

    def onednn_runs(self, dtype: "torch.dtype") -> bool:
        """Whether oneDNN computes products of `dtype` here (float32 wherever torch has oneDNN)."""
        import torch

        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.onednn_bf16)

    def describe(self) -> dict[str, object]:
        """For /health, the ready callback and the start-up log."""
        return {
            "arch": self.arch,
            "isa": self.isa,
            "flags": sorted(self.flags),
            "bf16": "native" if self.native_bf16 else ("onednn" if self.onednn_bf16 else "emulated"),
            "forced": self.forced,
        }


def forced_isa() -> str | None:
    """RBEE_CPU_ISA, checked; None when unset."""
    value = os.environ.get(FORCE_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in FORCIBLE:
        raise DeviceError(f"{FORCE_VARIABLE}={value!r} is not one of {', '.join(FORCIBLE)}; unset it or fix it")
    return value


def force_isa_environment() -> None:
    """With RBEE_CPU_ISA set, cap torch's and oneDNN's kernels to it for this process (child processes inherit the
    variables). A value that is not an instruction set is reported later, by cpu_features(), as the caller's error.

    torch.compile's kernels then go to a cache directory of their own: inductor compiles for the capped instruction
    set, but its cache key does not include it, so a kernel compiled under one cap and loaded under another computes
    wrong results or aborts the process (seen with tests/engine/test_attention.py's compiled attention)."""
    try:
        forced = forced_isa()
    except DeviceError:
        return
    if forced is not None:
        _, aten, onednn = FORCIBLE[forced]
        os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        user = "".join(c if c.isalnum() else "_" for c in getpass.getuser())
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{forced}")
        )


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's features, read once (and logged then)."""
    import torch

    forced = forced_isa()
    arch = platform.machine().lower()
    flags = _read_flags(arch)
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if forced is not None:
        if arch not in ("x86_64", "amd64"):
            raise DeviceError(f"{FORCE_VARIABLE}={forced} needs an x86-64 CPU; this one is {arch}: unset it")
        flags &= FORCIBLE[forced][0]
        # oneDNN normally follows ONEDNN_MAX_CPU_ISA; the flags decide where the variable was set too late.
        onednn_bf16 = onednn_bf16 and {"avx512bw", "avx512vl", "avx512dq"} <= flags
    features = CpuFeatures(
        arch=arch,
        isa=torch.backends.cpu.get_cpu_capability().lower(),
        flags=frozenset(flags),
        onednn_bf16=onednn_bf16,
        forced=forced,
    )
    described = features.describe()
    log.info(
        "CPU: %s, torch kernels %s, bf16 %s, flags %s%s",
        arch,
        features.isa,
        described["bf16"],
        " ".join(described["flags"]) or "none",
        f" (forced by {FORCE_VARIABLE}={forced})" if forced else "",
        extra={"fields": {"cpu": described}},
    )
    return features


def _read_flags(arch: str) -> set[str]:
    """The CPU's flags: /proc/cpuinfo on Linux; elsewhere what torch (x86) or sysctl (Apple) tells."""
    known = ARM_FLAGS if arch in ("aarch64", "arm64") else X86_FLAGS
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split()) & set(known)
    except OSError:
        pass
    import torch

    if arch == "arm64" and platform.system() == "Darwin":
        return {"asimd"} | ({"bf16"} if _sysctl("hw.optional.arm.FEAT_BF16") == "1" else set())
    probes = {
        "avx2": torch.cpu._is_avx2_supported,
        "avx512f": torch.cpu._is_avx512_supported,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
        "avx512_vnni": torch.cpu._is_vnni_supported,
        "amx_tile": torch.cpu._is_amx_tile_supported,
    }
    return {flag for flag, probe in probes.items() if probe()}


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
