"""From a parsed request (a native job, an OpenAI body, the `generate` command's flags) to the engine's settings."""

import dataclasses

from rbee_worker.engine.sampling.sampling_params import SamplingParams

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(parsed: object) -> SamplingParams:
    """The sampling settings `parsed` carries as attributes named like SamplingParams' fields.

    Each front end fills in its own defaults while parsing, so they stay its own; a setting it does not have at all
    (the native API has no presence or frequency penalty) keeps SamplingParams' neutral default. Only the instance's
    own attributes count (`vars`): a pydantic model's declared, validated fields, never the extra keys a client may
    add to an OpenAI body. Raises ValueError for a value SamplingParams refuses.
    """
    given = vars(parsed)
    return SamplingParams(**{name: given[name] for name in _SAMPLING_FIELDS if name in given})
