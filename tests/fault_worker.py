"""`python tests/fault_worker.py FAULT:N ARGS...`: `rbee-worker ARGS...` with a fault injected
(tests/engine/test_faults.py).

FAULT is one of:
- `once`: the llama.cpp runner's Nth step raises once (a forward that fails, the device fine);
- `poison`: from the Nth step on, llama_decode fails with a fatal code (a context that cannot decode any more);
- `output`: the output processor raises at the Nth token it handles (a bug on the host);
- `cuda`: the torch runner's Nth decode step launch makes a device-side assert on the GPU (an out-of-bounds index),
  which leaves the CUDA context unusable.
"""

import sys
from collections.abc import Callable

import torch

from rbee_worker import cli
from rbee_worker.engine.output_processor import OutputProcessor
from rbee_worker.engine.runners.torch.torch_runner import TorchRunner


def inject(fault: str, n: int) -> None:
    calls = 0

    def counted(method, fail: Callable[[object], None], every_call_from_n: bool):
        def wrapper(self: object, *args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == n or (every_call_from_n and calls > n):
                fail(self)
            return method(self, *args, **kwargs)

        return wrapper

    def raising(error: Exception) -> Callable[[object], None]:
        def fail(_: object) -> None:
            raise error

        return fail

    if fault in ("once", "poison"):
        from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import (  # llama-cpp-python: not everywhere
            DecodeFailed,
            LlamaCppRunner,
        )

    if fault == "once":
        LlamaCppRunner.step = counted(LlamaCppRunner.step, raising(RuntimeError("injected failure")), False)
    elif fault == "poison":
        LlamaCppRunner.step = counted(LlamaCppRunner.step, raising(DecodeFailed(-3)), True)
    elif fault == "output":
        OutputProcessor.token = counted(OutputProcessor.token, raising(KeyError("injected bug")), False)
    elif fault == "cuda":

        def out_of_bounds(runner: TorchRunner) -> None:
            torch.zeros(1, device=runner.device)[torch.tensor([1 << 20], device=runner.device)].item()

        TorchRunner.launch = counted(TorchRunner.launch, out_of_bounds, False)
    else:
        raise SystemExit(f"unknown fault {fault}")


if __name__ == "__main__":
    fault, count = sys.argv[1].split(":")
    inject(fault, int(count))
    sys.exit(cli.main(sys.argv[2:]))
