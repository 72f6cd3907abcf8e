"""How long until the demo GGUF is ready: rbee-worker's loader against transformers' own GGUF loading.

    .venv/bin/python bench/load_time.py [--repeats 3]

Each run is a fresh process, timed from its start until the model and tokenizer are loaded (imports included), so
both sides pay the same start-up. Prints a table (median) and writes bench/results/load_time.json.
"""

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rbee_worker.loading.demo import demo_model_path

RBEE = """
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model
load_model({path!r}, resolve_placement("cpu", "auto"))
"""
TRANSFORMERS = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoModelForCausalLM.from_pretrained({dir!r}, gguf_file={name!r}, dtype=torch.float16)
AutoTokenizer.from_pretrained({dir!r}, gguf_file={name!r})
"""


def time_process(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    path = demo_model_path()
    code = {
        "rbee-worker": RBEE.format(path=str(path)),
        "transformers gguf_file=": TRANSFORMERS.format(dir=str(path.parent), name=path.name),
        "python -c 'import torch, transformers model classes'": "import torch\nfrom transformers import "
        "LlamaForCausalLM",
    }
    runs = {name: [time_process(source) for _ in range(args.repeats)] for name, source in code.items()}
    print(f"{'loader':<55} {'median s':>9}  runs")
    for name, times in runs.items():
        print(f"{name:<55} {statistics.median(times):>9.2f}  {', '.join(f'{t:.2f}' for t in times)}")
    result = {
        "what": "demo GGUF (SmolLM2-135M Q4_1) to a float16 model + tokenizer on CPU, process start to loaded",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        # transformers imports scipy when it is installed (the test extra brings it): about 0.5 s more start-up.
        "scipy_installed": importlib.util.find_spec("scipy") is not None,
        "median_s": {name: round(statistics.median(times), 2) for name, times in runs.items()},
        "runs_s": {name: [round(t, 2) for t in times] for name, times in runs.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_time.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
