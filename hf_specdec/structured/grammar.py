"""Structured output: a JSON schema, a regex or a grammar constrains what a row may generate, exactly.

`Grammar` says what a user wants (`Grammar.json_schema(schema)`, `.regex(pattern)`, `.ebnf(text)`, `.json()`);
xgrammar (the `structured` extra) compiles it against the target's tokenizer into a matcher that accepts tokens,
fills a bitmask of the tokens allowed next, and rolls back. How the engine keeps speculation exact under it lives in
`constraints.py`.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass

from .schema import narrow_enums, unenforced

_INSTALL = 'structured output needs xgrammar: pip install "hf_specdec[structured]" (or pip install xgrammar)'


class StructuredOutputUnavailableError(ImportError):
    """xgrammar is not installed."""


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; the message is the library's."""


def xgrammar():
    """The xgrammar module, or `StructuredOutputUnavailableError` saying how to install it."""
    try:
        import xgrammar as xgr
    except ImportError as error:
        raise StructuredOutputUnavailableError(_INSTALL) from error
    return xgr


@dataclass(frozen=True)
class Grammar:
    """What a row's output must match.

    Build one with `Grammar.json_schema(schema)`, `Grammar.regex(pattern)`, `Grammar.ebnf(text)` (xgrammar's EBNF
    dialect, the GBNF of llama.cpp with a `root` rule) or `Grammar.json()` (any JSON value), or wrap a grammar that
    xgrammar already compiled (`Grammar.compiled(compiled_grammar)`). Pass it to `generate(..., grammar=...)` (with
    `tokenizer=`), or a list with one grammar (or `None`) per row.
    """

    kind: str
    source: str | None = None
    precompiled: object = None

    any_whitespace: bool = False

    @classmethod
    def json_schema(cls, schema, any_whitespace: bool = False) -> Grammar:
        """A JSON value that follows `schema` (a dict, a JSON string, or a pydantic model class).

        By default the JSON is laid out as `json.dumps` writes it (`{"key": value, "other": [1, 2]}`): its text
        between values is then fixed, so the grammar drafts it itself, and a small model cannot wander into endless
        whitespace. `any_whitespace=True` allows any JSON whitespace between tokens instead.

        Raises `GrammarError` for a schema with a constraint xgrammar would not enforce (`uniqueItems`, `not`,
        `if`/`then`, `contains`, a `pattern` beside a `format`, ...: `schema.unenforced`), naming it. An
        `enum` or `const` with constraints beside it (which xgrammar drops) is narrowed to the values meeting them
        (`schema.narrow_enums`), and refused where none does."""
        if hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as error:
                raise GrammarError(f"the JSON schema is not valid JSON: {error}") from error
        elif isinstance(schema, dict):
            parsed, schema = schema, json.dumps(schema)
        else:
            raise TypeError(f"Grammar.json_schema takes a dict, a JSON string or a pydantic model, "
                            f"got {type(schema).__name__}")
        narrowed, found = narrow_enums(parsed)
        if found:
            raise GrammarError(f"the JSON schema cannot be enforced as written: {found}")
        if narrowed is not parsed:  # an enum narrowed to the values the constraints beside it allow
            parsed, schema = narrowed, json.dumps(narrowed)
        found = unenforced(parsed)
        if found:  # compiled as it is, the grammar would let answers break the schema, with nothing said
            raise GrammarError(f"the JSON schema uses {found}; xgrammar, which builds the grammar, cannot enforce "
                               "it, so answers could break the schema: drop it or rewrite the schema without it")
        return cls("json_schema", schema, any_whitespace=any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches the regular expression `pattern` whole."""
        if not isinstance(pattern, str):
            raise TypeError(f"Grammar.regex takes a str, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str) -> Grammar:
        """Text that the EBNF grammar `text` derives from its `root` rule."""
        if not isinstance(text, str):
            raise TypeError(f"Grammar.ebnf takes a str, got {type(text).__name__}")
        return cls("ebnf", text)

    @classmethod
    def choice(cls, options) -> Grammar:
        """Exactly one of the strings `options` (vLLM's `guided_choice`)."""
        if not isinstance(options, (list, tuple)) or not options or not all(
                isinstance(o, str) and o for o in options):
            raise GrammarError(f"a choice takes a non-empty list of non-empty strings, got {options!r}")
        return cls("ebnf", "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))

    @classmethod
    def json(cls) -> Grammar:
        """Any JSON value (JSON mode)."""
        return cls("json")

    @classmethod
    def compiled(cls, compiled_grammar) -> Grammar:
        """A grammar xgrammar has already compiled (an `xgrammar.CompiledGrammar`) for the target's tokenizer."""
        return cls("compiled", precompiled=compiled_grammar)

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> Grammar | None:
        """The grammar an OpenAI-style `response_format` asks for: `{"type": "json_object"}` (a JSON object, any
        keys), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`, or `{"type": "text"}`
        (`None`)."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict) or "type" not in response_format:
            raise ValueError(f"response_format must be a dict with a 'type', got {response_format!r}")
        kind = response_format["type"]
        if kind == "text":
            return None
        if kind == "json_object":  # OpenAI's JSON mode promises an object, not any JSON value
            return cls.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                 '"schema": {...}}')
            unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
            if unknown:
                raise ValueError(f"json_schema.{unknown[0]} is not a json_schema field; give name, description, "
                                 "schema and strict")
            for field, kind in (("name", str), ("description", str), ("strict", bool)):
                if spec.get(field) is not None and not isinstance(spec[field], kind):
                    raise ValueError(f"json_schema.{field} must be a {'string' if kind is str else 'boolean'}, got "
                                     f"{spec[field]!r}")
            # (`strict: false` is served as strictly: the answer always follows the schema)
            return cls.json_schema(spec["schema"])
        raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                         "'json_schema'")

    def compile(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None):
        """Compiles against `tokenizer` (logits of `vocab_size` entries); raises `GrammarError` with the library's
        message if the schema, regex or grammar is invalid. Compilers are cached per tokenizer."""
        if self.kind == "compiled":
            return self.precompiled
        if tokenizer is None:
            raise ValueError("grammar= needs tokenizer= (the target's tokenizer) to compile the grammar against its "
                             "vocabulary")
        compiler = _compiler(tokenizer, vocab_size, stop_token_ids)
        try:
            if self.kind == "json_schema":
                return compiler.compile_json_schema(self.source, any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return compiler.compile_regex(self.source)
            if self.kind == "ebnf":
                return compiler.compile_grammar(self.source)
            return compiler.compile_builtin_json_grammar()
        except Exception as error:  # xgrammar raises RuntimeError and its own exception types
            what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}.get(self.kind, "grammar")
            raise GrammarError(f"invalid {what}: {_library_message(error)}") from error


def _library_message(error: Exception) -> str:
    """xgrammar's message without the time and C++ source line it starts with ("[11:10:19] /project/cpp/x.cc:83: ")."""
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(error).strip())


_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()  # a server compiles in worker threads: one tokenizer's info is built once


def _compiler(tokenizer, vocab_size: int, stop_token_ids):
    xgr = xgrammar()
    key = (vocab_size, tuple(stop_token_ids) if stop_token_ids else None)
    with _COMPILERS_LOCK:
        per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
            per_tokenizer[key] = xgr.GrammarCompiler(info)
        return per_tokenizer[key]


def compile_grammars(grammar, num_rows: int, tokenizer, vocab_size: int, stop_token_ids=None) -> list | None:
    """One compiled grammar (or `None`) per row from what `generate(grammar=...)` got: a `Grammar`, or a list with a
    `Grammar` or `None` per row. Returns `None` when no row is constrained."""
    if grammar is None:
        return None
    grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * num_rows
    if len(grammars) != num_rows:
        raise ValueError(f"grammar= got a list of {len(grammars)} grammars for a batch of {num_rows} rows; give one "
                         "per row (None for an unconstrained row)")
    for g in grammars:
        if g is not None and not isinstance(g, Grammar):
            raise TypeError(f"grammar= takes hf_specdec.Grammar objects (Grammar.json_schema(...), .regex(...), "
                            f".ebnf(...), .json()), got {type(g).__name__}")
    if all(g is None for g in grammars):
        return None
    compiled: dict[tuple, object] = {}  # one compilation per distinct grammar
    out = []
    for g in grammars:
        key = None if g is None else (g.kind, g.source, g.any_whitespace, id(g.precompiled))
        if g is not None and key not in compiled:
            compiled[key] = g.compile(tokenizer, vocab_size, stop_token_ids)
        out.append(None if g is None else compiled[key])
    return out
