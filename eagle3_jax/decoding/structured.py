"""Structured outputs: what a constrained row must produce (`Structured`), as the regex its automaton is compiled
from (automaton.py), and the compiled automata cached by their text (`Compiler`).

Every kind becomes one regex over the whole output:
  * regex: as given (outlines-core's dialect: Rust's regex syntax without lookarounds or backreferences);
  * choice: the alternatives, escaped;
  * json_schema: outlines-core's `build_regex_from_schema` with no optional whitespace (compact JSON: greedy
    decoding cannot run away in newlines), after `check_schema` refused every keyword whose constraint it would
    drop (numeric bounds, uniqueItems, oneOf, ...);
  * json_object: a JSON object of bounded depth (`JSON_OBJECT_DEPTH` levels of objects and arrays inside it).
Objects are generated with the schema's properties in its order and no others (a schema that allows more is
narrowed: every output still validates); a property not in `required` may be left out.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading

from eagle3_jax.checkpoints.generation import generation_eos
from eagle3_jax.checkpoints.tokenizer import load_tokenizer, token_bytes
from eagle3_jax.decoding.automaton import Automaton, Limits, Vocabulary, compile_regex

JSON_OBJECT_DEPTH = 1  # json_object: levels of objects and arrays inside the top-level object (2: 4.6 s to compile)
_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = f"({_STRING}|{_NUMBER}|true|false|null)"
# Keywords that only describe, and keywords whose constraint the regex keeps (or narrows: fewer outputs, all valid).
_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "examples", "default", "deprecated", "readOnly",
                "writeOnly"}
_KEPT = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
         "minLength", "maxLength", "pattern", "format", "enum", "const", "anyOf", "allOf", "$ref", "$defs",
         "definitions"}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a row's output must be: exactly one of a regex (matched against the whole output), a choice among
    strings, a JSON schema (a dict), or json_object=True (any JSON object). Checked here (ValueError); compiled for a
    target's vocabulary when a request takes it."""

    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    json_schema: dict | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [name for name in ("regex", "choice", "json_schema") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if self.json_object not in (True, False):
            raise ValueError(f"Structured's json_object must be True or False, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError("Structured takes exactly one of regex=, choice=, json_schema= or json_object=True, got "
                             + (", ".join(given) or "none"))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"Structured's regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"Structured's choice must be a non-empty list of strings, got {self.choice!r}")
            bad = [c for c in self.choice if not isinstance(c, str) or not c]
            if bad:
                raise ValueError(f"Structured's choices must be non-empty strings, got {bad[0]!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                raise ValueError(f"Structured's json_schema must be a dict (a JSON schema), got "
                                 f"{type(self.json_schema).__name__}")
            check_syntax(self.json_schema)
            check_schema(self.json_schema)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Structured) and self.key == other.key

    @property
    def key(self) -> str:
        """The constraint as text: what compiled automata are cached by."""
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(list(self.choice))
        if self.json_schema is not None:
            return "json_schema:" + json.dumps(self.json_schema, sort_keys=True)
        return "json_object"

    def to_regex(self) -> str:
        """The regex the whole output must match (module docstring)."""
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(" + "|".join(_escape(c) for c in dict.fromkeys(self.choice)) + ")"
        if self.json_object:
            return json_object_regex(JSON_OBJECT_DEPTH)
        try:
            from outlines_core.json_schema import build_regex_from_schema
        except ImportError:
            raise ImportError("structured outputs need outlines-core: pip install 'eagle3-jax[structured]'") from None
        try:
            return build_regex_from_schema(json.dumps(self.json_schema), whitespace_pattern="")
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"the JSON schema is not supported: {e}") from None


def _escape(text: str) -> str:
    """A literal for outlines-core's (Rust's) regex syntax: every character that is not alphanumeric escaped, as
    both Python's and Rust's parsers take it."""
    return "".join(c if c.isalnum() or c == " " else re.escape(c) for c in text)


def json_object_regex(depth: int) -> str:
    """A compact JSON object whose values nest objects and arrays `depth` levels deep at most."""
    def value(d):
        return _SCALAR if d == 0 else f"({_SCALAR}|{array(d)}|{obj(d)})"

    def array(d):
        return rf"\[({value(d - 1)}(,{value(d - 1)})*)?\]"

    def obj(d):
        member = f"{_STRING}:{value(d - 1)}"
        return rf"\{{({member}(,{member})*)?\}}"

    return obj(depth + 1)


def check_syntax(schema: dict) -> None:
    """ValueError where `schema` is not a JSON schema by its draft's metaschema (2020-12 unless its `$schema` names
    another): a keyword's value of the wrong type (`"minItems": "x"`, `"allOf": 5`) is refused before any keyword is
    read, rather than dropped from the regex."""
    try:
        import jsonschema
    except ImportError:
        raise ImportError("JSON schemas need jsonschema: pip install 'eagle3-jax[structured]'") from None
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise ValueError(f"the schema{where} is not valid JSON schema: {e.message}") from None


def check_schema(schema, where: str = "the schema") -> None:
    """ValueError naming the first keyword of `schema` (or a subschema) whose constraint the compiled regex would not
    keep: refused rather than approximated."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {schema!r}")
    for keyword, value in schema.items():
        if keyword in _ANNOTATIONS:
            continue
        if keyword not in _KEPT and not (keyword == "uniqueItems" and value is False):
            raise ValueError(f"{where} uses {keyword!r}, which structured outputs do not enforce: refused")
        if keyword == "allOf" and len(value) != 1:
            raise ValueError(f"{where} uses allOf with {len(value)} schemas, which structured outputs do not merge: "
                             "refused")
        if keyword in _SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {keyword} must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{keyword}.{name}")
        elif keyword in _SUBSCHEMA_LISTS:
            if not isinstance(value, list):
                raise ValueError(f"{where}: {keyword} must be a list")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{keyword}[{i}]")
        elif keyword in _SUBSCHEMAS:
            check_schema(value, f"{where}.{keyword}")


class Compiler:
    """Compiled automata for one vocabulary, cached by the constraint's text (least recently used past `size`), so a
    server compiles each schema once. Thread-safe: the server's handlers compile, the pool reads."""

    def __init__(self, vocabulary: Vocabulary, limits: Limits = Limits(), size: int = 64):
        self.vocabulary, self.limits, self.size = vocabulary, limits, size
        self._cache: collections.OrderedDict[str, Automaton] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compilations run (cache misses)

    def __call__(self, structured: Structured) -> Automaton:
        key = structured.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        automaton = compile_regex(structured.to_regex(), self.vocabulary, self.limits)
        if automaton.complete[automaton.initial] or not (automaton.next[automaton.initial] >= 0).any():
            raise ValueError(f"the constraint {key[:200]!r} allows no output")
        with self._lock:
            self.compiled += 1
            self._cache[key] = automaton
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return automaton


def target_vocabulary(folder, vocab_size: int) -> Vocabulary:
    """The vocabulary structured outputs compile for: the target folder's tokenizer's tokens as bytes, and the end
    ids of its generation_config.json (else the tokenizer's eos_token); ValueError for a folder without a
    tokenizer."""
    tokenizer = None if folder is None else load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"structured outputs need the target's tokenizer, and {folder} has none (tokenizer.json)")
    eos = generation_eos(folder) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    return Vocabulary(tuple(token_bytes(tokenizer)), tuple(eos), vocab_size)
