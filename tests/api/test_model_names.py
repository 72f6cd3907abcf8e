"""Issue 29's names: after `serve --model demo --served-model-name NAME...`, the official openai client works with
any of the names (the reported one being the first --served-model-name); an unknown name is a 404 listing them."""

from collections.abc import Iterator

import openai
import pytest
from serving import DEMO_NAME, PROMPT, Worker, running

pytestmark = pytest.mark.slow

ALIASES = ("alias", "other-alias", "org/with-slash")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running(tmp_path_factory.mktemp("names"), "--served-model-name", *ALIASES, fork=True) as worker:
        yield worker


@pytest.fixture(scope="module")
def client(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_every_name_once_the_reported_one_first(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [*ALIASES, "demo", DEMO_NAME]


def test_each_name_is_retrieved_and_an_unknown_one_is_a_404(client: openai.OpenAI) -> None:
    """GET /v1/models/{id} (`models.retrieve`), for a name with a slash too."""
    for name in [*ALIASES, "demo", DEMO_NAME]:
        card = client.models.retrieve(name)
        assert (card.id, card.object) == (name, "model") and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("name", ["demo", "alias", "other-alias", DEMO_NAME])
def test_every_name_is_answered_under_the_reported_one(client: openai.OpenAI, name: str) -> None:
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert chat.model == "alias" and chat.usage.completion_tokens <= 2
    [chunk, *_] = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0, stream=True)
    assert chunk.model == "alias"


def test_an_unknown_name_is_a_404_listing_the_names(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    error = caught.value.body
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "`gpt-4` does not exist" in error["message"]
    assert all(f"`{name}`" in error["message"] for name in (*ALIASES, "demo", DEMO_NAME)), error["message"]
