"""Validation of the native job request (POST /execute, POST /v1/inference), CONTRACT.md §2.

`parse_job_request` turns a raw body into a typed `JobRequest` or into every `FieldError` at once, in the order of the
contract's table (and, within a field, in the order of its rules). It is pure: no FastAPI, no model; the caller passes
its tokenizer as `count_tokens` and its context size.

Points the contract leaves open, decided here (vLLM / TGI behave the same way unless noted):

- Numbers are read exactly (as `Decimal`), never rounded through a binary float first: int fields are checked on the
  exact value (a seed of 18446744073709551615 stays that), float fields on the float the engine will use (so 1e-400
  for repetition_penalty is 0.0, refused; 2.00000000000000000001 for temperature is 2.0, accepted), and the `value`
  echoed back is the number as written.
- Float fields accept JSON integers (1 -> 1.0). Int fields accept integers and numbers without a fractional part
  (2.0 and 2e3, as vLLM's pydantic models do; JSON itself does not tell 2 from 2.0); 2.5 is `type`.
- Booleans are not numbers: `true` for an int or float field is `type`.
- NaN / Infinity / -Infinity are not JSON (RFC 8259): the body gets `body`/`json`. A finite literal too large for a
  float (1e400) is an out-of-range number, not an infinity: it gets the field's range error.
- `null` is the same as leaving the field out, for every field (seed null -> random, stop null -> []); for a required
  field that means `required`.
- The body must be UTF-8 (a leading BOM is tolerated); otherwise `body`/`json`. JSON that is not an object is
  `body`/`type`. Duplicate keys: the last one wins.
- `stop` must be a list; a bare string is `type` (the OpenAI routes, not this API, accept one).
- `json_schema` (*new*, structured output) must be an object; whether it compiles is checked after the table's
  rules pass (api/native.py: constraint `valid_schema`), since compiling is work. Its numbers reach the schema as
  JSON numbers (integers stay integers).
- Strings with unpaired surrogate escapes ("\\ud800") cannot be encoded as UTF-8: `type`.
- Seed's constraint string (the table gives none) is `range(0..=18446744073709551615)`. top_k's range is open above
  (`range(0..)`); values beyond 2**63-1 are still refused with that constraint so the value stays a machine integer.
  repetition_penalty keeps the table's `range(0.0..=2.0)` but 0.0 itself is refused ("greater than 0.0").
- The context rule (`prompt`/`context_length`) runs only when the prompt passed its own checks. It needs
  prompt tokens + max_tokens <= context_length. When max_tokens is left out, its default is
  min(2048, context_length - prompt tokens), as in vLLM, so a request without max_tokens is never refused for the
  default alone; then, and when max_tokens is itself invalid, the rule only demands room for one generated token.
- `value` is the offending value as text: strings as they are, anything else as JSON text; cut to 200 characters
  (ending in "…") so a huge prompt is not echoed back; the message carries the real length. It is left out of the
  JSON (`to_json`) when there is no value: a missing field, a body that is not JSON.
"""

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

MAX_TOKENS_DEFAULT = 2048
VALUE_LIMIT = 200  # characters of `value` kept in an error


@dataclass(frozen=True)
class FieldError:
    field: str
    constraint: str
    message: str
    value: str | None

    def to_json(self) -> dict[str, str]:
        out = {"field": self.field, "constraint": self.constraint, "message": self.message}
        if self.value is not None:
            out["value"] = self.value
        return out


@dataclass(frozen=True)
class JobRequest:
    """A validated request, with defaults filled in (seed None: the engine picks one and reports it)."""

    job_id: str | None
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    json_schema: dict[str, Any] | None = None  # structured output (not compiled yet)


def invalid_schema(schema: dict[str, Any], reason: str) -> FieldError:
    """The error of a json_schema that does not compile (checked once every rule of the table passed)."""
    return FieldError("json_schema", "valid_schema", f"json_schema: {reason}", _render(schema))


def errors_body(errors: Sequence[FieldError]) -> dict[str, list[dict[str, str]]]:
    """The HTTP 400 body: `{"errors": [...]}`."""
    return {"errors": [e.to_json() for e in errors]}


# --- parsers: JSON value -> typed value, or _WrongType (constraint `type`) -------------------------------------------


class _WrongType(Exception):
    """The raw value has the wrong JSON type; the argument ends the message ("must be ...")."""


def _string(raw: object) -> str:
    if not isinstance(raw, str):
        raise _WrongType("must be a string")
    try:
        raw.encode("utf-8")  # "\ud800" parses but cannot reach the tokenizer (or a UTF-8 response)
    except UnicodeEncodeError:
        raise _WrongType("must be valid Unicode (it contains an unpaired surrogate escape)") from None
    return raw


# Any integer beyond this is out of every int field's range; clamping to it before int() keeps the range error
# while never building a huge int from a literal like 1e999999999.
_INT_CLAMP = 2**64


def _integer(raw: object) -> int:
    # bool is not a Decimal here (all JSON numbers are parsed as Decimal), so `true` fails like a string does.
    if not isinstance(raw, Decimal) or raw != raw.to_integral_value():
        raise _WrongType("must be an integer")
    return int(max(min(raw, _INT_CLAMP), -_INT_CLAMP))


def _number(raw: object) -> float:
    if not isinstance(raw, Decimal):
        raise _WrongType("must be a number")
    return float(raw) + 0.0  # 1e400 -> inf (then out of range); + 0.0 turns -0.0 into 0.0


def _object(raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _WrongType("must be a JSON object")
    return _plain(raw)


def _plain(value: Any) -> Any:
    """A parsed JSON value with its numbers (Decimal here) as Python's json module reads them: a literal with a
    fraction or an exponent as a float, any other as an int."""
    if isinstance(value, Decimal):
        return float(value) if not value.is_finite() or any(c in str(value) for c in ".eE") else int(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _string_list(raw: object) -> list[object]:
    # Only the list itself; elements are parsed one by one so each bad one is named (stop[2]).
    if not isinstance(raw, list):
        raise _WrongType("must be a list of strings")
    return raw


# --- checks: typed value -> None, or (constraint, message tail) ------------------------------------------------------


@dataclass(frozen=True)
class _Check:
    test: Callable[[Any], tuple[str, str] | None]
    schema: dict[str, Any]  # the rule in JSON Schema terms (as far as it can say it), for the OpenAPI document

    def __call__(self, value: Any) -> tuple[str, str] | None:
        return self.test(value)


def _range(lo: float, hi: float, constraint: str, *, lo_open: bool = False) -> _Check:
    def check(v: float) -> tuple[str, str] | None:
        if v < lo or (lo_open and v == lo):
            return constraint, f"must be {'greater than' if lo_open else 'at least'} {lo}"
        if v > hi:
            return constraint, f"must be at most {hi}"
        return None

    return _Check(check, {"exclusiveMinimum" if lo_open else "minimum": lo, "maximum": hi})


def _length(lo: int, hi: int) -> _Check:
    def check(v: str) -> tuple[str, str] | None:
        if not lo <= len(v) <= hi:
            limit = f"at least {lo} character" if len(v) < lo else f"at most {hi} characters"
            return f"length({lo}..={hi})", f"must be {limit} (it has {len(v)})"
        return None

    return _Check(check, {"minLength": lo, "maxLength": hi})


_non_empty = _Check(lambda v: ("non_empty", "must not be empty") if v == "" else None, {"minLength": 1})


def _max_utf8_bytes(hi: int) -> _Check:
    def check(v: str) -> tuple[str, str] | None:
        n = len(v.encode("utf-8"))
        return (f"max_length({hi})", f"must be at most {hi} UTF-8 bytes (it has {n})") if n > hi else None

    # JSON Schema counts characters: at most `hi` bytes implies at most `hi` characters, the rest is said in words.
    return _Check(check, {"maxLength": hi, "description": f"at most {hi} UTF-8 bytes"})


def _max_count(hi: int) -> _Check:
    def check(v: list[object]) -> tuple[str, str] | None:
        return (f"max_count({hi})", f"must have at most {hi} entries (it has {len(v)})") if len(v) > hi else None

    return _Check(check, {"maxItems": hi})


# --- the table: CONTRACT.md §2, in its order (which is the order errors are reported in) ----------------------------

_REQUIRED = object()  # default of a field that must be given


@dataclass(frozen=True)
class _Field:
    name: str
    parse: Callable[[object], Any]
    default: Any
    checks: tuple[_Check, ...] = ()
    # For list fields: how each element is parsed and checked; its errors name it as name[i].
    item_parse: Callable[[object], Any] | None = None
    item_checks: tuple[_Check, ...] = ()


_FIELDS: tuple[_Field, ...] = (
    _Field("job_id", _string, None, (_non_empty,)),  # required only when the caller says so (/execute)
    _Field("prompt", _string, _REQUIRED, (_length(1, 32768),)),  # then the context rule, see parse_job_request
    _Field("max_tokens", _integer, MAX_TOKENS_DEFAULT, (_range(1, 2048, "range(1..=2048)"),)),
    _Field("temperature", _number, 1.0, (_range(0.0, 2.0, "range(0.0..=2.0)"),)),
    _Field("top_p", _number, 1.0, (_range(0.0, 1.0, "range(0.0..=1.0)"),)),
    _Field("top_k", _integer, 0, (_range(0, 2**63 - 1, "range(0..)"),)),
    _Field("min_p", _number, 0.0, (_range(0.0, 1.0, "range(0.0..=1.0)"),)),
    _Field("repetition_penalty", _number, 1.0, (_range(0.0, 2.0, "range(0.0..=2.0)", lo_open=True),)),
    _Field("seed", _integer, None, (_range(0, 2**64 - 1, "range(0..=18446744073709551615)"),)),
    _Field("stop", _string_list, (), (_max_count(4),), _string, (_non_empty, _max_utf8_bytes(100))),
    _Field("json_schema", _object, None),  # then, once every rule passed, whether it compiles (api/native.py)
)


_JSON_TYPES = {_string: "string", _integer: "integer", _number: "number", _string_list: "array", _object: "object"}


def job_request_schema(*, require_job_id: bool) -> dict[str, Any]:
    """The JSON Schema of a job request, built from the table above; null is accepted wherever a field may be left
    out. Rules beyond JSON Schema (the context length, a unique job_id) are left to the descriptions."""

    def schema_of(parse: Callable[[object], Any], checks: tuple[_Check, ...]) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": _JSON_TYPES[parse]}
        for check in checks:
            schema |= check.schema
        return schema

    properties: dict[str, Any] = {}
    required = ["job_id", "prompt"] if require_job_id else ["prompt"]
    for f in _FIELDS:
        schema = schema_of(f.parse, f.checks)
        if f.item_parse is not None:
            schema["items"] = schema_of(f.item_parse, f.item_checks)
        if f.default is not _REQUIRED and f.default is not None:
            schema["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        if f.name not in required:
            schema["type"] = [schema["type"], "null"]
        properties[f.name] = schema
    properties["prompt"]["description"] = "prompt tokens + max_tokens must fit the model's context"
    properties["job_id"]["description"] = "unique among running jobs (409 otherwise)"
    properties["max_tokens"]["description"] = "left out: min(2048, context - prompt tokens)"
    properties["json_schema"]["description"] = "structured output: the text is JSON that follows this JSON Schema"
    return {"type": "object", "properties": properties, "required": required}


# --- rendering `value` ------------------------------------------------------------------------------------------------


def _json_pieces(v: object) -> Iterator[str]:
    # Lazy, so rendering stops after VALUE_LIMIT characters however large or deeply nested the value is.
    if isinstance(v, Decimal):
        yield str(v)  # the number as written (in normalized notation), not rounded through a float
    elif isinstance(v, list):
        yield "["
        for i, item in enumerate(v):
            yield "," if i else ""
            yield from _json_pieces(item)
        yield "]"
    elif isinstance(v, dict):
        yield "{"
        for i, (key, item) in enumerate(v.items()):
            yield ("," if i else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from _json_pieces(item)
        yield "}"
    else:
        yield json.dumps(v, ensure_ascii=False)


def _render(v: object) -> str:
    if isinstance(v, str):
        text = v  # strings without quotes, as the contract's example shows values
    else:
        text = ""
        for piece in _json_pieces(v):
            text += piece
            if len(text) > VALUE_LIMIT:
                break
    if len(text) > VALUE_LIMIT:
        text = text[: VALUE_LIMIT - 1] + "…"
    # An unpaired surrogate would make the error response itself unencodable: show it as \udXXX instead.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# --- parsing ----------------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON value")


def _exact_number(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:  # an exponent beyond what Decimal holds (1e99999999999999999999): use its float limit
        return Decimal(float(text))


def json_error_message(error: json.JSONDecodeError) -> str:
    """The message of a body that is not JSON, on every route: what is wrong and where (line and column)."""
    return f"body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"


def load_body(body: bytes) -> object:
    """The parsed JSON, numbers as Decimal; raises ValueError with a message for the user."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text, parse_float=_exact_number, parse_int=_exact_number, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(json_error_message(e)) from None
    except ValueError as e:  # from _reject_constant
        raise ValueError(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("body is not valid JSON: nested too deeply") from None


def parse_job_request(
    body: bytes, *, require_job_id: bool, count_tokens: Callable[[str], int], context_length: int
) -> JobRequest | list[FieldError]:
    """Validate a native job request body; a JobRequest, or every error in table order (never an empty list).

    `require_job_id`: True on /execute, False on /v1/inference. `count_tokens(prompt)` is called at most once, only
    for a prompt that passed its own checks.
    """
    try:
        data = load_body(body)
    except ValueError as e:
        return [FieldError("body", "json", str(e), None)]
    if not isinstance(data, dict):
        return [FieldError("body", "type", "body must be a JSON object", _render(data))]

    values: dict[str, Any] = {}
    errors: dict[str, list[FieldError]] = {f.name: [] for f in _FIELDS}
    for f in _FIELDS:
        raw = data.get(f.name)  # null counts as absent; unknown keys are never looked at
        out = errors[f.name]
        if raw is None:
            if f.default is _REQUIRED or (f.name == "job_id" and require_job_id):
                out.append(FieldError(f.name, "required", f"{f.name} is required", None))
            else:
                values[f.name] = f.default
            continue
        try:
            value = f.parse(raw)
        except _WrongType as e:
            out.append(FieldError(f.name, "type", f"{f.name} {e}", _render(raw)))
            continue
        for check in f.checks:
            if failed := check(value):
                out.append(FieldError(f.name, failed[0], f"{f.name} {failed[1]}", _render(raw)))
        if f.item_parse is not None:
            items = []
            for i, raw_item in enumerate(value):
                name = f"{f.name}[{i}]"
                try:
                    item = f.item_parse(raw_item)
                except _WrongType as e:
                    out.append(FieldError(name, "type", f"{name} {e}", _render(raw_item)))
                    continue
                for check in f.item_checks:
                    if failed := check(item):
                        out.append(FieldError(name, failed[0], f"{name} {failed[1]}", _render(raw_item)))
                items.append(item)
            value = tuple(items)
        if not out:
            values[f.name] = value

    if "prompt" in values:  # the context rule: only for a prompt that passed its own checks
        prompt_tokens = count_tokens(values["prompt"])
        given = data.get("max_tokens") is not None
        if given and "max_tokens" in values:
            max_tokens, least = values["max_tokens"], ""
        else:  # left out (the default adapts, below) or itself invalid: the prompt must leave room for one token
            max_tokens, least = 1, "at least "
        if prompt_tokens + max_tokens > context_length:
            message = (
                f"prompt is {prompt_tokens} tokens and max_tokens is {least}{max_tokens}: "
                f"{prompt_tokens + max_tokens} tokens do not fit the context of {context_length} tokens"
            )
            errors["prompt"].append(FieldError("prompt", "context_length", message, _render(values["prompt"])))
        elif not given:
            values["max_tokens"] = min(MAX_TOKENS_DEFAULT, context_length - prompt_tokens)

    flat = [e for f in _FIELDS for e in errors[f.name]]
    if flat:
        return flat
    return JobRequest(**values)
