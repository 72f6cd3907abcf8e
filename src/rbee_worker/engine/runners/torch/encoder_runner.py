"""The runner of an encoder model (BERT family, loading/hf.py's is_encoder): transformers' base model, which attends
both ways over a whole input, so each prompt runs in one forward (Capabilities.whole_prompts) and keeps no keys or
values. It serves embedding requests only (ServedModel.validate refuses the rest): a step pads its prompts to the
longest with the attention mask marking each row's own positions, as sentence-transformers batches them, and gives back
each row's pooled hidden states (PromptRow.pool). Its block pool accounts for positions and holds no memory."""

from collections.abc import Sequence

import torch

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.runners.protocol import (
    Capabilities,
    DecodeRow,
    Finished,
    KvGeometry,
    Launched,
    PrefixHit,
    PromptRow,
    Sampled,
    Stepped,
)
from rbee_worker.engine.runners.rows import device_fault, pooled_rows
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import Matcher
from rbee_worker.loading.loaded import LoadedModel

BLOCK_SIZE = 16


class EncoderRunner:
    """Runs an encoder's forwards over whole prompts, on any device, eagerly."""

    prefixes = None  # the block pool is the prefix cache

    capabilities = Capabilities(mixed_batches=False, whole_prompts=True)

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.info.device
        context = loaded.info.context_length
        blocks = config.max_batch * -(-context // BLOCK_SIZE) + 1  # every row a whole context, and the scratch block
        self.kv = KvGeometry(blocks, BLOCK_SIZE, context, bytes_per_token=0, shared_blocks=False)
        self.vocab_size = self.model.config.vocab_size
        self.pad_id = loaded.tokenizer.pad_token_id or 0

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """Nothing to hold: the runner samples nothing."""

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        """Nothing to hold: the runner samples nothing."""

    def restore(self, row: int, hit: PrefixHit) -> bool:
        raise NotImplementedError("the block pool is the prefix cache (prefixes is None)")

    def evict(self, row: int) -> None:
        """Nothing kept between steps."""

    def release(self, row: int) -> None:
        """Nothing kept between steps."""

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        """One forward over whole prompts, padded on the right; each row's pooled hidden states."""
        if decodes or any(row.start != 0 or row.sample or row.targets for row in prompts):
            raise ValueError("an encoder computes whole prompts for embeddings, and samples and scores nothing")
        width = max(len(row.token_ids) for row in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, row in enumerate(prompts):
            ids[i, : len(row.token_ids)] = torch.tensor(row.token_ids)
            mask[i, : len(row.token_ids)] = 1
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        pooled = [pooled_rows(hidden[i, : len(r.token_ids)], r) if r.pool else None for i, r in enumerate(prompts)]
        return Stepped([], [() for _ in prompts], pooled)

    def chains(self, decodes: list[DecodeRow]) -> bool:
        return False

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        raise ValueError("an encoder has no decode steps")

    def sample_held(self, launched: Launched) -> None:
        raise ValueError("an encoder has no decode steps")

    def collect(self, launched: Launched) -> list[Sampled]:
        assert isinstance(launched, Finished)
        return launched.sampled

    def fault(self, error: BaseException) -> str | None:
        return device_fault(self.device, error)

    def kv_bytes(self) -> int:
        return 0

    def memory_bytes(self) -> int:
        return self.loaded.info.weight_bytes

    def prompt_cache_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing beyond what Python's collector frees."""
