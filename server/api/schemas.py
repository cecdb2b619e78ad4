"""The JSON schemas a reply must match (response_format, tools' parameters), as the grammar is built from them.

An object schema that lists its properties allows others by JSON Schema's rules, unless it says
`additionalProperties: false`. A model told to fill in such a schema, and let add keys, often does: a small one
adds key after key until max_tokens, and the reply is not even JSON. Clients (LangChain's structured output,
Pydantic's schemas) leave the keyword out and expect only the listed keys, as OpenAI's strict mode and vLLM's
default grammar backend (xgrammar) give them. So kvserve closes such objects: keys outside `properties` only
where the schema asks for them (`additionalProperties`, `patternProperties`, `unevaluatedProperties`).

Draft-04 schemas (still what many tools' generators write) say an exclusive bound as `exclusiveMinimum: true`
beside `minimum`; the grammar reads only today's form (the bound itself), and ignored the boolean, letting the
bound through. So kvserve rewrites it in today's form.
"""

# Keywords whose value is a schema, a map of schemas or a list of schemas
ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "not",
       "if", "then", "else", "contains", "propertyNames")  # fmt: skip
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LISTS = ("anyOf", "oneOf", "prefixItems", "items")
OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def grammar_ready(schema):
    """`schema` as the grammar is built from it: every object schema that lists its properties closed to others,
    unless it says otherwise, and draft-04's boolean exclusive bounds in today's form. The members of an allOf stay open (and the definitions they refer to), and so does the schema holding it:
    each lists only some of the keys the whole allows."""
    try:
        kept_open: set[str] = set()
        _refs_in_all_of(schema, kept_open)
        return _closed(schema, True, kept_open)
    except RecursionError:  # deeper than any grammar compiles: the compile refuses it by its depth
        return schema


def _refs_in_all_of(value, found: set[str]) -> None:
    if isinstance(value, dict):
        for member in value.get("allOf") if isinstance(value.get("allOf"), list) else ():
            if isinstance(member, dict) and isinstance(member.get("$ref"), str):
                found.add(member["$ref"])
        for v in value.values():
            _refs_in_all_of(v, found)
    elif isinstance(value, list):
        for v in value:
            _refs_in_all_of(v, found)


def _closed(schema, close: bool, kept_open: set[str]):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], True, kept_open)
    for key in MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _closed(s, f"#/{key}/{name}" not in kept_open, kept_open)
                for name, s in out[key].items()
            }
    for key in LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, True, kept_open) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed(s, False, kept_open) for s in out["allOf"]]
        close = False
    if close and "properties" in out and not any(key in out for key in OPEN):
        out["additionalProperties"] = False
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(exclusive), bool):  # draft-04's: the bound beside it is exclusive, or not
            if out.pop(exclusive) and bound in out:
                out[exclusive] = out.pop(bound)
    return out
