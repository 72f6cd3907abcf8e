"""Load and generate with a real-shape Llama (random weights, fixed seed) on a CUDA GPU; record what ran.

    PYTHONPATH=src python bench/cuda_check.py --tokenizer DIR [--shape llama-3.2-1b] [--out bench/results]

The model (bench/shapes.py) is written as safetensors and loaded through rbee-worker's own loader, exactly as
`--model DIR` would, then generates greedily through the engine.
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers
from shapes import SHAPES, write_model

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / args.shape
        write_model(args.shape, args.tokenizer, directory)
        engine = Engine(lambda: load_model(str(directory), Placement(torch.device("cuda", 0), torch.bfloat16)))
        loaded = engine.loaded
        runs = []
        for prompt in ("The capital of France is", "Once upon a time, in a small village by the sea,"):
            request = Request(
                engine.model.tokenize(prompt), max_tokens=args.tokens, sampling=SamplingParams(temperature=0)
            )
            started = time.perf_counter()
            events = list(engine.stream(request))
            end = events[-1]
            assert isinstance(end, End), end
            runs.append(
                {
                    "prompt_tokens": end.prompt_tokens,
                    "tokens_out": end.tokens_out,
                    "stop_reason": end.stop_reason.value,
                    "wall_s": round(time.perf_counter() - started, 3),
                    "decode_tok_per_s": round((end.tokens_out - 1) / end.decode_time_s, 1),
                    "text_chars": sum(len(e.text) for e in events if isinstance(e, Token)),
                }
            )
        result = {
            "what": f"random-weight {args.shape} (bf16, safetensors) loaded by rbee-worker and generated greedily",
            "card": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "load_seconds": round(loaded.info.load_seconds, 2),
            "weight_bytes": loaded.info.weight_bytes,
            "memory_bytes_after_generation": engine.memory_bytes(),
            "parameters_on_cuda": all(p.is_cuda for p in loaded.model.parameters()),
            "runs": runs,
            "note": "engine runs one sequence per forward (no CUDA graphs yet): decode speed is not a target here",
        }
        engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    name = result["card"].replace(" ", "_")
    (args.out / f"cuda_check_{args.shape}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
