"""Structured output under speculation: equal to constrained plain `generate`, token for token, and exact when
sampling; prefix_allowed_tokens_fn and xgrammar's own processor keep working; bad constraints refused up front."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")
import xgrammar as xgr  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec import Grammar, GrammarError
from hf_specdec.structured.constraints import RowConstraints
from hf_specdec.decode.speculator import Speculator
from hf_specdec.types import DraftProposal

from conftest import VOCAB, make_model  # noqa: E402

EOS = 2
# Pieces a JSON value, a regex and a small grammar can be spelled with, several of them multi-character, so the
# grammar sometimes allows exactly one token and sometimes several.
PIECES = ["{", "}", "[", "]", '"', ":", ",", " ", '{"', '":', '": "', '", "', '"}', ', "', "true", "false", "null",
          *"0123456789", *"abcdefghijklmnopqrstuvwxyz", "name", "age", "city", "tags", "-", ".", "\n", "ab", "er",
          "on", "an", "in", "th", "es", "or", "at", "en", "ing", "ed", "re", "it", "is", "to", "he", "ou", "nd",
          "ha", "ar", "te", "se", "ne", "ti", "me", "_", "de", "co", "al", "ro", "ve"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"]}


def piece_tokenizer(pieces=PIECES, size=VOCAB):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    assert len(vocab) == size, len(vocab)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return piece_tokenizer()


def constrained_model(arch="llama", seed=0):
    model = make_model(arch, seed=seed)
    model.generation_config.eos_token_id = EOS
    return model


def prompts(rows=3, width=10, seed=0):
    """A ragged left-padded batch whose rows repeat a phrase (so n-gram lookup proposes)."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(4, VOCAB, (rows, 4), generator=g)
    input_ids = phrase.repeat(1, width // 4 + 1)[:, :width]
    mask = torch.ones_like(input_ids)
    for i in range(rows):
        mask[i, : (3 * i) % (width - 2)] = 0
    return input_ids.masked_fill(mask == 0, 0), mask


def reference(model, tokenizer, grammars, input_ids, mask, max_new_tokens):
    """Plain `generate` with xgrammar's own transformers processor: the output we must equal."""
    compiled = [g.compile(tokenizer, VOCAB, [EOS]) for g in grammars]
    processor = xgr.contrib.hf.LogitsProcessor(compiled if len(compiled) > 1 else compiled[0])
    return model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          logits_processor=LogitsProcessorList([processor]), pad_token_id=0)


def speculators(name, arch):
    if name == "same_draft":
        return constrained_model(arch)
    if name == "random_draft":
        return constrained_model(arch, seed=3)
    return name


GRAMMARS = {
    "json_schema": Grammar.json_schema(SCHEMA),
    "json": Grammar.json(),
    "regex": Grammar.regex(r"(ab|[a-z]{2,5})(-[0-9]{1,3}){1,3}\.(true|false)"),
    "ebnf": Grammar.ebnf('root ::= "{" pair ("," pair)* "}"\npair ::= "\\"" [a-z]+ "\\":" ("null" | [0-9]+)'),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("speculator", ["grammar", "ngram", "same_draft", "random_draft"])
def test_greedy_equals_constrained_generate(tokenizer, kind, speculator):
    model = constrained_model()
    input_ids, mask = prompts()
    expected = reference(model, tokenizer, [GRAMMARS[kind]], input_ids, mask, 40)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                         speculator=speculators(speculator, "llama"), grammar=GRAMMARS[kind], tokenizer=tokenizer,
                         speculative_schedule="constant", num_speculative_tokens=4)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "mistral"])
@pytest.mark.parametrize("speculator", ["grammar", "ngram", "random_draft"])
def test_greedy_equality_other_architectures_adaptive(tokenizer, arch, speculator):
    model = constrained_model(arch)
    input_ids, mask = prompts(rows=4, width=12, seed=1)
    expected = reference(model, tokenizer, [GRAMMARS["json_schema"]], input_ids, mask, 48)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0,
                         speculator=speculators(speculator, arch), grammar=GRAMMARS["json_schema"],
                         tokenizer=tokenizer)
    assert torch.equal(out, expected)


def test_a_grammar_per_row_and_early_completion(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts(rows=4)
    # Row 1 completes within a few tokens (then EOS ends it, as in plain constrained decoding); row 3 is free.
    grammars = [GRAMMARS["json_schema"], Grammar.regex("[a-c]{2}"), GRAMMARS["ebnf"], None]
    compiled_rows = [g for g in grammars if g is not None]
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                              logits_processor=[_PerRowReference(tokenizer, grammars)])
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         speculator="ngram", grammar=grammars, tokenizer=tokenizer, num_speculative_tokens=4)
    assert torch.equal(out, expected)
    assert (out[1, input_ids.shape[1]:] == EOS).any(), "the short regex row should have completed"
    assert len(compiled_rows) == 3


class _PerRowReference:
    """xgrammar's processor for the constrained rows, nothing for the others (the per-row reference)."""

    def __init__(self, tokenizer, grammars):
        self.rows = [i for i, g in enumerate(grammars) if g is not None]
        self.inner = xgr.contrib.hf.LogitsProcessor([grammars[i].compile(tokenizer, VOCAB, [EOS]) for i in self.rows])

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[self.rows] = self.inner(input_ids[self.rows], scores[self.rows])
        return scores


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_inside_a_string(tokenizer, max_new_tokens):
    model = constrained_model()
    input_ids, mask = prompts()
    expected = reference(model, tokenizer, [GRAMMARS["json_schema"]], input_ids, mask, max_new_tokens)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, speculator="grammar", grammar=GRAMMARS["json_schema"], tokenizer=tokenizer)
    assert torch.equal(out, expected)


def test_forced_tokens_are_drafted_and_accepted(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts(rows=2)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         speculator="grammar", grammar=Grammar.json_schema(SCHEMA), tokenizer=tokenizer,
                         return_dict_in_generate=True)
    metrics = out.speculative_metrics
    assert metrics.num_grammar_tokens > 0
    assert metrics.num_steps < metrics.num_emitted_tokens  # fewer target forwards than tokens
    assert metrics.num_draft_tokens == 0  # the grammar speculator drafts nothing of its own


def test_xgrammar_processor_is_run_as_a_constraint(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts()
    compiled = GRAMMARS["json_schema"].compile(tokenizer, VOCAB, [EOS])
    expected = reference(model, tokenizer, [GRAMMARS["json_schema"]], input_ids, mask, 30)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         speculator="ngram", logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    assert torch.equal(out, expected)


def test_plain_generate_takes_grammar_too(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts()
    expected = reference(model, tokenizer, [GRAMMARS["regex"]], input_ids, mask, 20)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                         grammar=GRAMMARS["regex"], tokenizer=tokenizer)
    assert torch.equal(out, expected)


def allowed_by_row_and_prefix(batch_id, prefix):
    """A constraint that depends on the row and on its prefix, and sometimes allows a single token."""
    last = int(prefix[-1])
    if len(prefix) % 4 == 0:
        return [4 + (last * 7 + batch_id) % (VOCAB - 4)]
    return [t for t in range(4, VOCAB) if (t + last + batch_id) % 3 == 0]


@pytest.mark.parametrize("speculator", ["grammar", "ngram", "random_draft"])
def test_prefix_allowed_tokens_fn_equals_generate(speculator):
    model = constrained_model()
    model.generation_config.eos_token_id = None
    input_ids, mask = prompts()
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                              prefix_allowed_tokens_fn=allowed_by_row_and_prefix)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                         prefix_allowed_tokens_fn=allowed_by_row_and_prefix,
                         speculator=speculators(speculator, "llama"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_grammar_tokens > 0


class _CountingProcessor:
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


class _AssertingProcessor:
    def __call__(self, input_ids, scores):
        assert input_ids.shape[1] < 0, "expects one new token per call"
        return scores


def test_stateful_processors_are_refused_with_their_name():
    model = constrained_model()
    input_ids, mask = prompts()
    with pytest.raises(ValueError, match="_CountingProcessor.*keeps state"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=8, speculator="ngram",
                       logits_processor=[_CountingProcessor()], pad_token_id=0)
    with pytest.raises(RuntimeError, match="(?s)_AssertingProcessor.*grammar="):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=8, speculator="ngram",
                       logits_processor=[_AssertingProcessor()], pad_token_id=0)


def test_a_used_xgrammar_processor_is_refused(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts()
    processor = xgr.contrib.hf.LogitsProcessor(GRAMMARS["json"].compile(tokenizer, VOCAB, [EOS]))
    model.generate(input_ids, attention_mask=mask, max_new_tokens=3, logits_processor=[processor], pad_token_id=0)
    with pytest.raises(ValueError, match="make a new one per call"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=3, speculator="ngram",
                       logits_processor=[processor], pad_token_id=0)


@pytest.mark.parametrize("grammar, message", [
    (lambda: Grammar.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "JSON schema"),
    (lambda: Grammar.regex("(unclosed"), "regex"),
    (lambda: Grammar.ebnf("root ::= undefined_rule"), "EBNF"),
])
def test_invalid_constraints_are_refused_before_generation(tokenizer, monkeypatch, grammar, message):
    model = constrained_model()
    input_ids, mask = prompts()

    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran before the grammar was checked")

    monkeypatch.setattr(model, "forward", no_forward)
    with pytest.raises(GrammarError, match=f"invalid {message}"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=8, speculator="ngram", grammar=grammar(),
                       tokenizer=tokenizer, pad_token_id=0)


# (schema, an instance the schema forbids): xgrammar compiles each without enforcing the keyword named, so a
# grammar built from it accepts the instance; `Grammar.json_schema` refuses them, naming the keyword.
DROPPED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "not": ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}, '{"a": "x"}'),
    "if": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "multipleOf": ({"type": "integer", "multipleOf": 5, "minimum": 0}, "3"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"a": 1}'),
    "pattern": ({"type": "string", "format": "email", "pattern": "^a"}, '"b@c.de"'),
    "maxLength": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    "minimum": ({"$defs": {"A": {"type": "integer"}}, "type": "object",
                 "properties": {"x": {"$ref": "#/$defs/A", "minimum": 5}}, "required": ["x"]}, '{"x": 1}'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3"),
    "dependencies": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "$ref": ({"$defs": {"A": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, '"x"'),  # an anchor: not followed
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["x"]}, '{"a": 1}'),
    "pattern (lookahead)": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, '"xa"'),  # taken for any string
}


@pytest.mark.parametrize("keyword", list(DROPPED))
def test_schema_constraints_the_grammar_would_drop_are_refused(keyword):
    from xgrammar.testing import _is_grammar_accept_string

    schema, forbidden = DROPPED[keyword]
    keyword = keyword.split()[0]
    # why: compiled as it is, the grammar lets through an answer the schema forbids
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(schema, any_whitespace=False), forbidden)
    with pytest.raises(GrammarError, match=re.escape(f"'{keyword}' at #")):
        Grammar.json_schema(schema)
    with pytest.raises(GrammarError, match=re.escape(keyword)):  # through response_format
        Grammar.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


# (schema, an instance it forbids, one it allows): xgrammar enforces only the `enum`/`const` of a node and drops
# the constraints beside it (beside a `$ref`, the other way round); the enum is narrowed to the values meeting them.
BESIDE_ENUM = {
    "type": ({"type": "string", "enum": ["a", 1]}, "1", '"a"'),
    "maxLength": ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, '"bb"', '"a"'),
    "maximum": ({"type": "integer", "enum": [1, 5, 10], "maximum": 4}, "5", "1"),
    "pattern": ({"type": "object", "properties": {"x": {"enum": ["a", "b"], "pattern": "^a$"}}, "required": ["x"]},
                '{"x": "b"}', '{"x": "a"}'),
    "maxItems": ({"enum": [[1, 2, 3], [1]], "maxItems": 1}, "[1,2,3]", "[1]"),  # an enum's values written compact
    "required": ({"type": "array", "items": {"enum": [{"a": 1}, {"b": 2}], "required": ["a"]}}, '[{"b":2}]',
                 '[{"a":1}]'),
    # beside a `$ref` it is the enum that xgrammar drops: any string would do
    "$ref": ({"$defs": {"S": {"type": "string"}}, "type": "object",
              "properties": {"x": {"enum": ["a", 2], "$ref": "#/$defs/S"}}, "required": ["x"]}, '{"x": "zz"}',
             '{"x": "a"}'),
    "format": ({"enum": ["x@y.z", "nope"], "format": "email"}, '"nope"', '"x@y.z"'),
    # checked against the whole schema: a `$ref` to the root, the root's draft (04: a boolean exclusiveMinimum), a
    # `$ref` into its properties
    "$ref to the root": ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"},
                                                                    "enum": [[], [[]], [{}]]}}},
                         '{"kids": [[]]}', '{"kids": [{}]}'),
    "draft-04": ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
                  "properties": {"n": {"enum": [5, 6], "minimum": 5, "exclusiveMinimum": True}}, "required": ["n"]},
                 '{"n": 5}', '{"n": 6}'),
    "$ref into properties": ({"type": "object", "properties": {"a": {"type": "string"},
                                                               "b": {"$ref": "#/properties/a", "enum": ["x", 1]}}},
                             '{"b": "zz"}', '{"b": "x"}'),
    # every value meets the `$ref`, which xgrammar would enforce instead of the enum
    "$ref, every value allowed": ({"$defs": {"S": {"type": "string"}}, "type": "object",
                                   "properties": {"x": {"enum": ["a", "b"], "$ref": "#/$defs/S"}}, "required": ["x"]},
                                  '{"x": "zz"}', '{"x": "b"}'),
}


@pytest.mark.parametrize("keyword", list(BESIDE_ENUM))
def test_constraints_beside_an_enum_narrow_it(keyword):
    from xgrammar.testing import _is_grammar_accept_string

    schema, forbidden, allowed = BESIDE_ENUM[keyword]
    # why: compiled as it is, the grammar lets the forbidden value through
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(schema, any_whitespace=False), forbidden)
    grammar = xgr.Grammar.from_json_schema(Grammar.json_schema(schema).source, any_whitespace=False)
    assert not _is_grammar_accept_string(grammar, forbidden)
    assert _is_grammar_accept_string(grammar, allowed)


def test_an_enum_nothing_can_meet_is_refused_and_plain_enums_are_kept():
    import jsonschema

    for schema, keyword in [({"const": "abc", "type": "integer"}, "const"), ({"const": 5, "minimum": 6}, "const"),
                            ({"type": "object", "properties": {"x": {"enum": [1, 2], "type": "string"}}}, "enum"),
                            ({"const": 1, "enum": [2, 3]}, "const"), ({"const": [True], "enum": [[1]]}, "const")]:
        with pytest.raises(GrammarError, match=re.escape(f"'{keyword}' at #") + ".*no answer could match"):
            Grammar.json_schema(schema)
    for schema in ({"enum": [1, 2], "allOf": [{"type": "integer"}]}, {"enum": [[1, 2]], "uniqueItems": True}):
        assert json.loads(Grammar.json_schema(schema).source) == {"enum": schema["enum"]}  # checked: taken
    # a format xgrammar knows but this jsonschema cannot check (hostname needs an optional package), at any depth
    uncheckable = [f for f in ("hostname", "uri", "duration") if f not in jsonschema.FormatChecker.checkers]
    for fmt in uncheckable[:1]:
        with pytest.raises(GrammarError, match=f"format '{fmt}'"):
            Grammar.json_schema({"enum": [{"h": "a"}, {"h": "b c"}], "properties": {"h": {"format": fmt}}})
    for schema in ({"type": "string", "enum": ["a", "b"], "title": "T"}, {"type": "string", "const": "cat"},
                   {"enum": ["a", "b"], "format": "my-own"}):  # nothing beside them forbids a value: as written
        assert json.loads(Grammar.json_schema(schema).source) == schema


def test_schemas_users_write_are_taken_and_enforced():
    """Pydantic models with nested models, Optional, Literal, Enum, lists, dicts, recursion, bounds, formats and a
    discriminated union, and hand-written schemas with $defs/$ref, anyOf, patterns and bounds: each is taken, and a
    grammar built from it refuses an instance that breaks it."""
    import datetime
    import enum
    import uuid
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field
    from xgrammar.testing import _is_grammar_accept_string

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Address(BaseModel):
        city: str
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=1, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Node(BaseModel):
        value: int
        children: list["Node"] = []

    class Person(BaseModel):
        name: str = Field(min_length=1, max_length=8)
        nickname: Optional[str] = None
        color: Color
        address: Address
        tags: list[str] = Field(min_length=1, max_length=2)
        counts: dict[str, int]
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        tree: Node
        born: datetime.datetime
        id: uuid.UUID

    good = ('{"name": "Ada", "nickname": null, "color": "red", "address": {"city": "X", "zip": "12345"}, '
            '"tags": ["a"], "counts": {"a": 1}, "pet": {"kind": "cat", "lives": 3}, "tree": {"value": 1, '
            '"children": [{"value": 2, "children": []}]}, "born": "2020-01-02T03:04:05Z", '
            '"id": "123e4567-e89b-12d3-a456-426614174000"}')
    grammar = xgr.Grammar.from_json_schema(Grammar.json_schema(Person).source, any_whitespace=False)
    assert _is_grammar_accept_string(grammar, good)
    for old, new in [('"Ada"', '"Adalbertus"'), ('"red"', '"green"'), ('"12345"', '"1234"'), ('["a"]', "[]"),
                     ('"lives": 3', '"lives": 10'), ('"cat"', '"cow"'), ('"2020-01-02T', '"yesterday'),
                     ('"123e4567-', '"xyz-')]:
        assert not _is_grammar_accept_string(grammar, good.replace(old, new, 1)), new
    hand_written = [
        ({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                          "additionalProperties": False}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
          "required": ["p"], "additionalProperties": False}, '{"p": {"x": 1, "y": 2}}'),
        ({"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
          "required": ["v"]}, '{"v": "a"}'),
        ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, '"AB-12"'),
        ({"type": "integer", "minimum": 10, "maximum": 12}, "13"),
        ({"type": "integer", "multipleOf": 5}, "3"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1]"),
        ({"type": "string", "minLength": 3, "maxLength": 5}, '"abcdef"'),
        ({"type": "string", "format": "email"}, '"nope"'),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
        ({"type": "string", "format": "iri", "pattern": "^a+$"}, '"b"'),  # a format it takes for any string
        ({"type": "string", "pattern": r"^[(?!]\(?!x$"}, '"!(x"'),  # no lookahead: a class, an escaped parenthesis
        ({"definitions": {"A": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/definitions/A"}},
         '["x"]'),
    ]
    for schema, forbidden in hand_written:
        grammar = xgr.Grammar.from_json_schema(Grammar.json_schema(schema).source, any_whitespace=False)
        assert not _is_grammar_accept_string(grammar, forbidden), schema


def test_misuse_is_refused(tokenizer):
    model = constrained_model()
    input_ids, mask = prompts()
    with pytest.raises(ValueError, match="needs tokenizer="):
        model.generate(input_ids, attention_mask=mask, speculator="ngram", grammar=Grammar.json(), pad_token_id=0)
    with pytest.raises(ValueError, match="speculator='grammar' drafts only"):
        model.generate(input_ids, attention_mask=mask, speculator="grammar", pad_token_id=0)
    with pytest.raises(ValueError, match="one per row"):
        model.generate(input_ids, attention_mask=mask, speculator="ngram", grammar=[Grammar.json()] * 2,
                       tokenizer=tokenizer, pad_token_id=0)
    with pytest.raises(ValueError, match="one constraint per call"):
        model.generate(input_ids, attention_mask=mask, speculator="ngram", grammar=Grammar.json(),
                       tokenizer=tokenizer, prefix_allowed_tokens_fn=allowed_by_row_and_prefix, pad_token_id=0)
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{not json")



def test_a_grammar_without_an_eos_is_refused(tokenizer):
    """Without an EOS, plain constrained generate goes on past the grammar's end and xgrammar's processor decides
    what follows, which speculation does not reproduce: refused (the pipeline too), naming eos_token_id=."""
    from tokenizers import pre_tokenizers
    from transformers import pipeline

    model = constrained_model()
    model.generation_config.eos_token_id = None
    input_ids, mask = prompts()
    grammar = Grammar.regex("[a-c]{2}")
    run = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="grammar= with speculator= needs an eos_token_id.*eos_token_id="):
        model.generate(input_ids, speculator="ngram", grammar=grammar, tokenizer=tokenizer, **run)
    processor = xgr.contrib.hf.LogitsProcessor(grammar.compile(tokenizer, VOCAB, [EOS]))
    with pytest.raises(ValueError, match="xgrammar's LogitsProcessor with speculator= needs an eos_token_id"):
        model.generate(input_ids, speculator="ngram", logits_processor=[processor], **run)
    expected = model.generate(input_ids, grammar=grammar, tokenizer=tokenizer, eos_token_id=EOS, **run)
    assert torch.equal(model.generate(input_ids, speculator="ngram", grammar=grammar, tokenizer=tokenizer,
                                      eos_token_id=EOS, **run), expected)
    piece = piece_tokenizer()
    piece.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    piece.padding_side = "left"
    pipe = pipeline("speculative-text-generation", model=model, tokenizer=piece, assistant="ngram")
    for batch in (dict(), dict(batch_size=2)):  # one prompt, and the continuous batches
        with pytest.raises(ValueError, match="needs an eos_token_id"):
            pipe(["name age", "a b c", "true"], grammar=grammar, max_new_tokens=8, do_sample=False, **batch)
    # The serving engine: its answer would run on to max_tokens past the grammar's end (the tokenizer's EOS, which
    # xgrammar allows there, means nothing to the model): refused with 400 on response_format
    from hf_specdec.serving.engine import ServingEngine
    from hf_specdec.serving.stream import RequestError

    engine = ServingEngine(model, tokenizer, "ngram", warmup=False)
    with pytest.raises(RequestError, match="no end-of-sequence token.*generation_config.eos_token_id") as refused:
        engine.submit(input_ids[0].tolist(), max_tokens=8, grammar=grammar)
    assert refused.value.param == "response_format"

def test_draft_trees_with_a_constraint_are_refused(tokenizer):
    class TreeSpeculator(Speculator):
        supports_trees = True

    model = constrained_model()
    input_ids, mask = prompts()
    constraints = RowConstraints(3, VOCAB, [GRAMMARS["json"].compile(tokenizer, VOCAB, [EOS])] * 3)
    engine = hf_specdec.SpeculativeEngine(model, TreeSpeculator(), 4, schedule="constant", tree_nodes=4)
    with pytest.raises(ValueError, match="draft trees"):
        engine.generate(input_ids, mask, 8, False, constraints=constraints)


def test_no_matcher_or_block_is_left_after_a_call(tokenizer, monkeypatch):
    from hf_specdec.structured import constraints as constraints_module
    from hf_specdec.runners import model_runner

    runners, tables = [], []
    original_runner, original_constraints = model_runner.ModelRunner.__init__, RowConstraints.__init__

    def spy_runner(self, *args, **kwargs):
        original_runner(self, *args, **kwargs)
        runners.append(self)

    def spy_constraints(self, *args, **kwargs):
        original_constraints(self, *args, **kwargs)
        tables.append(self)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy_runner)
    monkeypatch.setattr(constraints_module.RowConstraints, "__init__", spy_constraints)
    model = constrained_model()
    input_ids, mask = prompts(rows=4)
    model.generate(input_ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0, speculator=constrained_model(
        seed=3), grammar=[GRAMMARS["json_schema"], Grammar.regex("[a-c]{2}"), GRAMMARS["regex"], None],
        tokenizer=tokenizer)
    # The target's and the draft's runners, plus the up-front trial forward's (runners/support.py), which frees its own.
    assert len(runners) >= 2 and len(tables) == 1
    for runner in runners:
        manager = runner.cache.manager
        assert manager.sequences() == []
        assert manager.num_free_blocks == manager.num_blocks - manager.num_reserved - manager.num_region_blocks
    assert all(state is None for state in tables[0].states)


def test_response_format():
    # JSON mode is an object (OpenAI's promise: clients index the answer by key), not any JSON value
    assert Grammar.from_response_format({"type": "json_object"}) == Grammar.json_schema({"type": "object"})
    assert Grammar.from_response_format({"type": "text"}) is None
    spec = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    assert Grammar.from_response_format(spec) == Grammar.json_schema(SCHEMA)
    with pytest.raises(ValueError, match="json_schema"):
        Grammar.from_response_format({"type": "json_schema"})
    full = {"name": "person", "description": "a person", "schema": SCHEMA, "strict": False}
    assert Grammar.from_response_format({"type": "json_schema", "json_schema": full}) == Grammar.json_schema(SCHEMA)
    for field, value, message in (("strict", "yes", "strict must be a boolean"), ("name", 3, "name must be a string"),
                                  ("schemas", {}, "json_schema.schemas is not a json_schema field")):
        with pytest.raises(ValueError, match=message):
            Grammar.from_response_format({"type": "json_schema", "json_schema": {**full, field: value}})


def test_json_mode_answers_are_objects(tokenizer):
    """OpenAI's JSON mode (`response_format` json_object) promises an object: sampled answers start with "{" and
    those that finish parse to a dict (any JSON value would let a random model answer `1`, `"a"` or `[]`)."""
    import json

    model = constrained_model()
    input_ids, mask = prompts(rows=8, seed=2)
    torch.manual_seed(0)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=True, pad_token_id=0,
                         speculator="ngram", grammar=Grammar.from_response_format({"type": "json_object"}),
                         tokenizer=tokenizer)
    for row in out[:, input_ids.shape[1]:].tolist():
        ended = EOS in row
        text = "".join(tokenizer.convert_ids_to_tokens(row[:row.index(EOS)] if ended else row))
        assert text.lstrip().startswith("{"), text
        if ended:
            assert isinstance(json.loads(text), dict), text


# --- sampling: the exact constrained distribution -------------------------------------------------------------

SMALL = 8  # <pad> <s> </s> <unk> a b c d
SAMPLES = 6000


def small_model(seed=5):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=SMALL, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=EOS, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


class FixedDistributionSpeculator(Speculator):
    """Samples every draft from one fixed distribution: much of its mass on tokens the grammar forbids at the first
    position, so the cut-and-resample path carries weight."""

    def __init__(self, draft_probs):
        self.draft_probs = draft_probs

    def propose(self, batch, k):
        rows = len(batch.active)
        if k == 0 or not batch.do_sample:
            return DraftProposal.empty(rows, batch.device)
        probs = self.draft_probs.expand(rows, k, -1).contiguous()
        tokens = torch.multinomial(probs.view(-1, SMALL), 1).view(rows, k)
        return DraftProposal(tokens, torch.full((rows,), k), probs)


def exact_pairs(model, prompt, first_allowed, second_allowed):
    """`{(t1, t2): probability}` of the first two tokens under the target constrained to the allowed sets."""
    def masked_probs(ids, allowed):
        logits = model(ids).logits[:, -1].double()
        keep = torch.zeros(SMALL, dtype=torch.bool)
        keep[allowed] = True
        return torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)

    with torch.no_grad():
        first = masked_probs(prompt, first_allowed)[0]
        out = {}
        for t1 in first_allowed:
            second = masked_probs(torch.cat([prompt, torch.tensor([[t1]])], dim=1), second_allowed)[0]
            for t2 in second_allowed:
                out[(t1, t2)] = float(first[t1] * second[t2])
    return out


@pytest.mark.parametrize("speculator", ["fixed", "draft_model", "grammar", "ngram"])
def test_sampling_follows_the_constrained_distribution(speculator):
    tokenizer = piece_tokenizer(["a", "b", "c", "d"], size=SMALL)
    a, b, c, d = 4, 5, 6, 7
    model = small_model()
    prompt = torch.tensor([[1, a, b, d, a, b]])
    # First token in {a, b}, then "c" is forced, then any of a-d, then the grammar completes (EOS).
    grammar = Grammar.regex("[ab]c[abcd]")
    draft_probs = torch.zeros(SMALL, dtype=torch.float64)
    draft_probs[[d, a, c, 3]] = torch.tensor([0.45, 0.3, 0.15, 0.1], dtype=torch.float64)
    spec = {"fixed": FixedDistributionSpeculator(draft_probs), "draft_model": small_model(seed=9)}.get(speculator,
                                                                                                   speculator)
    torch.manual_seed(0)
    out = model.generate(prompt.expand(SAMPLES, -1), attention_mask=torch.ones(SAMPLES, prompt.shape[1],
                         dtype=torch.long), do_sample=True, max_new_tokens=5, pad_token_id=0, speculator=spec,
                         grammar=grammar, tokenizer=tokenizer, speculative_schedule="constant",
                         num_speculative_tokens=3)
    generated = out[:, prompt.shape[1]:]
    assert (generated[:, 1] == c).all() and (generated[:, 3] == EOS).all()
    exact = {(t1, t3): p for (t1, t3), p in exact_pairs_through_c(model, prompt, [a, b], [a, b, c, d]).items()}
    counts: dict = {}
    for t1, t3 in zip(generated[:, 0].tolist(), generated[:, 2].tolist()):
        counts[(t1, t3)] = counts.get((t1, t3), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(key, 0) / SAMPLES - p) for key, p in exact.items())
    # 8 outcomes, 6000 samples: sampling noise puts TV near 0.01-0.02; the bound is several times that, and far
    # below what a wrong recovered distribution gives (resampling from the target after a cut: ~0.1 here).
    assert tv < 0.04, tv


def exact_pairs_through_c(model, prompt, first_allowed, third_allowed):
    c = 6
    with torch.no_grad():
        pairs = exact_pairs(model, prompt, first_allowed, [c])
        out = {}
        for (t1, _), p1 in pairs.items():
            ids = torch.cat([prompt, torch.tensor([[t1, c]])], dim=1)
            logits = model(ids).logits[0, -1].double()
            keep = torch.zeros(SMALL, dtype=torch.bool)
            keep[third_allowed] = True
            third = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
            for t3 in third_allowed:
                out[(t1, t3)] = p1 * float(third[t3])
    return out


def test_without_xgrammar_the_error_says_what_to_install(tokenizer, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar" or name.startswith("xgrammar."):
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    model = constrained_model()
    input_ids, mask = prompts()
    with pytest.raises(hf_specdec.StructuredOutputUnavailableError, match=r"pip install .*structured"):
        model.generate(input_ids, attention_mask=mask, speculator="ngram", grammar=Grammar.json(),
                       tokenizer=piece_tokenizer(), pad_token_id=0)


def test_pipeline_takes_grammar_and_response_format():
    from tokenizers import pre_tokenizers
    from transformers import pipeline

    tokenizer = piece_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.padding_side = "left"
    model = constrained_model()
    texts = ["name age city", "tags ab er on an in th", "a b c"]
    stock = pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = []
    for text in texts:
        compiled = GRAMMARS["json_schema"].compile(tokenizer, VOCAB, [EOS])
        expected.append(stock(text, max_new_tokens=24, do_sample=False, return_full_text=False,
                              logits_processor=LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)]))
                        [0]["generated_text"])
    ours = pipeline("speculative-text-generation", model=model, tokenizer=tokenizer, assistant="ngram")
    by_grammar = ours(texts, max_new_tokens=24, do_sample=False, return_full_text=False,
                      grammar=GRAMMARS["json_schema"], batch_size=3)
    by_format = ours(texts, max_new_tokens=24, do_sample=False, return_full_text=False, batch_size=2,
                     response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert all(expected)
    assert [r[0]["generated_text"] for r in by_grammar] == expected
    assert [r[0]["generated_text"] for r in by_format] == expected
    with pytest.raises(TypeError, match="one hf_specdec.Grammar"):
        ours(texts, grammar=[GRAMMARS["json"]] * 3)


def test_cli_generate_with_a_json_schema(tmp_path, capsys):
    import json

    from hf_specdec.cli import main

    tokenizer = piece_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = constrained_model()
    model.to(torch.float32).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    args = ["generate", "--model", str(tmp_path / "model"), "--max-new-tokens", "12", "name"]
    assert main([*args[:-1], "--speculator", "grammar", "--json-schema", str(tmp_path / "schema.json"), "name"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{") and "tokens/s" in captured.err
    with pytest.raises(SystemExit, match="invalid regex"):
        main([*args[:-1], "--regex", "(unclosed", "name"])
    with pytest.raises(SystemExit, match="give one of"):
        main([*args[:-1], "--regex", "a", "--json", "name"])
    with pytest.raises(SystemExit, match="--speculator grammar drafts"):
        main([*args[:-1], "--speculator", "grammar", "name"])


def test_bench_json_workload_is_constrained_and_identical():
    """The json workload runs each row under its own schema: plain generate (xgrammar's processor) is the baseline,
    every hf_specdec configuration equals it, and speculator='grammar' runs beside the chosen speculators."""
    from hf_specdec.tools.bench import run_bench
    from hf_specdec.extraction import PROMPTS

    from tokenizers import pre_tokenizers

    model = constrained_model()
    model.to(torch.float32)
    tokenizer = piece_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    seen = []  # the results so far after each batch size (the CLI saves them: a stopped run keeps them)
    results = run_bench(model, tokenizer, {"ngram": "ngram"}, batch_sizes=(1, 3), workloads=("json",),
                        max_new_tokens=10, repeats=1, progress=False, on_group=lambda so_far: seen.append(len(so_far)))
    assert seen == [len(results) // 2, len(results)]
    configs = {r.config for r in results}
    assert configs == {"plain generate", "hf_specdec off", "hf_specdec ngram", "hf_specdec grammar"}
    assert all(r.identical for r in results)
    assert len(PROMPTS) >= 8


def test_a_grammar_the_vocabulary_cannot_spell_is_a_clear_error():
    from conftest import make_tokenizer

    model = constrained_model()
    input_ids, mask = prompts()
    with pytest.raises(ValueError, match="cannot spell"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=8, speculator="ngram", pad_token_id=0,
                       grammar=Grammar.json(), tokenizer=make_tokenizer())  # words w4..w95: no "{" to start with


@pytest.mark.parametrize("speculator", ["ngram", "grammar"])
def test_a_grammar_dead_end_past_the_start_is_a_clear_error(tokenizer, speculator):
    """The start is spelled ('{"a": "'), then the constant's character is not in the vocabulary."""
    model = constrained_model()
    input_ids, mask = prompts()
    stuck = Grammar.json_schema({"type": "object", "properties": {"a": {"const": "\u2603"}}, "required": ["a"]})
    with pytest.raises(ValueError, match="cannot spell"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=16, speculator=speculator, pad_token_id=0,
                       grammar=stuck, tokenizer=tokenizer)


def test_demo_json_mode():
    pytest.importorskip("gradio")
    import json

    from hf_specdec.demo import app as demo_app
    from hf_specdec.demo.stream import NGRAM_LABEL
    from hf_specdec.demo.session import DemoInputError, DemoSession

    tokenizer = piece_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    session = DemoSession(constrained_model().to(torch.float32), tokenizer, {NGRAM_LABEL: "ngram"})
    settings = session.check_settings(NGRAM_LABEL, 4, 40, json_mode=True, json_schema=json.dumps(SCHEMA))
    *_, last = session.compare("name age", settings)
    assert last.plain.text == last.speculative.text and last.speculative.text.startswith("{")
    with pytest.raises(DemoInputError, match="JSON schema cannot be used"):
        session.check_settings(NGRAM_LABEL, 4, 40, json_mode=True, json_schema='{"type": "no-such-type"}')
    handlers = {f.name: f.fn for f in demo_app.build_app(session).fns.values()}
    *_, shown = list(handlers["compare"]("name age", NGRAM_LABEL, 4, 40, False, 0.8, 0.95, 0, "adaptive", True,
                                         json.dumps(SCHEMA)))[-1]
    assert shown["visible"] and shown["value"].startswith("{")
    assert demo_app.json_view('{"a": [1, 2]}', True) == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert "incomplete" in demo_app.json_view('{"a": ', True)
