"""Tools whose parameters refer into themselves (``$ref``): the call schema keeps each
tool's references meaning what they meant in the tool, checked through the real grammar
compiler on a byte vocabulary, then with the openai SDK's Pydantic tools on the real
Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json

import numpy as np
import pytest
from toy_grammar import BYTES, GrammarToy
from toy_models import random_table

from tandem.app.server.tools import call_schema, own_resource, parse_tools
from tandem.runtime.constrained import GrammarError, GrammarSpec, GrammarState, compile_grammar


@pytest.fixture(scope="module")
def toy() -> GrammarToy:
    return GrammarToy(random_table(len(BYTES), np.random.default_rng(0)), pieces=BYTES)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def schema_of(*tools: dict) -> dict:
    """The call schema of ``tools`` (all offered), as the server builds it."""
    req = parse_tools({"tools": list(tools)})
    assert req is not None
    return call_schema(req.offered)


def legal(toy: GrammarToy, schema: dict, call: dict) -> bool:
    """Whether the call, written as the server's grammar writes JSON, is a whole reply of
    ``schema`` compiled as the server compiles a call schema (``strict: false``)."""
    state = GrammarState(compile_grammar(GrammarSpec("json_schema", schema, strict=False), toy))
    tokens = toy.tokenize(json.dumps(call))
    if state.legal_prefix(tokens) < len(tokens):
        return False
    state.consume(tokens)
    return state.accepting


# Two tools that both define "Address", differently: each call must use its own.
HOME = tool("set_home", {
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}},
    "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"]})
SHIP = tool("ship", {
    "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"]})


@pytest.mark.parametrize(("call", "ok"), [
    ({"name": "set_home", "arguments": {"home": {"street": "Main"}}}, True),
    ({"name": "ship", "arguments": {"to": {"zip": 12345}}}, True),
    ({"name": "set_home", "arguments": {"home": {"zip": 12345}}}, False),  # the other tool's Address
    ({"name": "ship", "arguments": {"to": {"street": "Main"}}}, False),
])
def test_two_tools_with_the_same_defs_name_each_use_their_own(toy, call: dict, ok: bool) -> None:
    assert legal(toy, schema_of(HOME, SHIP), call) is ok


# Draft-07's "definitions", and a reference inside a definition to another one.
NESTED = tool("save", {
    "definitions": {
        "Country": {"type": "object", "properties": {"code": {"enum": ["FR", "NO"]}}, "required": ["code"]},
        "Address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "country": {"$ref": "#/definitions/Country"}},
                    "required": ["city", "country"]}},
    "type": "object", "properties": {"home": {"$ref": "#/definitions/Address"}}, "required": ["home"]})


@pytest.mark.parametrize(("arguments", "ok"), [
    ({"home": {"city": "Oslo", "country": {"code": "NO"}}}, True),
    ({"home": {"city": "Oslo", "country": {"code": "SE"}}}, False),
    ({"home": {"city": "Oslo", "country": "NO"}}, False),
])
def test_definitions_and_references_between_them(toy, arguments: dict, ok: bool) -> None:
    assert legal(toy, schema_of(NESTED, HOME), {"name": "save", "arguments": arguments}) is ok
    assert legal(toy, schema_of(NESTED), {"name": "save", "arguments": arguments}) is ok  # one tool: no anyOf


# "#" inside a tool is the tool's parameters (a tree), not the call around them.
CLOCK = tool("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})
TREE = tool("plant", {"type": "object", "properties": {"label": {"type": "string"},
                                                       "kids": {"type": "array", "items": {"$ref": "#"}}},
                      "required": ["label"]})


@pytest.mark.parametrize(("arguments", "ok"), [
    ({"label": "a", "kids": [{"label": "b", "kids": [{"label": "c"}]}]}, True),
    ({"label": "a", "kids": [{"kids": []}]}, False),  # a kid without its label
    ({"label": "a", "kids": [{"name": "plant", "arguments": {"label": "b"}}]}, False),  # "#" read as the call
])
def test_a_reference_to_the_root_means_the_tools_parameters(toy, arguments: dict, ok: bool) -> None:
    assert legal(toy, schema_of(TREE), {"name": "plant", "arguments": arguments}) is ok
    assert legal(toy, schema_of(CLOCK, TREE), {"name": "plant", "arguments": arguments}) is ok


def test_only_a_schema_with_references_becomes_its_own_resource() -> None:
    flat = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert own_resource(flat, "f") is flat
    named = {"$id": "https://example.com/p.json", "$defs": {"A": {}}, "properties": {"a": {"$ref": "#/$defs/A"}}}
    assert own_resource(named, "f") is named  # its references already resolve against its own $id
    assert own_resource(TREE["function"]["parameters"], "plant")["$id"] == "urn:tandem:tool:plant"


def test_a_reference_to_nothing_is_still_refused(toy) -> None:
    broken = tool("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})
    with pytest.raises(GrammarError, match="Missing"):
        compile_grammar(GrammarSpec("json_schema", schema_of(broken), strict=False), toy)


# -- the openai SDK's Pydantic tools, on the real 0.5B ---------------------------------

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "qwen-0.5b"


class Country(pydantic.BaseModel):
    name: str
    code: str = pydantic.Field(max_length=3)


class Address(pydantic.BaseModel):
    street: str
    city: str
    country: Country


class Person(pydantic.BaseModel):
    """Save a person and their home address."""

    name: str
    home: Address


def parcel_model() -> type[pydantic.BaseModel]:
    """A second tool whose nested model is also called ``Address`` (its ``$defs`` key),
    with other fields."""

    class Address(pydantic.BaseModel):  # the same name as the other tool's: the clash is the point
        postcode: str
        floor: int

    class Parcel(pydantic.BaseModel):
        """Send a parcel."""

        weight_kg: float
        to: Address

    return Parcel


Parcel = parcel_model()
TOOLS = {"save_person": Person, "send_parcel": Parcel}
ASK = [{"role": "user", "content": "Save Ada Lovelace, who lives at 12 St James's Square, London, England."}]


class Node(pydantic.BaseModel):
    label: str
    kids: list[Node]


@pytest.mark.parametrize("parameters", [
    Node.model_json_schema(),  # {"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}: a reference at the top
    openai.pydantic_function_tool(Node)["function"]["parameters"],  # the SDK's: Node inlined, and in $defs
])
def test_a_recursive_pydantic_model(toy, parameters: dict) -> None:
    schema = schema_of(tool("tree", parameters), CLOCK)
    assert legal(toy, schema, {"name": "tree", "arguments": {"label": "a", "kids": [{"label": "b", "kids": []}]}})
    assert not legal(toy, schema, {"name": "tree", "arguments": {"label": "a", "kids": [{"kids": []}]}})


def test_the_pydantic_tools_really_clash_and_nest() -> None:
    person = openai.pydantic_function_tool(Person, name="save_person")["function"]["parameters"]
    parcel = openai.pydantic_function_tool(Parcel, name="send_parcel")["function"]["parameters"]
    assert person["$defs"]["Address"] != parcel["$defs"]["Address"]
    assert person["$defs"]["Address"]["properties"]["country"] == {"$ref": "#/$defs/Country"}


@pytest.fixture(scope="module")
def client(real_models):
    from live_server import serving

    with serving(real_models.qwen_05b, MODEL, n_ctx=2048) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.mark.parametrize("choice", ["required", "save_person", "send_parcel"])
def test_nested_pydantic_tools_are_called_under_their_schema(client, choice: str) -> None:
    tools = [openai.pydantic_function_tool(model, name=name) for name, model in TOOLS.items()]
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                               temperature=0, max_tokens=120)
    reply = completion.choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls
    if choice != "required":
        assert call.function.name == choice
    model = TOOLS[call.function.name]
    assert model.model_validate_json(call.function.arguments) == call.function.parsed_arguments
    assert isinstance(call.function.parsed_arguments, model)
