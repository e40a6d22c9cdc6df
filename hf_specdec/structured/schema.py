"""Which parts of a JSON schema the grammar library enforces.

xgrammar compiles some JSON-schema keywords without enforcing them: `uniqueItems`, `not`, `if`/`then`/`else`,
`dependentRequired`, ... are dropped, `contains` even forbids every non-empty array, a `$ref` it cannot follow (an
anchor, another document) allows any value, and so does a `pattern` with a lookahead. A schema using them would give
answers that break it, with nothing said. `unenforced` finds such a keyword so that `Grammar.json_schema` refuses the
schema up front, naming it and where it is. Keywords that only describe (`title`, `description`, `default`,
`examples`, an unknown `format`) are fine: they never constrain.

An `enum` or `const` makes xgrammar drop every other constraint of its node (`{"type": "string", "enum": ["a", 1]}`
lets `1` through). `narrow_enums` keeps only the listed values that meet those constraints (checked with the
`jsonschema` validator), so the node's answers are exactly the schema's.
"""

from __future__ import annotations

import functools

# Dropped by xgrammar whatever their value (checked against xgrammar 0.2: a grammar built with each accepts an
# instance the keyword forbids).
_DROPPED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
            "dependentSchemas", "dependencies")
# Keywords that only describe a value, and the ones that hold subschemas elsewhere: allowed beside `$ref`/`allOf`.
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id", "$defs", "definitions", "discriminator"}
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# String formats xgrammar spells as a pattern of its own: then `pattern` or a length beside them is dropped. (Others,
# `iri` or `idn-email` say, it takes for any string, as the standard allows: a `pattern` beside them holds.)
_FORMATS = {"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference", "uri-template",
            "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def unenforced(schema, path: str = "#") -> str | None:
    """The first constraint in `schema` (a JSON schema as a dict) that xgrammar would not enforce, said as
    `"'keyword' at #/json/pointer (why)"`, or `None` when every constraint is enforced."""
    if not isinstance(schema, dict):
        return None
    problem = _own(schema)
    if problem is not None:
        keyword, why = problem
        return f"{keyword!r} at {path} ({why})"
    for _, _, sub, sub_path in _children(schema, path):
        found = unenforced(sub, sub_path)
        if found:
            return found
    return None


def _children(schema: dict, path: str):
    """`(container, key, subschema, its path)` for each subschema held directly by `schema` (`container` is the
    keyword, `key` the name or index within it, or None where the keyword holds one schema)."""
    for name in _SCHEMA_MAPS:
        if isinstance(schema.get(name), dict):
            for key, sub in schema[name].items():
                yield name, key, sub, f"{path}/{name}/{_escape(key)}"
    for name in _SCHEMA_LISTS + ("items",):
        if isinstance(schema.get(name), list):
            for i, sub in enumerate(schema[name]):
                yield name, i, sub, f"{path}/{name}/{i}"
    for name in _SCHEMAS:
        if isinstance(schema.get(name), dict):
            yield name, None, schema[name], f"{path}/{name}"


def _own(schema: dict) -> tuple[str, str] | None:
    """`(keyword, why)` for a constraint of this schema node itself (not its subschemas) that would be dropped."""
    for keyword in _DROPPED:
        if keyword in schema:
            return keyword, "not enforced"
    if schema.get("uniqueItems") is True and not (isinstance(schema.get("maxItems"), int) and schema["maxItems"] <= 1):
        return "uniqueItems", "not enforced"
    if "multipleOf" in schema:
        if schema.get("type") != "integer":
            return "multipleOf", "enforced on integers only"
        if any(k in schema for k in _RANGE):
            return "multipleOf", "not enforced beside a minimum or maximum"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        return "$ref", f"only references into the schema itself ('#/$defs/...') are followed, not {ref!r}"
    constraints = sorted(set(schema) - _ANNOTATIONS - {"$ref", "allOf"})
    if "$ref" in schema and constraints:
        return constraints[0], "not enforced beside '$ref'; move it into the referenced schema"
    if isinstance(schema.get("allOf"), list):
        if len(schema["allOf"]) > 1:
            return "allOf", "only one subschema is enforced; merge them into one"
        if constraints:
            return constraints[0], "not enforced beside 'allOf'; move it into the subschema"
    if isinstance(schema.get("pattern"), str) and _lookahead(schema["pattern"]):
        return "pattern", "a lookahead, (?=...) or (?!...), is not enforced"
    has_format = isinstance(schema.get("format"), str) and schema["format"] in _FORMATS
    if "pattern" in schema and has_format:
        return "pattern", f"not enforced beside format {schema['format']!r}"
    if "pattern" in schema or has_format:
        for keyword in ("minLength", "maxLength"):
            if keyword in schema:
                return keyword, "not enforced beside " + ("'pattern'" if "pattern" in schema else
                                                          f"format {schema['format']!r}") + "; put it in the pattern"
    required, listed = schema.get("required"), schema.get("properties")
    missing = [name for name in required if not isinstance(listed, dict) or name not in listed] \
        if isinstance(required, list) else []
    if missing:
        return "required", f"{missing[0]!r} is not in 'properties': only properties listed there are made required"
    extra = schema.get("additionalProperties")
    if schema.get("unevaluatedProperties", True) not in (True, {}) and extra is not None and extra is not False:
        return "unevaluatedProperties", "not enforced beside 'additionalProperties'"
    if isinstance(schema.get("oneOf"), list) and "discriminator" not in schema and not _disjoint(schema["oneOf"]):
        return "oneOf", ("enforced as 'anyOf': an answer could match several branches; use 'anyOf', or branches "
                         "of different types")
    return None


def narrow_enums(schema, root=None, path: str = "#") -> tuple[object, str | None]:
    """`(schema, problem)`: `schema` with each `enum`/`const` that has constraints beside it narrowed to the values
    meeting them (a new dict where anything changed, `schema` itself otherwise; the constraints beside it dropped
    there, since xgrammar drops them anyway), and `problem` (said as `unenforced` says it) where no value meets them
    or they cannot be checked."""
    if not isinstance(schema, dict):
        return schema, None
    root = schema if root is None else root
    if "enum" in schema or "const" in schema:
        return _narrow(schema, root, path)
    out = schema
    for name, key, sub, sub_path in _children(schema, path):
        narrowed, problem = narrow_enums(sub, root, sub_path)
        if problem:
            return schema, problem
        if narrowed is not sub:  # copied on the way down only where something changed
            if out is schema:
                out = dict(schema)
            if key is None:
                out[name] = narrowed
            else:
                if out[name] is schema[name]:
                    out[name] = dict(schema[name]) if isinstance(schema[name], dict) else list(schema[name])
                out[name][key] = narrowed
    return out, None


def _narrow(node: dict, root: dict, path: str) -> tuple[dict, str | None]:
    keyword = "const" if "const" in node else "enum"
    if keyword == "enum" and not isinstance(node["enum"], list):
        return node, None  # not a list: xgrammar names the error
    values = [node["const"]] if keyword == "const" else node["enum"]
    # Beside a const, an enum is one more constraint (jsonschema compares as JSON does: `true` is not `1`).
    beside = {key: value for key, value in node.items() if key not in _ANNOTATIONS | {keyword}}
    if not beside:
        return node, None
    try:
        from jsonschema import FormatChecker
        from jsonschema.validators import validator_for
    except ImportError:
        return node, (f"{sorted(beside)[0]!r} at {path} (beside {keyword!r} it is checked with jsonschema: "
                      "pip install jsonschema, or drop it)")
    try:
        # The root's validator (its `$schema`'s draft, `$ref`s resolved against the whole schema) on the node's
        # other constraints.
        validator = validator_for(root)(root, format_checker=_format_checker(FormatChecker)).evolve(schema=beside)
        kept = [value for value in values if validator.is_valid(value)]
    except _Uncheckable as error:
        return node, (f"'format' at {path} (format {error.args[0]!r}, which the values of {keyword!r} there must "
                      "meet, cannot be checked here; drop the values it forbids and the format)")
    except Exception as error:  # an invalid constraint, a `$ref` that cannot be followed
        return node, f"{sorted(beside)[0]!r} at {path} (beside {keyword!r} it could not be checked: {error})"
    if not kept:
        return node, (f"{keyword!r} at {path} (no value meets the constraints beside it, "
                      f"{', '.join(repr(k) for k in sorted(beside))}: no answer could match)")
    if len(kept) == len(values) and unenforced(node, path) is None:  # nothing beside it forbids a value
        return node, None
    # Every value kept was checked against the node's other constraints: the node is its enum alone.
    narrowed = {key: value for key, value in node.items() if key in _ANNOTATIONS}
    narrowed["enum"] = kept
    return narrowed, None


class _Uncheckable(Exception):
    pass


@functools.cache
def _format_checker(base):
    """jsonschema's format checker (`base`), except that a format xgrammar would enforce but jsonschema cannot check
    here (it lacks the optional package) fails the check, at any depth; a format neither knows only describes."""

    class Formats(base):
        def check(self, instance, format):
            if format not in self.checkers and format in _FORMATS:
                raise _Uncheckable(format)
            super().check(instance, format)

    return Formats()


def _lookahead(pattern: str) -> bool:
    """Whether the regular expression `pattern` has a lookahead. (xgrammar refuses one in a regex, but a schema's
    `pattern` with one it takes for any string.)"""
    escaped = in_class = False
    for i, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
    return False


def _disjoint(branches: list) -> bool:
    """Whether no value can match two of `branches`, judged by their declared `type`s (integers are numbers)."""
    seen: set[str] = set()
    for branch in branches:
        kinds = branch.get("type") if isinstance(branch, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds:
            return False
        kinds = set(kinds) | ({"integer"} if "number" in kinds else set())
        if seen & kinds:
            return False
        seen |= kinds
    return True


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
