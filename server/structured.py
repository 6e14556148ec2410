"""What a request asks its reply to match, in each peer's dialect, as the engine's Constraint:
OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` (json, regex,
choice, grammar; and its older guided_* fields), llama-server's `json_schema` and `grammar`. Each
is compiled here, on the HTTP side, so a bad one is a 400 naming the field before any token."""

from __future__ import annotations

import json
from typing import Any

from pagechat.core.errors import PagechatError
from pagechat.core.grammar import grammar_of
from pagechat.core.params import Constraint
from pagechat.server.errors import bad_param
from pagechat.server.schema import SamplingFields

_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint_of(req: SamplingFields) -> Constraint | None:
    """The one constraint a request sets, checked; None when it sets none."""
    found = [
        (param, c)
        for param, c in (
            ("response_format", _response_format(getattr(req, "response_format", None))),
            *_structured(_extra(req, "structured_outputs")),
            *_guided(req),
            ("json_schema", _llama_schema(_extra(req, "json_schema"))),
            ("grammar", _text(_extra(req, "grammar"), "grammar", "grammar")),
        )
        if c is not None
    ]
    if len(found) > 1:
        names = " and ".join(param for param, _ in found)
        raise bad_param(found[1][0], f"a request takes one constraint; it sets {names}")
    if not found:
        return None
    param, constraint = found[0]
    try:
        grammar_of(constraint)
    except PagechatError as e:
        raise bad_param(param, str(e)) from None
    return constraint


def _extra(req: SamplingFields, name: str) -> Any:
    return (req.model_extra or {}).get(name)


def _response_format(value: dict | None) -> Constraint | None:
    """OpenAI's response_format: text (none), json_object, json_schema {name, schema, strict}."""
    if not value:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    if kind != "json_schema":
        raise bad_param(
            "response_format.type",
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_param(
            "response_format.json_schema",
            "response_format.json_schema must be an object with the schema under 'schema'",
        )
    return Constraint("json_schema", json.dumps(spec["schema"]))


def _structured(value: Any) -> list[tuple[str, Constraint | None]]:
    """vLLM's structured_outputs: {json | regex | choice | grammar | json_object}."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_param("structured_outputs", "structured_outputs must be an object")
    found = [
        (f"structured_outputs.{k}", _field(f"structured_outputs.{k}", k, value[k]))
        for k in _VLLM
        if k in value
    ]
    if value.get("json_object"):
        found.append(("structured_outputs.json_object", Constraint("json")))
    return found


def _guided(req: SamplingFields) -> list[tuple[str, Constraint | None]]:
    """vLLM's fields before structured_outputs: guided_json, guided_regex, ..."""
    return [(f"guided_{k}", _field(f"guided_{k}", k, _extra(req, f"guided_{k}"))) for k in _VLLM]


def _field(param: str, kind: str, value: Any) -> Constraint | None:
    """One vLLM-style field: a schema (object or JSON text), a regex, a choice list, a grammar."""
    if value is None:
        return None
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad_param(param, f"{param} is not JSON: {e}") from None
        return _llama_schema(value, param)
    if kind == "choice":
        if not isinstance(value, list):
            raise bad_param(param, f"{param} must be a list of strings")
        return Constraint("choice", json.dumps(value))
    return _text(value, param, _VLLM[kind])


def _llama_schema(value: Any, param: str = "json_schema") -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_param(param, f"{param} must be a JSON schema (an object)")
    return Constraint("json_schema", json.dumps(value))


def _text(value: Any, param: str, kind: str) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_param(param, f"{param} must be a string")
    return Constraint(kind, value)
