"""What the torch runner does differently on each kind of device, chosen once when the runner is built
(`device_path`): how a model is prepared for the device, how a decode step's attention reads the paged KV cache, how
far a prompt chunk's attention reads, what memory is counted, and what runs before ready.

- CUDA (CudaPath): decode attention reads the paged cache in place (kernels/decode_attention.py), decode steps run as
  CUDA graphs, mixtures of experts through the fused kernels; memory is what torch has allocated on the device.
- CPU (CpuPath): the host path, with the linear layers packed for oneDNN, prompt chunks' keys read in whole blocks of
  CPU_KEY_BLOCK, and a quantized model's rows batched alike (Capabilities.uniform_rows).
- Any other device (HostPath: Apple's MPS): decode attention over each row's keys and values gathered behind a mask;
  memory is the weights and the KV cache touched so far.
"""

import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.runners.protocol import Capabilities, KvGeometry, PromptRow
from rbee_worker.engine.runners.torch.kv_cache import PagedCache, caches_latent, decode_mask
from rbee_worker.engine.sampling.sampler import sample
from rbee_worker.engine.sampling.sampler_state import MAX_TOP_LOGPROBS, SamplerFeatures, SamplerState
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import tensor_bytes
from rbee_worker.layers.cpu_linear import can_pack, pack_linears, packed_bytes
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.loading.gguf.dequant import CPU_DEQUANTIZE_ROWS, cpu_product_dequantizes
from rbee_worker.loading.loaded import LoadedModel

# The runner's forward over prompt rows, as warm-up calls it.
PromptForward = Callable[[list[PromptRow]], torch.Tensor]

# PyTorch's CPU attention kernel reads the keys in blocks of 512 from position 0 and sums each block apart: a query's
# result depends on where the forward's last block of keys ends. Prompt chunks after the first read the cache up to a
# multiple of it (the rest masked), so that a position's keys and values do not depend on the length of the forward
# that computed it: the same with a cached prefix as without (scheduler.py, Capabilities.uniform_rows).
CPU_KEY_BLOCK = 512

# On a GPU, a prompt forward of this many rows of this many tokens runs before ready, so that the first batch of
# prompts does not load the eager prompt path's kernels.
WARM_PROMPT_ROWS, WARM_PROMPT_TOKENS = 16, 32


class DevicePath(ABC):
    """What every device does alike unless its path says otherwise: prompt chunks and decode rows in separate
    forwards, a prompt's attention over the positions it ends at, nothing captured or warmed before ready. A path
    says how a decode step's attention reads the cache and what memory it counts."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def prepare(self, loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
        """The loaded model as it serves on this device."""
        return loaded

    def capabilities(self, model: torch.nn.Module) -> Capabilities:
        """Prompt chunks and decode rows run as separate forwards: the rows of one forward are padded to one width."""
        return Capabilities(mixed_batches=False)

    def key_span(self, kv_len: int, first_chunk: bool, cache: PagedCache) -> int:
        """How many positions of the cache a prompt forward's attention reads, for rows that end at kv_len."""
        return kv_len

    def eager_prompts(self, compiled: bool) -> bool:
        """Whether prompt forwards skip the compiled forward."""
        return False

    def captures_graphs(self, config: EngineConfig) -> bool:
        return False

    @property
    def warms(self) -> bool:
        """Whether the runner runs its forwards once before ready even when nothing is compiled."""
        return False

    def warm(self, forward: PromptForward, max_batch: int, scratch: list[int], state: SamplerState) -> None:
        """Runs what must run once before ready beyond the compiled shapes: nothing here."""
        return None

    @abstractmethod
    def decode_attention(
        self, cache: PagedCache, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A decode step's attention mask and the extra arguments its forward takes."""

    @abstractmethod
    def kv_bytes(self, kv: KvGeometry, cache: PagedCache) -> int:
        """The KV cache's memory in use."""

    @abstractmethod
    def memory_bytes(self, weight_bytes: int, kv_bytes: int) -> int:
        """The device memory in use, weights and KV cache."""


class HostPath(DevicePath):
    """A device without CUDA (Apple's MPS): decode attention over each row's gathered keys and values, behind a mask;
    memory as the weights and the KV cache touched so far."""

    def decode_attention(
        self, cache: PagedCache, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A decode step's attention mask and extra forward arguments: each row's keys and values up to kv_len
        gathered, the positions past its length masked."""
        cache.prepare(rows, positions, kv_len, "gather")
        return decode_mask(lengths, kv_len, self.dtype), {}

    def kv_bytes(self, kv: KvGeometry, cache: PagedCache) -> int:
        """The KV cache's memory: the blocks touched so far (the pool's memory is reserved, not written, at start)."""
        return cache.resident_bytes

    def memory_bytes(self, weight_bytes: int, kv_bytes: int) -> int:
        return weight_bytes + kv_bytes


class CpuPath(HostPath):
    """The CPU: the host path with oneDNN-packed linear layers, prompt chunks' keys read in whole CPU_KEY_BLOCKs, and
    a quantized model's forwards kept to the row counts its kernels round alike."""

    def prepare(self, loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
        """The linear layers' weights reordered once for oneDNN (see cpu_linear.py), unless torch.compile packs what
        it compiles itself; the weight bytes measured again, since the plain weights are gone (a tied LM head's
        packed copy comes on top)."""
        if config.compile_model or not can_pack(loaded.model):
            return loaded
        pack_linears(loaded.model)
        weight_bytes = tensor_bytes(loaded.model) + packed_bytes(loaded.model)
        return dataclasses.replace(loaded, info=dataclasses.replace(loaded.info, weight_bytes=weight_bytes))

    def capabilities(self, model: torch.nn.Module) -> Capabilities:
        """A CPU's int4 / int8 layers multiply another way from CPU_DEQUANTIZE_ROWS rows, which rounds differently:
        the scheduler then gives every forward that many rows or fewer alike."""
        quantized = any(isinstance(module, Int4Linear | Int8Linear) for module in model.modules())
        if quantized and cpu_product_dequantizes(CPU_DEQUANTIZE_ROWS, self.dtype):
            return Capabilities(mixed_batches=False, uniform_rows=CPU_DEQUANTIZE_ROWS)
        return Capabilities(mixed_batches=False)

    def key_span(self, kv_len: int, first_chunk: bool, cache: PagedCache) -> int:
        """A first chunk reads its own keys only; later chunks read up to a multiple of CPU_KEY_BLOCK."""
        if first_chunk:
            return kv_len
        return min(-(-kv_len // CPU_KEY_BLOCK) * CPU_KEY_BLOCK, cache.max_blocks * cache.block_size)

    def eager_prompts(self, compiled: bool) -> bool:
        """On a CPU only decode steps are compiled. A prompt forward holds enough tokens that the Python around its
        kernels costs little; a long one runs faster eagerly, where its int4 / int8 products dequantize their matrices
        for oneDNN (dequant.cpu_product_dequantizes), which compiled they cannot; and every class of prompt shapes
        would take another whole-model compilation at start-up, each a long one on a CPU (bench/results/README.md)."""
        return compiled


class CudaPath(DevicePath):
    """A CUDA GPU: decode attention reads the paged cache in place, decode steps and first prompt chunks replay as
    CUDA graphs, the eager paths' kernels are made before ready."""

    def prepare(self, loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
        """Mixtures of experts through the fused Triton kernels; latent attention refused (its layers expand the
        latent they read from the cache: in a paged decode step that is the whole pool)."""
        from rbee_worker.kernels.cuda_experts import use_fused_experts  # Triton: not on CPU-only machines

        if caches_latent(loaded.model.config):
            raise ModelLoadError("latent attention (kv_lora_rank) on CUDA is not served yet; on a CPU it is")
        use_fused_experts(loaded.model)
        return loaded

    def decode_attention(
        self, cache: PagedCache, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Attention reads the paged cache in place through the rows' block tables and lengths; the mask is unused."""
        cache.prepare(rows, positions, 0, "paged")
        mask = torch.zeros(len(rows), 1, 1, 1, dtype=self.dtype, device=self.device)
        return mask, {**cache.paged_tables(rows), "kv_lengths": lengths.int()}

    def captures_graphs(self, config: EngineConfig) -> bool:
        """Decode steps as CUDA graphs, except in deterministic mode (which decodes row by row)."""
        return config.cuda_graphs and not config.deterministic

    @property
    def warms(self) -> bool:
        return True

    def warm(self, forward: PromptForward, max_batch: int, scratch: list[int], state: SamplerState) -> None:
        """The eager paths' kernels made: a prompt forward of many rows, so that the first batch of prompts does not
        load them; and the sampler's eager path (a prompt's first token; every token without graphs), whose Triton
        kernels are compiled at their first launch, one for each set of stages and logits dtype: each set runs once
        here, on a row that changes no row's state."""
        count = min(max_batch, WARM_PROMPT_ROWS)
        forward([PromptRow(row, scratch, [0] * WARM_PROMPT_TOKENS, 0, False) for row in range(count)])
        logits = torch.randn(1, state.vocab_size, device=self.device).to(self.dtype)
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        live = torch.zeros(1, dtype=torch.bool, device=self.device)
        stages = {
            SamplerFeatures(sampling, penalties, filters, top_k, top_logprobs=logprobs)
            for sampling, penalties, filters, top_k in itertools.product((False, True), repeat=4)
            for logprobs in (-1, MAX_TOP_LOGPROBS)
        }
        for features in stages:
            sample(logits, state, rows, live, features)
        torch.cuda.synchronize(self.device)

    def kv_bytes(self, kv: KvGeometry, cache: PagedCache) -> int:
        """All of the pool: allocated at start."""
        return kv.bytes

    def memory_bytes(self, weight_bytes: int, kv_bytes: int) -> int:
        """What torch has allocated on the device."""
        return int(torch.cuda.memory_allocated(self.device))


def device_path(device: torch.device, dtype: torch.dtype) -> DevicePath:
    """The torch runner's path for this device (and the model's dtype)."""
    if device.type == "cuda":
        return CudaPath(device, dtype)
    return CpuPath(device, dtype) if device.type == "cpu" else HostPath(device, dtype)
