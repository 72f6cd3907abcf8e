"""The sampler's per-row state on the logits' device (SamplerState: each batch row's parameters, seed stream and draw
counter, logit bias, penalty counts and logits mask, allocated once so that a CUDA graph reads fixed addresses), and
which of the sampler's stages a step runs (SamplerFeatures)."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rbee_worker.engine.sampling.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from rbee_worker.engine.sampling.seeded_draws import check_seed, stream_of
from rbee_worker.engine.sampling.selection import FRACTION_BITS

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)
MAX_VOCAB = 2**19  # keeps sums of weights below 2**59 (scale_by) and token ids exact in pack's float32
IN_PROMPT = 1 << 30  # SamplerState.counts: this bit marks a prompt token, the bits below count generated ones
_FLOAT32 = torch.finfo(torch.float32)


@dataclass(frozen=True)
class SamplerFeatures:
    """Which stages a step runs: static and hashable, as a CUDA graph is captured per value. Temperature and min-p
    are cheap elementwise operations, part of every sampled step."""

    sampling: bool = False  # some row draws at random (temperature >= GREEDY_BELOW); off: every row is greedy
    penalties: bool = False  # some row has a logit bias or a repetition, presence or frequency penalty
    filters: bool = False  # some sampled row has top_p < 1 or top_k (implies `sampling`): the top-p stage
    top_k: bool = False  # some sampled row has top_k (implies `filters`): the top-k stage before top-p
    masks: bool = False  # some row has a logits mask (SamplerState.set_mask)
    top_logprobs: int = -1  # -1: no logprobs; n >= 0: the chosen token's logprob and the n most likely, every row

    def __post_init__(self) -> None:
        if not -1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in -1..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        # One value per set of stages that run, so that equal steps share a graph.
        object.__setattr__(self, "filters", self.filters or self.top_k)
        object.__setattr__(self, "sampling", self.sampling or self.filters)

    @property
    def plain(self) -> bool:
        """No mask, penalty or logprobs: a CPU's step runs wholly in numpy (`plain_on_host`)."""
        return not (self.masks or self.penalties) and self.top_logprobs < 0

    @staticmethod
    def of(requests: Iterable[tuple[SamplingParams, int | None]], masks: bool = False) -> "SamplerFeatures":
        """What a step over these (params, top-logprobs request) needs; `masks`: whether any row has a mask."""
        sampling = penalties = filters = top_k = False
        top_logprobs = -1
        for params, logprobs in requests:
            sampled = not params.is_greedy()
            sampling |= sampled
            filters |= sampled and params.top_p < 1.0
            top_k |= sampled and params.top_k > 0
            penalties |= (
                params.repetition_penalty != 1.0
                or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0
                or bool(params.logit_bias)
            )
            if logprobs is not None:
                top_logprobs = max(top_logprobs, logprobs)
        return SamplerFeatures(sampling, penalties, filters, top_k, masks, top_logprobs)


class HostViews(NamedTuple):
    """numpy views of a CPU SamplerState's per-slot tensors that the host's draw reads and advances: a lookup each,
    where `Tensor.numpy` is a tensor call that costs microseconds right after a forward."""

    greedy: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    stream: np.ndarray
    counter: np.ndarray


class SamplerState:
    """Per-slot sampling state in device tensors: the parameters, the 64-bit seed and draw counter, the logit bias,
    the token counts for the penalties, and the logits mask. `sample` reads the rows of its slots and advances the
    live ones. All of it is allocated here, once (a CUDA graph reads fixed addresses): about 4.1 bytes per slot and
    vocabulary entry, and 12 KiB per slot for the bias."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str) -> None:
        if not 0 < vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")
        self.slots, self.vocab_size, self.device = slots, vocab_size, torch.device(device)

        def zeros(dtype: torch.dtype, *size: int) -> torch.Tensor:
            return torch.zeros(slots, *size, dtype=dtype, device=self.device)

        self.greedy = zeros(torch.bool)
        self.temperature = zeros(torch.float32)  # 1 for greedy rows, whose sampled path is computed and discarded
        self.top_k = zeros(torch.long)  # vocab_size when off
        self.top_p = zeros(torch.long)  # top_p * 2**53, rounded
        self.min_p = zeros(torch.float32)
        self.repetition = zeros(torch.float32)
        self.presence = zeros(torch.float32)
        self.frequency = zeros(torch.float32)
        self.stream = zeros(torch.long)  # from the 64-bit seed: stream_of(seed), see `draw_bits`
        self.counter = zeros(torch.long)  # the slot's draws so far
        # The logit bias, (id, bias) pairs padded with (0, 0.0), which adds nothing.
        self.bias_ids = zeros(torch.long, MAX_LOGIT_BIAS)
        self.bias = zeros(torch.float32, MAX_LOGIT_BIAS)
        # Generated-token counts per (slot, token), plus IN_PROMPT for the prompt's tokens (repetition penalty).
        self.counts = zeros(torch.int32, vocab_size)
        # Allowed tokens, a bit each: word j's bit b is token 32 * j + b. All ones: no mask.
        self.allowed = torch.full((slots, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=self.device)
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        self.host: HostViews | None = None
        if self.device.type == "cpu":
            tensors = self.greedy, self.temperature, self.top_k, self.top_p, self.min_p, self.stream, self.counter
            self.host = HostViews(*(t.numpy() for t in tensors))

    def assign(self, slot: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int]) -> None:
        """A new request takes the slot: its parameters and seed, no draws or generated tokens yet, its prompt ids
        marked for the repetition penalty (prompt ids past the vocabulary are ignored, as transformers does), no
        mask."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in 0..{self.slots - 1}, got {slot}")
        check_seed(seed)
        greedy = params.is_greedy()
        self.greedy[slot] = greedy
        self.temperature[slot] = 1.0 if greedy else params.temperature
        self.top_k[slot] = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self.top_p[slot] = round(params.top_p * 2**FRACTION_BITS)
        self.min_p[slot] = params.min_p
        # A penalty below float32's smallest normal number would be 0 there, and 0 / 0 is NaN.
        self.repetition[slot] = max(params.repetition_penalty, _FLOAT32.tiny)
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        self.stream[slot] = stream_of(torch.tensor(seed - 2**64 if seed >= 2**63 else seed))
        self.counter[slot] = 0
        self.bias_ids[slot] = 0
        self.bias[slot] = 0.0
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias, strict=True)
            if max(ids) >= self.vocab_size:
                raise ValueError(f"logit_bias token ids must be below the vocabulary's {self.vocab_size}")
            self.bias_ids[slot, : len(ids)] = torch.tensor(ids)
            self.bias[slot, : len(ids)] = torch.tensor(biases)
        self.counts[slot] = 0
        if params.repetition_penalty != 1.0:
            ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("token ids must be >= 0")
            self.counts[slot, ids[ids < self.vocab_size].to(self.device)] = IN_PROMPT
        self.allowed[slot] = -1

    def set_mask(self, slot: int, allowed: torch.Tensor | None) -> None:
        """The tokens the slot may draw from its next draw on, until replaced: a packed bitmask (int32 words,
        ceil(vocab / 32), bit b of word j for token 32 * j + b, the layout of xgrammar's token bitmask); None allows
        every token. Steps that should honour masks need `SamplerFeatures.masks`. A mask in pinned host memory goes to
        a GPU without the host waiting for the copy: it must stay unchanged until a step has read it."""
        if allowed is None:
            self.allowed[slot] = -1
        else:
            self._copy_masks(slot, allowed.unsqueeze(0))

    def set_masks(self, slots: Sequence[int], bitmask: torch.Tensor) -> None:
        """set_mask for several slots, each with its own row of `bitmask` (host, [slots, words]), in one copy for each
        run of consecutive slots: a step's constrained rows are mostly one run (the live rows are compacted), and a
        copy of many rows costs about what one of a row does."""
        ordered = sorted(slots)
        start = 0
        for i, slot in enumerate(ordered):
            if i + 1 == len(ordered) or ordered[i + 1] != slot + 1:
                first, end = ordered[start], slot + 1
                self._copy_masks(first, bitmask[first:end])
                start = i + 1

    def _copy_masks(self, first: int, masks: torch.Tensor) -> None:
        """Masks ([n, words]) into the n slots from `first` on (see set_mask)."""
        if masks.dtype != torch.int32 or masks.shape[1:] != self.allowed.shape[1:]:
            shape = tuple(self.allowed.shape[1:])
            raise ValueError(f"a mask is int32 of shape {shape}, got {masks.dtype} {tuple(masks.shape[1:])}")
        self.allowed[first : first + len(masks)].copy_(masks, non_blocking=self.device.type == "cuda")
