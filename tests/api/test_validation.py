"""Native job request validation (CONTRACT.md §2): every rule at its boundaries, error order, types and the body."""

import json

import pytest

from rbee_worker.api.native_validation import FieldError, JobRequest, errors_body, parse_job_request

CONTEXT = 100_000  # large enough that the context rule stays out of the way unless a test is about it


def words(text: str) -> int:
    return len(text.split())


def parse(
    body: dict | bytes, *, require_job_id: bool = True, context_length: int = CONTEXT, count_tokens=words
) -> JobRequest | list[FieldError]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_job_request(
        raw, require_job_id=require_job_id, count_tokens=count_tokens, context_length=context_length
    )


def ok(body: dict | bytes, **kwargs) -> JobRequest:
    result = parse(body, **kwargs)
    assert isinstance(result, JobRequest), result
    return result


def errors(body: dict | bytes, **kwargs) -> list[FieldError]:
    result = parse(body, **kwargs)
    assert isinstance(result, list), result
    return result


def pairs(body: dict | bytes, **kwargs) -> list[tuple[str, str]]:
    return [(e.field, e.constraint) for e in errors(body, **kwargs)]


def req(**fields) -> dict:
    """A valid /execute body plus the given fields (None values are sent as JSON null)."""
    return {"job_id": "job-1", "prompt": "hello world", **fields}


# --- success, defaults, unknown fields -------------------------------------------------------------------------------


def test_defaults_filled_in():
    assert ok(req()) == JobRequest(
        job_id="job-1",
        prompt="hello world",
        max_tokens=2048,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=None,
        stop=(),
    )


def test_every_field_given():
    body = req(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=42,
        stop=["\n", "x"],
    )
    assert ok(body) == JobRequest("job-1", "hello world", 7, 0.5, 0.9, 40, 0.05, 1.1, 42, ("\n", "x"))


def test_null_is_the_default():
    fields = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")
    assert ok(req(**dict.fromkeys(fields))) == ok(req())


def test_unknown_fields_ignored():
    body = req(stream=True, model="other", extra={"nested": [1, "x"]}, max_tokens=5)
    assert ok(body).max_tokens == 5


def test_duplicate_keys_last_wins():
    assert ok(b'{"job_id": "a", "prompt": "p", "max_tokens": 0, "max_tokens": 3}').max_tokens == 3


# --- the contract's example and the JSON shape ------------------------------------------------------------------------


def test_contract_example_exactly():
    errs = errors(req(max_tokens=0))
    assert errors_body(errs) == {
        "errors": [
            {
                "field": "max_tokens",
                "constraint": "range(1..=2048)",
                "message": "max_tokens must be at least 1",
                "value": "0",
            }
        ]
    }


def test_to_json_omits_missing_value():
    (err,) = errors({"job_id": "j"})
    assert err.to_json() == {"field": "prompt", "constraint": "required", "message": "prompt is required"}


# --- every rule singly, both sides of each boundary -------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 2, 2047, 2048])
def test_max_tokens_in_range(value):
    assert ok(req(max_tokens=value)).max_tokens == value


@pytest.mark.parametrize(("value", "message"), [(0, "at least 1"), (-1, "at least 1"), (2049, "at most 2048")])
def test_max_tokens_out_of_range(value, message):
    (err,) = errors(req(max_tokens=value))
    assert (err.field, err.constraint, err.value) == ("max_tokens", "range(1..=2048)", str(value))
    assert err.message == f"max_tokens {'must be ' + message}"


@pytest.mark.parametrize(
    ("field", "lo", "hi", "constraint"),
    [
        ("temperature", 0.0, 2.0, "range(0.0..=2.0)"),
        ("top_p", 0.0, 1.0, "range(0.0..=1.0)"),
        ("min_p", 0.0, 1.0, "range(0.0..=1.0)"),
    ],
)
def test_float_ranges(field, lo, hi, constraint):
    assert getattr(ok(req(**{field: lo})), field) == lo
    assert getattr(ok(req(**{field: hi})), field) == hi
    assert pairs(req(**{field: hi + 0.0000001})) == [(field, constraint)]
    assert pairs(req(**{field: lo - 0.0000001})) == [(field, constraint)]
    below, above = errors(req(**{field: -1})), errors(req(**{field: hi + 1}))
    assert below[0].message == f"{field} must be at least {lo}"
    assert above[0].message == f"{field} must be at most {hi}"


def test_float_range_is_checked_on_the_float_the_engine_gets():
    # 2.00000000000000000001 is 2.0 as a float: in range (vLLM, reading floats, accepts it too).
    assert ok(b'{"job_id": "j", "prompt": "p", "temperature": 2.00000000000000000001}').temperature == 2.0


def test_temperature_two_point_zero_zero_zero_zero_zero_zero_one():
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "temperature": 2.0000001}')
    assert (err.field, err.constraint, err.value) == ("temperature", "range(0.0..=2.0)", "2.0000001")


def test_negative_zero_temperature_is_greedy_zero():
    t = ok(b'{"job_id": "j", "prompt": "p", "temperature": -0.0}').temperature
    assert t == 0.0 and str(t) == "0.0"


def test_float_too_large_for_a_float_is_out_of_range_not_infinite():
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "top_p": 1e400}')
    assert (err.field, err.constraint, err.value) == ("top_p", "range(0.0..=1.0)", "1E+400")


@pytest.mark.parametrize("value", [0.000001, 1.0, 2.0])
def test_repetition_penalty_in_range(value):
    assert ok(req(repetition_penalty=value)).repetition_penalty == value


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"0", "greater than 0.0"),
        (b"0.0", "greater than 0.0"),
        (b"-0.5", "greater than 0.0"),
        (b"1e-400", "greater than 0.0"),  # positive, but 0.0 as a float: the engine would divide by zero
        (b"2.0000001", "at most 2.0"),
    ],
)
def test_repetition_penalty_out_of_range(raw, message):
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "repetition_penalty": ' + raw + b"}")
    assert (err.field, err.constraint) == ("repetition_penalty", "range(0.0..=2.0)")
    assert err.message == f"repetition_penalty must be {message}"


@pytest.mark.parametrize("value", [0, 1, 50, 10**9, 2**63 - 1])
def test_top_k_in_range(value):
    assert ok(req(top_k=value)).top_k == value


@pytest.mark.parametrize("raw", [b"-1", str(2**63).encode(), b"1e999999999"])
def test_top_k_out_of_range(raw):
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "top_k": ' + raw + b"}")
    assert (err.field, err.constraint) == ("top_k", "range(0..)")


@pytest.mark.parametrize("value", [0, 1, 2**63, 2**64 - 1])
def test_seed_in_range(value):
    assert ok(req(seed=value)).seed == value


def test_seed_null_means_random():
    assert ok(req(seed=None)).seed is None


def test_seed_integral_float_is_read_exactly():
    # As a binary float this literal would be 2**64 (out of range); read exactly it is 2**64 - 1.
    assert ok(b'{"job_id": "j", "prompt": "p", "seed": 1.8446744073709551615e19}').seed == 2**64 - 1


@pytest.mark.parametrize(("value", "message"), [(-1, "at least 0"), (2**64, "at most 18446744073709551615")])
def test_seed_out_of_range(value, message):
    (err,) = errors(req(seed=value))
    assert (err.field, err.constraint, err.value) == ("seed", "range(0..=18446744073709551615)", str(value))
    assert err.message == f"seed must be {message}"


def test_huge_integer_literal_is_a_range_error_quickly():
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "max_tokens": 1e999999999}')
    assert (err.field, err.constraint, err.value) == ("max_tokens", "range(1..=2048)", "1E+999999999")


@pytest.mark.parametrize("prompt", ["x", "x" * 32768, "é" * 32768, "😀" * 32768])
def test_prompt_length_in_range(prompt):
    assert ok(req(prompt=prompt)).prompt == prompt


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "at least 1 character (it has 0)"), ("x" * 32769, "at most 32768 characters (it has 32769)")],
)
def test_prompt_length_out_of_range(prompt, message):
    (err,) = errors(req(prompt=prompt))
    assert (err.field, err.constraint) == ("prompt", "length(1..=32768)")
    assert err.message == f"prompt must be {message}"


def test_prompt_length_counts_characters_not_bytes():
    assert pairs(req(prompt="é" * 32769)) == [("prompt", "length(1..=32768)")]


def test_job_id_empty():
    (err,) = errors(req(job_id=""))
    assert (err.field, err.constraint, err.message, err.value) == (
        "job_id",
        "non_empty",
        "job_id must not be empty",
        "",
    )


@pytest.mark.parametrize("count", [0, 1, 4])
def test_stop_count_in_range(count):
    stop = [f"s{i}" for i in range(count)]
    assert ok(req(stop=stop)).stop == tuple(stop)


def test_stop_five_strings():
    (err,) = errors(req(stop=["a", "b", "c", "d", "e"]))
    assert (err.field, err.constraint) == ("stop", "max_count(4)")
    assert err.message == "stop must have at most 4 entries (it has 5)"
    assert err.value == '["a","b","c","d","e"]'


def test_stop_empty_string_named_by_index():
    (err,) = errors(req(stop=["a", "b", ""]))
    assert (err.field, err.constraint, err.value) == ("stop[2]", "non_empty", "")


@pytest.mark.parametrize("stop", ["x" * 100, "é" * 50, "€" * 33 + "a", "😀" * 25])
def test_stop_at_100_utf8_bytes(stop):
    assert len(stop.encode()) == 100
    assert ok(req(stop=[stop])).stop == (stop,)


@pytest.mark.parametrize("stop", ["x" * 101, "é" * 50 + "a", "€" * 33 + "ab", "😀" * 25 + "a"])
def test_stop_at_101_utf8_bytes(stop):
    assert len(stop.encode()) == 101
    (err,) = errors(req(stop=["ok", stop]))
    assert (err.field, err.constraint) == ("stop[1]", "max_length(100)")
    assert err.message == "stop[1] must be at most 100 UTF-8 bytes (it has 101)"


def test_stop_length_counts_bytes_not_characters():
    assert pairs(req(stop=["é" * 51])) == [("stop[0]", "max_length(100)")]  # 51 characters, 102 bytes


# --- several errors at once, in table order ---------------------------------------------------------------------------


def test_every_field_wrong_in_table_order():
    # Keys in reverse table order: the order of errors follows the contract's table, not the body.
    body = {
        "stop": ["a", "", "b", "c", 7],
        "seed": -1,
        "repetition_penalty": 0,
        "min_p": 1.5,
        "top_k": -1,
        "top_p": -0.5,
        "temperature": 3,
        "max_tokens": 2049,
        "prompt": "",
        "job_id": "",
    }
    assert pairs(body) == [
        ("job_id", "non_empty"),
        ("prompt", "length(1..=32768)"),
        ("max_tokens", "range(1..=2048)"),
        ("temperature", "range(0.0..=2.0)"),
        ("top_p", "range(0.0..=1.0)"),
        ("top_k", "range(0..)"),
        ("min_p", "range(0.0..=1.0)"),
        ("repetition_penalty", "range(0.0..=2.0)"),
        ("seed", "range(0..=18446744073709551615)"),
        ("stop", "max_count(4)"),
        ("stop[1]", "non_empty"),
        ("stop[4]", "type"),
    ]


def test_mixed_required_type_and_range_errors():
    assert pairs({"max_tokens": "10", "top_p": 2, "stop": "x"}) == [
        ("job_id", "required"),
        ("prompt", "required"),
        ("max_tokens", "type"),
        ("top_p", "range(0.0..=1.0)"),
        ("stop", "type"),
    ]


# --- the body ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b"", b"{", b"not json", b'{"prompt": "a",}', b"{'prompt': 'a'}", b'{"prompt": "a"} x', b"[" * 100_000]
)
def test_malformed_json(body):
    (err,) = errors(body)
    assert (err.field, err.constraint, err.value) == ("body", "json", None)
    assert err.message.startswith("body is not valid JSON")
    assert err.to_json() == {"field": "body", "constraint": "json", "message": err.message}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ["temperature", "unknown_field"])
def test_nan_and_infinity_rejected(literal, where):
    body = f'{{"job_id": "j", "prompt": "p", "{where}": {literal}}}'.encode()
    (err,) = errors(body)
    assert (err.field, err.constraint) == ("body", "json")
    assert literal.lstrip("-") in err.message


def test_body_not_utf8():
    (err,) = errors(b'{"job_id": "j", "prompt": "caf\xe9"}')
    assert (err.field, err.constraint) == ("body", "json")
    assert "UTF-8" in err.message


def test_body_utf8_bom_tolerated():
    assert ok(b"\xef\xbb\xbf" + json.dumps(req()).encode()).prompt == "hello world"


@pytest.mark.parametrize(("body", "value"), [(b"[]", "[]"), (b'"text"', "text"), (b"1.50", "1.50"), (b"null", "null")])
def test_json_but_not_an_object(body, value):
    (err,) = errors(body)
    assert (err.field, err.constraint, err.message, err.value) == ("body", "type", "body must be a JSON object", value)


# --- types ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed"])
@pytest.mark.parametrize(("raw", "value"), [(b"true", "true"), (b"false", "false")])
def test_bool_is_not_an_int(field, raw, value):
    (err,) = errors(b'{"job_id": "j", "prompt": "p", "' + field.encode() + b'": ' + raw + b"}")
    assert (err.field, err.constraint, err.message, err.value) == (field, "type", f"{field} must be an integer", value)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_bool_and_string_are_not_floats(field):
    assert pairs(req(**{field: True})) == [(field, "type")]
    (err,) = errors(req(**{field: "0.5"}))
    assert (err.field, err.constraint, err.message, err.value) == (field, "type", f"{field} must be a number", "0.5")


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_int_accepted_for_float(field):
    value = getattr(ok(req(**{field: 1})), field)
    assert type(value) is float and value == 1.0


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed"])
def test_fractional_number_is_not_an_int(field):
    (err,) = errors(req(**{field: 2.5}))
    assert (err.field, err.constraint, err.value) == (field, "type", "2.5")


@pytest.mark.parametrize(("raw", "value"), [(b"2.0", 2), (b"2e3", 2000), (b"1.5e1", 15)])
def test_integral_number_is_an_int(raw, value):
    got = ok(b'{"job_id": "j", "prompt": "p", "max_tokens": ' + raw + b"}").max_tokens
    assert type(got) is int and got == value


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", "10", "must be an integer"),
        ("seed", [1], "must be an integer"),
        ("prompt", 5, "must be a string"),
        ("prompt", ["a"], "must be a string"),
        ("job_id", 12, "must be a string"),
        ("stop", "\n", "must be a list of strings"),
        ("stop", {"a": 1}, "must be a list of strings"),
    ],
)
def test_wrong_types(field, value, message):
    (err,) = errors(req(**{field: value}))
    assert (err.field, err.constraint, err.message) == (field, "type", f"{field} {message}")


@pytest.mark.parametrize(("element", "value"), [(1, "1"), (None, "null"), (["a"], '["a"]'), (True, "true")])
def test_stop_element_wrong_type(element, value):
    (err,) = errors(req(stop=["a", element]))
    assert (err.field, err.constraint, err.message, err.value) == ("stop[1]", "type", "stop[1] must be a string", value)


def test_unpaired_surrogate_rejected_and_error_is_encodable():
    (err,) = errors(b'{"job_id": "j", "prompt": "a\\ud800b"}')
    assert (err.field, err.constraint) == ("prompt", "type")
    assert err.value == "a\\ud800b"
    json.dumps(errors_body([err]), ensure_ascii=False).encode("utf-8")  # would raise on a raw surrogate


def test_surrogate_pair_escape_is_fine():
    assert ok(b'{"job_id": "j", "prompt": "\\ud83d\\ude00"}').prompt == "😀"


# --- required fields and job_id ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [{"job_id": "j"}, {"job_id": "j", "prompt": None}])
def test_prompt_required(body):
    (err,) = errors(body)
    assert (err.field, err.constraint, err.message, err.value) == ("prompt", "required", "prompt is required", None)


@pytest.mark.parametrize("body", [{"prompt": "p"}, {"prompt": "p", "job_id": None}])
def test_job_id_required_on_execute(body):
    assert pairs(body, require_job_id=True) == [("job_id", "required")]


@pytest.mark.parametrize("body", [{"prompt": "p"}, {"prompt": "p", "job_id": None}])
def test_job_id_optional_on_inference(body):
    assert ok(body, require_job_id=False).job_id is None


def test_job_id_given_on_inference_is_checked_and_kept():
    assert ok({"prompt": "p", "job_id": "mine"}, require_job_id=False).job_id == "mine"
    assert pairs({"prompt": "p", "job_id": ""}, require_job_id=False) == [("job_id", "non_empty")]


# --- the context rule -------------------------------------------------------------------------------------------------


def test_context_fits_exactly():
    assert ok(req(prompt="a b c", max_tokens=7), context_length=10).max_tokens == 7


def test_context_one_token_over():
    (err,) = errors(req(prompt="a b c", max_tokens=8), context_length=10)
    assert (err.field, err.constraint, err.value) == ("prompt", "context_length", "a b c")
    assert err.message == "prompt is 3 tokens and max_tokens is 8: 11 tokens do not fit the context of 10 tokens"


def test_context_uses_the_callers_tokenizer():
    assert ok(req(prompt="abc", max_tokens=7), context_length=10, count_tokens=len).max_tokens == 7
    assert pairs(req(prompt="abcd", max_tokens=7), context_length=10, count_tokens=len) == [
        ("prompt", "context_length")
    ]


def test_default_max_tokens_shrinks_to_the_room_left():
    assert ok(req(prompt="a b c"), context_length=1000).max_tokens == 997
    assert ok(req(prompt="a b c"), context_length=4).max_tokens == 1
    assert ok(req(prompt="a b c"), context_length=3000).max_tokens == 2048


def test_default_max_tokens_prompt_fills_the_context():
    (err,) = errors(req(prompt="a b c"), context_length=3)
    assert (err.field, err.constraint) == ("prompt", "context_length")
    assert err.message == (
        "prompt is 3 tokens and max_tokens is at least 1: 4 tokens do not fit the context of 3 tokens"
    )


def test_context_rule_with_invalid_max_tokens_checks_room_for_one_token():
    assert pairs(req(prompt="a b c", max_tokens=0), context_length=3) == [
        ("prompt", "context_length"),
        ("max_tokens", "range(1..=2048)"),
    ]
    assert pairs(req(prompt="a b c", max_tokens=9999), context_length=4) == [("max_tokens", "range(1..=2048)")]


def test_context_rule_skipped_for_a_prompt_that_failed_its_own_checks():
    def must_not_run(text: str) -> int:
        raise AssertionError("count_tokens called")

    assert pairs(req(prompt="x" * 32769), count_tokens=must_not_run, context_length=1) == [
        ("prompt", "length(1..=32768)")
    ]
    assert pairs(req(prompt=5), count_tokens=must_not_run, context_length=1) == [("prompt", "type")]


def test_count_tokens_called_once():
    calls = []
    ok(req(max_tokens=3), count_tokens=lambda s: calls.append(s) or 1)
    assert calls == ["hello world"]


# --- value rendering --------------------------------------------------------------------------------------------------


def test_long_value_is_cut():
    (err,) = errors(req(prompt="y" * 40000))
    assert err.value == "y" * 199 + "…"
    assert "40000" in err.message


def test_nested_value_rendered_as_json_and_cut():
    (err,) = errors(req(prompt={"a": [1, 2.5, "s", None, False]}))
    assert err.value == '{"a":[1,2.5,"s",null,false]}'
    (err,) = errors(b'{"job_id": "j", "prompt": ' + b"[" * 900 + b"]" * 900 + b"}")
    assert err.value == "[" * 199 + "…"
