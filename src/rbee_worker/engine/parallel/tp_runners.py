"""Tensor parallelism's runners (the processes and their rendezvous: engine/parallel/ranks.py; the messages:
engine/parallel/tp_messages.py). Rank 0's runner, TensorParallelRunner, is the Runner protocol of
engine/runners/protocol.py around rank 0's own TorchRunner over its shard: each forward's rows go to the other ranks
(Ranks.send) before rank 0 computes the forward itself, so that every rank runs the same forwards in the same order and
their collectives pair up. Every other rank runs a FollowerRunner: the same forwards, whose logits (its vocabulary
shard's) go to rank 0 in the LM head's gather (loading/sharding/tp_layers.py).

What only rank 0 needs stays there: the sampling state (`assign`, `masks`: the logits are sampled on rank 0 alone) and
the block accounting (`evict`, `release`, `reuse`: the torch runner keeps nothing beyond the KV blocks, whose tables
every forward's rows carry).

Off under tensor parallelism for now, rather than half supported: CUDA graphs and torch.compile (no all-reduce is
captured in a graph yet), and decode steps launched ahead or chained (each step is finished when `launch` returns).

Once every rank has made its runner, one gather tells rank 0 what each rank holds (`runner_reports`), which Ranks
reports for all of them.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch.distributed as dist

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.parallel.rank_group import first_line
from rbee_worker.engine.parallel.ranks import LOST_WAIT_S, Ranks
from rbee_worker.engine.parallel.tp_messages import ForwardRows, RankReport, RunnerSetup
from rbee_worker.engine.runners.protocol import (
    Capabilities,
    DecodeRow,
    DeviceFault,
    Launched,
    PrefixHit,
    PromptRow,
    Sampled,
    Stepped,
)
from rbee_worker.engine.runners.torch.torch_runner import TorchRunner, size_pool
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import Matcher
from rbee_worker.loading.loaded import LoadedModel

_T = TypeVar("_T")


def runner_reports(world: int, runner: TorchRunner, device: str) -> list[RankReport]:
    """Every rank's report once its runner is made (one gather, on every rank in the same place: right after the
    RunnerSetup): the weights as the runner prepared them (packed for oneDNN, say) and its memory then."""
    own = RankReport(device, runner.loaded.info.weight_bytes, runner.memory_bytes())
    reports: list[RankReport | None] = [None] * world
    dist.all_gather_object(reports, own)
    return [report if report is not None else RankReport(device) for report in reports]


def serving_config(config: EngineConfig) -> EngineConfig:
    """The engine's settings as tensor parallelism runs them: no CUDA graphs, no torch.compile (see the module)."""
    return dataclasses.replace(config, cuda_graphs=False, compile_model=False)


class TensorParallelRunner:
    """Rank 0's runner: rank 0's TorchRunner over its shard, each forward's rows sent to the other ranks first."""

    prefixes = None  # the block pool is the prefix cache

    # One forward at a time, each of one kind, finished when it returns (see the module docstring).
    capabilities = Capabilities(mixed_batches=False)

    def __init__(self, loaded: LoadedModel, config: EngineConfig, ranks: Ranks) -> None:
        config = serving_config(config)
        kv = size_pool(loaded, config)  # rank 0's pool, for every rank: the scheduler hands out its blocks
        with ranks.turn():
            ranks.send(RunnerSetup(config, kv))
        self.ranks = ranks
        self.local = TorchRunner(loaded, config, kv)
        ranks.reports = runner_reports(ranks.world, self.local, str(self.local.device))
        # What the worker reports: the weights of every rank's shard, as each rank measured them.
        info = dataclasses.replace(self.local.loaded.info, weight_bytes=sum(r.weight_bytes for r in ranks.reports))
        self.loaded = dataclasses.replace(self.local.loaded, info=info)
        self.kv, self.vocab_size = kv, self.local.vocab_size

    # -- rank 0's alone --------------------------------------------------------------------------------------------

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        self.local.assign(row, params, seed, prompt_ids, logprobs)

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        self.local.masks(rows)

    def restore(self, row: int, hit: PrefixHit) -> bool:
        raise NotImplementedError("the block pool is the prefix cache (prefixes is None)")

    def evict(self, row: int) -> None:
        self.local.evict(row)

    def release(self, row: int) -> None:
        self.local.release(row)

    # -- forwards: on every rank -----------------------------------------------------------------------------------

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        if not (prompts or decodes):
            return Stepped([], [])
        return self._everywhere(ForwardRows(prompts, decodes), lambda: self.local.step(prompts, decodes))

    def chains(self, decodes: list[DecodeRow]) -> bool:
        """Never: each step is finished when `launch` returns."""
        return False

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        """The step computed at once (`chains` is False, so no sampling is ever held)."""
        return self._everywhere(ForwardRows([], decodes), lambda: self.local.launch(decodes))

    def sample_held(self, launched: Launched) -> None:
        """Nothing: no step is launched with its sampling held."""

    def collect(self, launched: Launched) -> list[Sampled]:
        return self.local.collect(launched)

    def _everywhere(self, forward: ForwardRows, compute: Callable[[], _T]) -> _T:
        """The forward sent to the other ranks, then computed here. Any failure stops the worker (DeviceFault): a rank
        that is gone, or a forward that failed here part way, which leaves the ranks' all-reduces out of step."""
        try:
            with self.ranks.turn():
                self.ranks.send(forward)
                return compute()
        except DeviceFault:
            raise
        except Exception as exc:  # a rank that died fails the collective it was in: say which
            out_of_step = f"a forward failed on rank 0, which leaves the ranks out of step: {first_line(exc)}"
            if self.ranks.group is not None:
                out_of_step += " (a rank on another node may be gone)"
            reason = self.ranks.lost(LOST_WAIT_S) or out_of_step
            self.ranks.failure = self.ranks.failure or reason  # no Stop then: rank 0's exit ends the other nodes' ranks
            raise DeviceFault(reason) from exc

    # -- the rest --------------------------------------------------------------------------------------------------

    def fault(self, error: BaseException) -> str | None:
        if isinstance(error, DeviceFault):
            return str(error)
        return self.ranks.lost() or self.local.fault(error)

    def kv_bytes(self) -> int:
        """Every rank's KV cache: rank 0's times the ranks (each holds as many blocks, for its own key/value heads)."""
        return self.local.kv_bytes() * self.ranks.world

    def prompt_cache_bytes(self) -> int:
        return self.local.prompt_cache_bytes()

    def memory_bytes(self) -> int:
        """Every rank's memory: rank 0's as its TorchRunner measures it, and each other rank's shard (its own figure)
        and KV cache (as rank 0's)."""
        return self.local.memory_bytes() + sum(self.rank_memory_bytes()[1:])

    def rank_memory_bytes(self) -> list[int]:
        """Each rank's memory, in rank order: rank 0's measured now; another rank's on a GPU as it measured it once
        its runner was made (its KV pool allocated then), elsewhere its weights plus rank 0's touched KV bytes now."""
        others = self.ranks.reports[1:]
        if self.local.device.type == "cuda":
            return [self.local.memory_bytes()] + [report.memory_bytes for report in others]
        kv = self.local.kv_bytes()
        return [self.local.memory_bytes()] + [report.weight_bytes + kv for report in others]

    def close(self) -> None:
        self.local.close()


class FollowerRunner(TorchRunner):
    """A rank's runner beyond rank 0: rank 0's forwards over this rank's shard. Its LM head gathers its logits to rank
    0 and returns none here; the sampler is rank 0's alone."""

    def run(self, forward: ForwardRows) -> None:
        """Compute one of rank 0's forwards (its collectives pair with every other rank's)."""
        if forward.prompts:
            self._prompt_forward(forward.prompts)
        elif forward.decodes:
            self._decode_step(forward.decodes)


def runner_factory(ranks: Ranks) -> Callable[[LoadedModel, EngineConfig], TensorParallelRunner]:
    """The Engine's `runner` factory on rank 0: its TensorParallelRunner, made known to `ranks` (every rank's memory,
    heartbeats, Pings)."""

    def make(loaded: LoadedModel, config: EngineConfig) -> TensorParallelRunner:
        runner = TensorParallelRunner(loaded, config, ranks)
        ranks.serving(runner.rank_memory_bytes)
        return runner

    return make
