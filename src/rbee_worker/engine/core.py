"""The step loop over one runner, as nano-vllm's and vLLM v1's: the scheduler plans a round
(engine/scheduling/scheduler.py), the executor carries it out on the runner (engine/executor.py), the scheduler takes
back what it computed, and the output processor turns that into events (engine/output_processor.py). Each stage returns
a value to the next; none calls another. The requests a step ends come back to the caller (engine/engine.py), which
delivers their terminal events.
"""

import functools

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.executor import Executor
from rbee_worker.engine.output_processor import Ended, EngineObserver, OutputProcessor
from rbee_worker.engine.plan import Sequence
from rbee_worker.engine.request_types import ErrorCode, StopReason
from rbee_worker.engine.runners.protocol import Runner
from rbee_worker.engine.scheduling.scheduler import Proposer, Scheduler
from rbee_worker.loading.loaded import LoadedModel


def make_runner(loaded: LoadedModel, config: EngineConfig) -> Runner:
    """The runner of the loaded model's runtime (loading/loader.py chose it)."""
    if loaded.info.encoder:
        from rbee_worker.engine.runners.torch.encoder_runner import EncoderRunner

        return EncoderRunner(loaded, config)
    if loaded.info.runtime == "llama.cpp":
        from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import (
            LlamaCppRunner,  # imports llama-cpp-python, optional
        )

        return LlamaCppRunner(loaded, config)
    from rbee_worker.engine.runners.torch.torch_runner import TorchRunner

    return TorchRunner(loaded, config)


class EngineCore:
    """The scheduler, the executor and the output processor of one runner, and the step that runs them in turn."""

    def __init__(
        self,
        runner: Runner,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        eos = runner.loaded.info.eos_token_ids
        # The model's pooling, read (from its files) at the first embedding request, once for the executor and the
        # output processor.
        pooling = functools.cache(lambda: runner.loaded.pooling.mode)
        self.runner = runner
        self.scheduler = Scheduler(config, runner.capabilities, runner.kv, eos, runner.prefixes, proposer)
        self.executor = Executor(runner, eos, pooling)
        self.output = OutputProcessor(runner.kv.request_bytes, pooling, observer)

    def step(self) -> list[Ended]:
        """One round; the requests it ends."""
        plan = self.scheduler.schedule()
        executed = self.executor.execute(plan)
        progress = self.scheduler.update(executed)
        return self._free(self.output.process(progress))

    def add(self, sequence: Sequence) -> None:
        """A new request waits for a batch row; its Started event goes out."""
        self.scheduler.add(sequence)
        self.output.started(sequence)

    def cancel(self, request_id: str) -> list[Ended]:
        """End a request now (unknown ids are ignored): its blocks are free and its id may come again at once."""
        sequence = self.scheduler.get(request_id)
        return self._free([self.output.end(sequence, StopReason.CANCELLED)]) if sequence else []

    def stop(self) -> list[Ended]:
        """The engine stops: the tokens of a step in flight are taken, then every request left is cancelled."""
        ended = self._free(self.output.process(self.scheduler.update(self.executor.drain())))
        return ended + self._free([self.output.end(s, StopReason.CANCELLED) for s in self.unfinished])

    def fail_all(self, code: ErrorCode, message: str) -> list[Ended]:
        """Every request admitted ends with this error (the device is unusable)."""
        return self._free([self.output.fail(s, code, message) for s in self.unfinished])

    @property
    def unfinished(self) -> list[Sequence]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def _free(self, ended: list[Ended]) -> list[Ended]:
        """The ended requests' rows and blocks are free; what the runtime keeps for their rows goes (or into its own
        prompt cache, before the next plan looks there)."""
        for sequence, _ in ended:
            if (row := self.scheduler.free(sequence)) is not None:
                self.executor.release(row)
        return ended
