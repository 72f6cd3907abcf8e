"""What every model runner shares, whatever runs the forward (torch or llama.cpp): the KV block pool's size, and each
batch row's sampling state (its grammar's mask included) with the batched sampler over the logits rows of a step.
"""

import logging
from collections.abc import Sequence

import numpy as np
import psutil
import torch

from rbee_worker.engine.grammar import Matcher, fill_masks, host_bitmask
from rbee_worker.engine.runner import KvGeometry, Sampled
from rbee_worker.engine.sampler import SamplerFeatures, SamplerState, pack, plain_on_host, sample, unpack
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import TokenLogprob
from rbee_worker.errors import ModelLoadError

log = logging.getLogger(__name__)

MIN_CONTEXT = 64  # a pool that holds fewer tokens cannot hold a useful request
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


def kv_pool(
    context: int, bytes_per_token: int, block_size: int, budget: int, rows: int, shared_blocks: bool = True
) -> KvGeometry:
    """The block pool that `budget` bytes hold (no more than `rows` whole contexts use), and the context it offers one
    request: the model's, or all of the pool where that is less. Raises ModelLoadError when the pool holds fewer than
    MIN_CONTEXT tokens (a shorter context is the model's own choice)."""
    per_context = -(-context // block_size)
    blocks = min(budget // (block_size * bytes_per_token), rows * per_context + 1)  # + 1: the scratch block
    usable = max(blocks - 1, 0) * block_size
    geometry = KvGeometry(blocks, block_size, min(context, usable), bytes_per_token, shared_blocks)
    if geometry.context < min(context, MIN_CONTEXT):
        raise ModelLoadError(
            f"the KV cache does not fit in {budget / 2**30:.2f} GiB ({bytes_per_token} bytes per token): give it "
            "more memory (--kv-cache-gb) or load a smaller model"
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); up to %d tokens per request",
        blocks - 1,
        block_size,
        geometry.tokens,
        geometry.bytes / 2**30,
        geometry.context,
        extra={"fields": {"kv_blocks": blocks - 1, "kv_tokens": geometry.tokens, "max_model_len": geometry.context}},
    )
    return geometry


class RowSampling:
    """Each batch row's sampling request (parameters, seed, penalty counts, logprobs wanted) in a SamplerState on the
    logits' device, and the batched sampler over a step's logits rows (engine/sampler.py), so that every runtime
    samples with the same code: penalties, top-k / top-p / min-p, seeds, logprobs and grammars behave identically."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.state = SamplerState(rows, vocab_size, device)
        self._logprobs: dict[int, int | None] = {}  # each row's top-logprobs request
        self._params: dict[int, SamplingParams] = {}
        self._masked: set[int] = set()  # the rows whose next draw a grammar constrains
        # Where grammars write their rows' masks, copied from there to the sampler's state (without waiting, on a GPU).
        self._masks = host_bitmask(rows, vocab_size, pin=device.type == "cuda")

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the batch row: its sampling parameters, seed and penalty counts go to the device."""
        self.state.assign(row, params, seed, prompt_ids)
        self._params[row], self._logprobs[row] = params, logprobs
        self._masked.discard(row)

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        """Each row's next draw takes only the tokens that its matcher's grammar allows now (until its next mask),
        the rows filled together (grammar.fill_masks); a dormant matcher (a reasoning model's reasoning) allows every
        token, and its row's mask is dropped."""
        masked = fill_masks([matcher for _, matcher in rows], [row for row, _ in rows], self._masks)
        on_rows = []
        for (row, _), on in zip(rows, masked, strict=True):
            if on:
                on_rows.append(row)
            elif row in self._masked:  # a row outside _masked allows every token already (see assign)
                self.state.set_mask(row, None)
                self._masked.discard(row)
        self.state.set_masks(on_rows, self._masks)
        self._masked.update(on_rows)

    def mask(self, row: int, matcher: Matcher) -> None:
        """One row's mask (see masks)."""
        self.masks([(row, matcher)])

    def features(self, rows: Sequence[int]) -> SamplerFeatures:
        masks = any(row in self._masked for row in rows)
        return SamplerFeatures.of(((self._params[row], self._logprobs[row]) for row in rows), masks)

    def sampled(self, packed: Sequence[float], row: int) -> Sampled:
        """A row of sampler.pack's layout, on the host, as the batch row's request asked for it."""
        token, valid, logprob, top = unpack(packed, self._logprobs[row])
        return Sampled(token, valid, None if logprob is None else TokenLogprob(token, logprob, top))

    def sample(self, logits: torch.Tensor | np.ndarray, rows: list[int], live: list[bool]) -> list[list[float]]:
        """The sampler over these logits (logits row i for batch row rows[i]; `live`: the rows that really decode), at
        once; its packed result on the host. On a CPU `logits` may be a float32 numpy array, and a plain step
        (SamplerFeatures.plain) runs in numpy over it and these lists (sampler.plain_on_host), giving only the leading
        (token, valid) fields of pack's layout, all that `sampled` reads of a row without logprobs (as any CPU step
        without logprobs does): right after a forward each tensor call costs microseconds, more than the sampling."""
        features = self.features([row for row, alive in zip(rows, live, strict=True) if alive])
        on_host = self.device.type == "cpu"
        if on_host and features.plain:
            x = logits if isinstance(logits, np.ndarray) else logits.float().numpy()
            return _token_rows(*plain_on_host(x, self.state, rows, live, features))
        tensor = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits
        index = torch.tensor(rows, device=self.device)
        live_rows = torch.tensor(live, device=self.device)
        out = sample(tensor, self.state, index, live_rows, features, on_host=on_host)
        if on_host and out.logprob is None:
            return _token_rows(out.tokens.numpy(), out.valid.numpy())
        return pack(out).tolist()


def _token_rows(tokens: np.ndarray, valid: np.ndarray) -> list[list[float]]:
    """The leading (token, valid) fields of pack's layout, row by row."""
    return [[token, ok] for token, ok in zip(tokens.tolist(), valid.tolist(), strict=True)]
