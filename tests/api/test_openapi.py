"""The published OpenAPI document against what the routes really accept and return: schemathesis generates requests
(valid and invalid) for every operation and checks each response: no 5xx, a documented status code and content type,
a body that matches the documented schema, invalid data refused.

The worker serves a tiny random-weight model with a short context, so generated jobs finish in milliseconds.
POST /shutdown goes last: it stops the worker under test (which must then exit 0).
positive_data_acceptance is left out: a schema-valid request can still be refused for what JSON Schema cannot say
(prompt + max_tokens beyond the context, a job_id already running, a model name that is not this one's).
"""

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.core.failures import FailureGroup
from serving import Worker, running

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 30  # per operation and mode (valid data, invalid data)


@pytest.fixture(scope="module")
def tiny_worker(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running(
        tmp_path_factory.mktemp("openapi"),
        "--model", str(tiny_models["mistral"]),
        "--max-context", "96",
        "--max-batch", "64",
        "--max-queue", "512",
        "--unclaimed-job-timeout", "2",
        fork=True,
    ) as worker:  # fmt: skip
        yield worker


def test_every_operation_keeps_its_documented_contract(tiny_worker: Worker) -> None:
    """Positive and negative cases for each operation; every failure is collected, then reported together."""
    # schemathesis' own pytest integration (from_fixture) breaks on pytest 9.2: its strategies are driven directly.
    api = schemathesis.openapi.from_url(f"{tiny_worker.url}/openapi.json")
    cases: Counter[str] = Counter()
    failures: dict[str, str] = {}
    operations = sorted((result.ok() for result in api.get_all_operations()), key=lambda op: op.path == "/shutdown")
    for operation in operations:
        for mode in GenerationMode:
            try:
                fuzz(operation, mode, cases)
            except (Exception, FailureGroup) as exc:  # every operation is tried; failures are reported together
                failures[f"{operation.label} ({mode.value})"] = str(exc)[:3000]
    print(f"schemathesis: {sum(cases.values())} cases over {len(cases)} operations: {dict(cases)}")
    assert not failures, "\n\n".join(f"{label}: {failure}" for label, failure in failures.items())
    assert len(cases) == len(operations)
    assert '"level": "error"' not in tiny_worker.stderr()  # no job failed inside the engine either


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, cases: Counter[str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        cases[operation.label] += 1
        case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)

    try:
        check()
    except Unsatisfiable:  # an operation without parameters or body has no invalid input to try
        assert mode is GenerationMode.NEGATIVE
