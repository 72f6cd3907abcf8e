"""What every model runner shares, whatever runs the forward (torch or llama.cpp): how many tokens each KV slot holds,
and each slot's sampling state with the batched sampler over the logits rows of a step.
"""

import logging
from collections.abc import Sequence

import psutil
import torch

from rbee_worker.engine.runner import Sampled
from rbee_worker.engine.sampler import SamplerFeatures, SamplerState, pack, sample, unpack
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import TokenLogprob
from rbee_worker.errors import ModelLoadError

log = logging.getLogger(__name__)

MIN_SLOT_TOKENS = 64  # a KV slot shorter than this cannot hold a useful request
GPU_KV_SHARE = 0.9  # of the device memory free after loading
ACTIVATION_RESERVE_BYTES = 1 << 30  # left free on a GPU for activations and logits
CPU_KV_SHARE = 0.5  # of the host memory available after loading


def kv_budget(device: torch.device) -> int:
    """Bytes the KV cache may take by default: on a GPU, what is free once the weights are in, less room for
    activations; elsewhere half the memory available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_SHARE) - ACTIVATION_RESERVE_BYTES
    return int(psutil.virtual_memory().available * CPU_KV_SHARE)


def slot_tokens(context: int, slots: int, bytes_per_token: int, budget: int) -> int:
    """Tokens per KV slot: the model's context, or less where `slots` of them would not fit in `budget` bytes. Raises
    ModelLoadError when the budget leaves a slot fewer than MIN_SLOT_TOKENS (a shorter context is its own choice)."""
    slot_len = min(context, budget // (slots * bytes_per_token))
    if slot_len < min(context, MIN_SLOT_TOKENS):
        raise ModelLoadError(
            f"the KV cache for --max-batch {slots} does not fit in {budget / 2**30:.1f} GiB "
            f"({bytes_per_token} bytes per token): lower --max-batch or give the cache more memory"
        )
    log.info(
        "KV cache: %d slots of %d tokens, %.2f GiB",
        slots,
        slot_len,
        slots * slot_len * bytes_per_token / 2**30,
        extra={"fields": {"slots": slots, "slot_tokens": slot_len}},
    )
    return slot_len


class SlotSampling:
    """Each slot's sampling request (parameters, seed, penalty counts, logprobs wanted) in a SamplerState on the logits'
    device, and the batched sampler over a step's logits rows (engine/sampler.py), so that every runtime samples
    with the same code: penalties, top-k / top-p / min-p, seeds and logprobs behave identically."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.state = SamplerState(slots, vocab_size, device)
        self._logprobs: dict[int, int | None] = {}  # each slot's top-logprobs request
        self._params: dict[int, SamplingParams] = {}

    def assign(
        self, slot: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the slot: its sampling parameters, seed and penalty counts go to the device."""
        self.state.assign(slot, params, seed, prompt_ids)
        self._params[slot], self._logprobs[slot] = params, logprobs

    def features(self, slots: Sequence[int]) -> SamplerFeatures:
        return SamplerFeatures.of((self._params[slot], self._logprobs[slot]) for slot in slots)

    def sampled(self, packed: Sequence[float], slot: int) -> Sampled:
        """A row of sampler.pack's layout, on the host, as the slot's request asked for it."""
        token, valid, logprob, top = unpack(packed, self._logprobs[slot])
        return Sampled(token, valid, None if logprob is None else TokenLogprob(token, logprob, top))

    def sample(self, logits: torch.Tensor, slots: list[int], live: list[bool]) -> list[list[float]]:
        """The sampler over these logits rows (row i for slot slots[i]; `live`: the rows that really decode), at once;
        its packed result on the host."""
        features = self.features([slot for slot, alive in zip(slots, live, strict=True) if alive])
        index = torch.tensor(slots, device=self.device)
        live_rows = torch.tensor(live, device=self.device)
        out = sample(logits, self.state, index, live_rows, features, on_host=self.device.type == "cpu")
        return pack(out).tolist()
