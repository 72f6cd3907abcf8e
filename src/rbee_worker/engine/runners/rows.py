"""What every model runner shares, whatever runs the forward (torch or llama.cpp): the KV block pool's size, and each
batch row's sampling state (its grammar's mask included) with the batched sampler over the logits rows of a step.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from rbee_worker.engine.request_types import TokenLogprob
from rbee_worker.engine.runners.protocol import KvGeometry, PromptRow, Sampled
from rbee_worker.engine.sampling.sampler import pack, plain_on_host, sample, unpack
from rbee_worker.engine.sampling.sampler_state import SamplerFeatures, SamplerState
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import Matcher, fill_masks, host_bitmask
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


@dataclass(frozen=True)
class WindowLayers:
    """A model's sliding layers as the KV pool sizes them: their window (positions a query sees, itself included), the
    bytes of keys and values a token takes in them, and the most prompt tokens one step computes (--prefill-chunk)."""

    window: int
    bytes_per_token: int
    prefill_chunk: int


def window_blocks_for(window: int, block_size: int, rows: int, prefill_chunk: int) -> int:
    """Blocks that hold every row's window at once, the scratch block included. A row computing positions [a, b)
    holds the blocks of [a' - window + 1, b), a' its first position whose step the host has not taken yet (a decode
    row: b - a' <= 2, a step in flight and the next; a prompt chunk: b - a' its length): at most
    ceil((window + 2) / block_size) + 1 blocks for a decode row, and a chunk's ceil(length / block_size) + 1 more, its
    round's chunks holding at most prefill_chunk tokens in all."""
    per_row = -(-(window + 2) // block_size) + 2
    return rows * per_row + -(-prefill_chunk // block_size) + 1


def kv_pool(
    context: int,
    bytes_per_token: int,
    block_size: int,
    budget: int,
    rows: int,
    shared_blocks: bool = True,
    window: WindowLayers | None = None,
) -> KvGeometry:
    """The block pool that `budget` bytes hold (no more than `rows` whole contexts use), and the context it offers one
    request: the model's, or all of the pool where that is less. Raises ModelLoadError when the pool holds fewer than
    MIN_CONTEXT tokens (a shorter context is the model's own choice).

    With `window` (a model's sliding layers; `bytes_per_token` then the other layers' share), the sliding layers get a
    pool of their own that holds every row's window (window_blocks) and the rest of the budget goes to the other
    layers, where that offers a longer context than one pool of every layer would, or the same in less memory."""
    per_context = -(-context // block_size)
    most = rows * per_context + 1  # + 1: the scratch block
    everything = bytes_per_token + (window.bytes_per_token if window else 0)
    blocks = min(budget // (block_size * everything), most)
    geometry = KvGeometry(blocks, block_size, min(context, max(blocks - 1, 0) * block_size), everything, shared_blocks)
    if window is not None:
        window_blocks = window_blocks_for(window.window, block_size, rows, window.prefill_chunk)
        rest = budget - window_blocks * block_size * window.bytes_per_token
        main = min(rest // (block_size * bytes_per_token), most) if bytes_per_token else most
        usable = max(main - 1, 0) * block_size
        split = KvGeometry(
            main, block_size, min(context, usable), bytes_per_token, shared_blocks, window.window, window_blocks,
            window.bytes_per_token,
        )  # fmt: skip
        if main > max(blocks, 1) or (main == blocks and split.bytes < geometry.bytes):
            geometry = split
    if geometry.context < min(context, MIN_CONTEXT):
        raise ModelLoadError(
            f"the KV cache does not fit in {budget / 2**30:.2f} GiB ({everything} bytes per token): give it "
            "more memory (--kv-cache-gb) or load a smaller model"
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)%s; up to %d tokens per request",
        geometry.blocks - 1,
        block_size,
        geometry.tokens,
        geometry.bytes / 2**30,
        f", the sliding layers' windows in {geometry.window_blocks - 1} blocks of their own" if geometry.window else "",
        geometry.context,
        extra={
            "fields": {
                "kv_blocks": geometry.blocks - 1,
                "kv_tokens": geometry.tokens,
                "kv_window_blocks": max(geometry.window_blocks - 1, 0),
                "max_model_len": geometry.context,
            }
        },
    )
    return geometry


class RowSampling:
    """Each batch row's sampling request (parameters, seed, penalty counts, logprobs wanted) in a SamplerState on the
    logits' device, and the batched sampler over a step's logits rows (engine/sampling/sampler.py), so that every
    runtime samples with the same code: penalties, top-k / top-p / min-p, seeds, logprobs and grammars behave
    identically."""

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
        return Sampled((token,), valid, () if logprob is None else (TokenLogprob(token, logprob, top),))

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


SCORE_ROWS = 256  # positions scored at once: their float32 log-softmax stays small beside the logits


def score(logits: torch.Tensor | np.ndarray, targets: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """The log-probability of `targets[i]` under logits row i, its rank, and the `top` most likely tokens there: the
    raw logits' log-softmax, as the sampler gives a sampled token's (before temperature and penalties)."""
    rows = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits
    scored: list[TokenLogprob] = []
    for start in range(0, len(targets), SCORE_ROWS):
        ids = torch.tensor(targets[start : start + SCORE_ROWS], device=rows.device)
        logprobs = torch.log_softmax(rows[start : start + len(ids)].float(), dim=-1)
        chosen = logprobs.gather(1, ids[:, None])
        ranks = (logprobs > chosen).sum(1) + 1
        values, indices = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], ids[:, None][:, :0])
        for token, logprob, rank, top_ids, top_values in zip(
            ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), indices.tolist(), values.tolist(), strict=True
        ):
            scored.append(TokenLogprob(token, logprob, tuple(zip(top_ids, top_values, strict=True)), rank))
    return tuple(scored)


def _token_rows(tokens: np.ndarray, valid: np.ndarray) -> list[list[float]]:
    """The leading (token, valid) fields of pack's layout, row by row."""
    return [[token, ok] for token, ok in zip(tokens.tolist(), valid.tolist(), strict=True)]


def pooled_rows(hidden: torch.Tensor, row: PromptRow) -> np.ndarray | None:
    """What a pooling prompt row gives of its hidden states [positions, hidden] (PromptRow.pool), float32 on the
    host."""
    if row.pool == "mean":
        return hidden.float().sum(0).cpu().numpy()
    if row.pool == "last":
        return hidden[-1].float().cpu().numpy()
    return hidden[0].float().cpu().numpy() if row.start == 0 else None


def device_fault(device: torch.device, error: BaseException) -> str | None:
    """After a torch forward raised `error`: on a GPU, whether the device still runs work (a CUDA error such as an
    illegal memory access leaves the context unusable, and every later call raises it again); None elsewhere, and
    for running out of memory."""
    if device.type != "cuda" or isinstance(error, torch.OutOfMemoryError):
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as probe:
        return f"the CUDA device fails every operation: {str(probe).splitlines()[0]}"
    return None
