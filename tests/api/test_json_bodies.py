"""Issue 29's bodies: JSON is read without `Content-Type: application/json` (none, or curl -d's form type) on the
OpenAI API and the native one, and malformed JSON gets one message with its line and column on both."""

import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import AUTH, SharedWorkers, default_runtime
from serving import DEMO_NAME, read_rest

pytestmark = pytest.mark.slow

FORM = "application/x-www-form-urlencoded"  # what curl -d sends
MALFORMED = b'{"prompt": "Hi",\n "max_tokens": }'
WHERE = "body is not valid JSON: Expecting value (line 2, column 16)"


@pytest.fixture(scope="module")
def http(shared_workers: SharedWorkers) -> Iterator[httpx.Client]:
    """On the session's shared worker of the default runtime (default flags, SHARED_TOKEN)."""
    worker = shared_workers.get(default_runtime())
    with httpx.Client(base_url=worker.url, timeout=120, headers=AUTH) as http:
        yield http


def build(http: httpx.Client, path: str, body: bytes, content_type: str | None) -> httpx.Request:
    """A POST of `body` with this Content-Type; None: with none at all (httpx sets none for bytes)."""
    headers = {"content-type": content_type} if content_type is not None else {}
    request = http.build_request("POST", path, content=body, headers=headers)
    assert request.headers.get("content-type") == content_type
    return request


def post(http: httpx.Client, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    return http.send(build(http, path, body, content_type))


@pytest.mark.parametrize("content_type", [None, FORM, "text/plain"])
def test_json_without_its_content_type_is_read_as_json(http: httpx.Client, content_type: str | None) -> None:
    body = b'{"model": "demo", "prompt": "Hi", "max_tokens": 2, "temperature": 0}'
    completion = post(http, "/v1/completions", body, content_type)
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == DEMO_NAME and completion.json()["usage"]["completion_tokens"] <= 2
    tokens = post(http, "/tokenize", b'{"prompt": "Hi"}', content_type)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
    job = f'{{"job_id": "{uuid.uuid4().hex}", "prompt": "Hi", "max_tokens": 2}}'.encode()
    response = post(http, "/execute", job, content_type)  # read to its end: the whole SSE stream
    assert response.status_code == 200
    assert read_rest(response).terminal["type"] == "end"


@pytest.mark.parametrize("content_type", ["application/json", None])
def test_malformed_json_gets_its_line_and_column_on_both_apis(http: httpx.Client, content_type: str | None) -> None:
    openai_answer = post(http, "/v1/completions", MALFORMED, content_type)
    assert openai_answer.status_code == 400
    assert openai_answer.json() == {
        "error": {"message": WHERE, "type": "invalid_request_error", "param": None, "code": None}
    }
    for path in ("/execute", "/v1/inference"):
        native_answer = post(http, path, MALFORMED, content_type)
        assert native_answer.status_code == 400
        assert native_answer.json() == {"errors": [{"field": "body", "constraint": "json", "message": WHERE}]}
    cancel = post(http, "/cancel", b'{"job_id": ', content_type)
    assert cancel.status_code == 400
    [error] = cancel.json()["errors"]
    assert error["message"] == "body is not valid JSON: Expecting value (line 1, column 12)"
