"""Random JSON schemas for structured-output tests and benchmarks, each with a bound on its output.

:func:`random_schema` draws from a ``random.Random`` (hypothesis drives one through
``st.randoms()``; the benchmark seeds its own): an object of up to four properties whose
values are bounded integers, booleans, nulls, enums, strings with a ``maxLength`` or a
``pattern``, arrays with ``maxItems``, and nested objects (two levels at most), with
``additionalProperties: false`` and some properties required. Every construct is bounded, so
:func:`max_output_bytes` can bound the document the grammar allows (compact separators, as
``guided_decoder.JSON_OPTIONS`` compiles them). A token is at least one byte, so that many
tokens (plus the end token) always suffice: an output cut by ``max_tokens`` would be the
test's fault, not the grammar's. Unbounded constructs (``number`` with its free fraction
digits, unbounded strings) are left out for that reason.
"""

from __future__ import annotations

import json
import random

NAMES = ["id", "name", "age", "city", "tags", "active", "score", "kind", "items", "note", "year", "code"]
WORDS = ["red", "green", "blue", "alpha", "beta", "yes", "no", "north", "south"]
MAX_DEPTH = 2
ESCAPED_CHAR_BYTES = 6  # the longest one character of a JSON string takes: "\u00e9"


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema (the top level of a structured output is an object)."""
    names = rng.sample(NAMES, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "boolean", "null", "enum", "string", "pattern", "array"]
    if depth < MAX_DEPTH:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 10_000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4)) + ([rng.randint(0, 9)] if rng.random() < 0.3 else [])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{2,4}-[0-9]{2}$"])}
    if kind == "array":
        item = _value_schema(rng, MAX_DEPTH)  # flat items: arrays of scalars
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth)


#: The longest text each fixed pattern above matches.
_PATTERN_BYTES = {"^[a-z]{1,8}$": 8, "^[A-Z][a-z]{0,6}$": 7, "^[0-9]{2,4}-[0-9]{2}$": 7}


def max_output_bytes(schema: dict) -> int:
    """An upper bound on the bytes of any compact document that validates against ``schema``
    (one drawn by :func:`random_schema`)."""
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        members = [len(json.dumps(name)) + 2 + max_output_bytes(value) for name, value in schema["properties"].items()]
        return 2 + sum(members) + 2 * len(members)  # braces; ", " between members
    if kind == "array":
        return 2 + schema["maxItems"] * (max_output_bytes(schema["items"]) + 2)
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        if "pattern" in schema:
            return 2 + _PATTERN_BYTES[schema["pattern"]]
        return 2 + ESCAPED_CHAR_BYTES * schema["maxLength"]
    return {"boolean": 5, "null": 4}[kind]


def schema_prompt(schema: dict) -> list[dict[str, str]]:
    """Chat messages asking for a document of ``schema``."""
    return [{"role": "user", "content": f"Write one JSON object that follows this JSON schema:\n{json.dumps(schema)}"}]
