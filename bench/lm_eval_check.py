"""lm-eval against the worker: the same tasks through lm-eval's `local-completions` model (the worker's
/v1/completions: echo + logprobs for log-likelihoods, batched token-id prompts) and through lm-eval's own `hf` model
on the same weights (float32), compared request by request: every log-likelihood, each greedy flag, the accuracy,
and every generated answer.

The tasks are local files (bench/lm_eval_tasks: a 20-question multiple-choice task and an 8-question generate_until
one), so nothing is downloaded. Needs `pip install lm-eval`.

    PYTHONPATH=src python bench/lm_eval_check.py --model DIR      # a safetensors directory (e.g. the demo's)
"""

import argparse
import json
import tempfile
from pathlib import Path

from rbee_worker.benchmark.run import machine, start_worker

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["rbee_mc", "rbee_gen"]


def include_dir(target: Path) -> Path:
    """The tasks' YAML files with their data files' absolute paths (lm-eval reads them relative to where it runs)."""
    for task in TASKS_DIR.glob("*.yaml"):
        (target / task.name).write_text(task.read_text().replace("DATA_DIR", str(TASKS_DIR.resolve())))
    return target


def evaluate(model: str, model_args: str, include: Path, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(include)),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def responses(results: dict, task: str) -> list:
    """Each document's responses in document order: (log-likelihood, greedy) per choice, or the generated text."""
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a safetensors directory")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results/lm_eval"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        include = include_dir(Path(tmp))
        reference = evaluate("hf", f"pretrained={args.model},dtype=float32", include, args.batch_size)
        worker_args = argparse.Namespace(model=args.model, device="cpu", dtype="float32", concurrency=[args.batch_size],
                                         worker_flag=[])  # fmt: skip
        process, url, _ = start_worker(worker_args, Path(tmp) / "worker.log")
        try:
            served = evaluate(
                "local-completions",
                f"model={args.model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={args.model},num_concurrent=1,max_retries=1",
                include,
                args.batch_size,
            )
        finally:
            process.terminate()
            process.wait(60)

    mc_ref, mc_ours = responses(reference, "rbee_mc"), responses(served, "rbee_mc")
    pairs = [(r[0], o[0]) for ref, ours in zip(mc_ref, mc_ours, strict=True) for r, o in zip(ref, ours, strict=True)]
    report = {
        "machine": machine(),
        "model": args.model,
        "loglikelihoods": len(pairs),
        "max_loglikelihood_diff": max(abs(float(r[0]) - float(o[0])) for r, o in pairs),
        "greedy_flags_equal": all(bool(r[1]) == bool(o[1]) for r, o in pairs),
        "acc": {
            name: results["results"]["rbee_mc"]["acc,none"] for name, results in (("hf", reference), ("worker", served))
        },
        "acc_norm": {
            name: results["results"]["rbee_mc"]["acc_norm,none"]
            for name, results in (("hf", reference), ("worker", served))
        },
        "exact_match": {
            name: results["results"]["rbee_gen"]["exact_match,none"]
            for name, results in (("hf", reference), ("worker", served))
        },
        "answers_equal": responses(reference, "rbee_gen") == responses(served, "rbee_gen"),
        "answers": {"hf": responses(reference, "rbee_gen"), "worker": responses(served, "rbee_gen")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_eval_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print("| measure | lm-eval hf | worker (local-completions) |")
    print("|---|---|---|")
    for key in ("acc", "acc_norm", "exact_match"):
        print(f"| {key} | {report[key]['hf']:.4f} | {report[key]['worker']:.4f} |")
    print(f"\n{len(pairs)} log-likelihoods, largest difference {report['max_loglikelihood_diff']:.2e}; greedy flags "
          f"equal: {report['greedy_flags_equal']}; generated answers equal: {report['answers_equal']}")  # fmt: skip


if __name__ == "__main__":
    main()
