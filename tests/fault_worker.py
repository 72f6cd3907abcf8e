"""`python tests/fault_worker.py FAULT:N ARGS...`: `rbee-worker ARGS...` with a fault injected (tests/test_faults.py).

FAULT is one of:
- `once`: the llama.cpp runner's Nth step raises once (a forward that fails, the device fine);
- `poison`: from the Nth step on, llama_decode fails with a fatal code (a context that cannot decode any more);
- `output`: the output processor raises at the Nth token it handles (a bug on the host);
- `cuda`: the torch runner's Nth decode step launch makes a device-side assert on the GPU (an out-of-bounds index),
  which leaves the CUDA context unusable.
"""

import sys

import torch

from rbee_worker import cli
from rbee_worker.engine.output import OutputProcessor
from rbee_worker.engine.torch_runner import TorchRunner


def inject(fault: str, n: int) -> None:
    calls = 0

    def counted(method, error: Exception, every_call_from_n: bool):
        def wrapper(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == n or (every_call_from_n and calls > n):
                raise error
            return method(*args, **kwargs)

        return wrapper

    if fault in ("once", "poison"):
        from rbee_worker.engine.llama_cpp_runner import DecodeFailed, LlamaCppRunner  # llama-cpp-python: not everywhere

    if fault == "once":
        LlamaCppRunner.step = counted(LlamaCppRunner.step, RuntimeError("injected failure"), False)
    elif fault == "poison":
        LlamaCppRunner.step = counted(LlamaCppRunner.step, DecodeFailed(-3), True)
    elif fault == "output":
        OutputProcessor.token = counted(OutputProcessor.token, KeyError("injected bug"), False)
    elif fault == "cuda":
        launch = TorchRunner.launch

        def poisoning(self: TorchRunner, *args: object) -> object:
            nonlocal calls
            calls += 1
            if calls == n:
                torch.zeros(1, device=self.device)[torch.tensor([1 << 20], device=self.device)].item()
            return launch(self, *args)

        TorchRunner.launch = poisoning
    else:
        raise SystemExit(f"unknown fault {fault}")


if __name__ == "__main__":
    fault, count = sys.argv[1].split(":")
    inject(fault, int(count))
    sys.exit(cli.main(sys.argv[2:]))
