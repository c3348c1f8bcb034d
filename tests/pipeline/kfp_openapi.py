"""The KFP v2beta1 REST API as a document, and checks of requests and responses against it.

The document is the API description the `kfp-server-api` package carries (from PyPI, the
version kfp pins: 2.17.x for kfp 2.17.3). openapi-generator wrote that package from KFP's
`backend/api/v2beta1/swagger/kfp_api_single_file.swagger.json`: one class per definition
(`kfp_server_api.models`: each property's JSON name and type, the values of each enum) and
one method per operation (`kfp_server_api.api`: path, HTTP method, path, query and form
parameters with their types, the body and the response). `DOCUMENT` reads them back: its
`operations`, and its `definitions` as JSON Schemas (draft 4), checked with `jsonschema`.

How strict (as strict as the real API server, or stricter where leniency would hide a bug):

- A request or response body may hold only the properties of its definition. The server's
  JSON unmarshaler refuses unknown fields (`DiscardUnknown: false`), and it writes proto
  field names and leaves empty fields out (`UseProtoNames`, `EmitUnpopulated: false`):
  `CustomMarshaler` in backend/src/apiserver/common/utils.go (KFP 2.15-2.17).
- Healthz is written by hand, not by the gateway, and adds `commit_sha` and `tag_name` to the
  documented `multi_user` and `pipeline_store` (`healthzResponse` in
  backend/src/apiserver/main.go): `SERVER_EXTRAS` adds them to the definition.
- A query parameter the operation does not declare is refused. The gateway would ignore it,
  which would hide a misspelt `namespace` or `filter` that the real server never applies.
- Errors are `google.rpc.Status` (`code`, `message`, `details`), every operation's `default`
  response.
- As protojson does, a JSON number is accepted where the package says `str`: the generator
  writes int64 fields (which protojson reads from numbers or strings) as `str`.

`parse_filter` reads a `filter` query parameter (a JSON `Filter`) the way the server does
(`parseAPIFilter` in backend/src/apiserver/server/list_request_util.go: camelCase value
keys renamed to proto names, then protojson, which takes enum names or numbers).

Worked example: `DOCUMENT.request("GET", "/apis/v2beta1/pipelines?namespace=alice", {}, b"")`
is the operation `pipeline_service_list_pipelines` with query {"namespace": "alice"};
`?namespaces=alice` raises `Violation("'namespaces' is not a query parameter of ...")`.
"""

from __future__ import annotations

import email.parser
import email.policy
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import jsonschema
import kfp_server_api
import kfp_server_api.api
import kfp_server_api.models

VERSION = kfp_server_api.__version__
SOURCE = (
    f"kfp-server-api {VERSION} (generated from KFP's "
    "backend/api/v2beta1/swagger/kfp_api_single_file.swagger.json)"
)

# Properties the real server sends beyond the document (see the module docstring).
SERVER_EXTRAS = {
    "V2beta1GetHealthzResponse": {"commit_sha": {"type": "string"}, "tag_name": {"type": "string"}}
}
# Filter.Predicate.Operation numbers (backend/api/v2beta1/filter.proto); 4 is unused.
FILTER_OPERATIONS = {
    0: "OPERATION_UNSPECIFIED",
    1: "EQUALS",
    2: "NOT_EQUALS",
    3: "GREATER_THAN",
    5: "GREATER_THAN_EQUALS",
    6: "LESS_THAN",
    7: "LESS_THAN_EQUALS",
    8: "IN",
    9: "IS_SUBSTRING",
}
# transformJSONForBackwardCompatibility (list_request_util.go): older clients' key names.
_FILTER_KEY_RENAMES = {
    "intValue": "int_value",
    "longValue": "long_value",
    "stringValue": "string_value",
    "timestampValue": "timestamp_value",
    "intValues": "int_values",
    "longValues": "long_values",
    "stringValues": "string_values",
}


class Violation(Exception):
    """A request or response the document does not allow."""


@dataclass(frozen=True)
class Operation:
    """One operation of the document, e.g. `pipeline_service_list_pipelines`."""

    name: str  # the generated method (the operationId in snake case)
    method: str
    path: str  # template, e.g. /apis/v2beta1/recurringruns/{recurring_run_id}:enable
    query: dict[str, str]  # wire name -> type (str, int, bool, list[str], ...)
    required: frozenset[str]  # required parameters, by wire name
    body: str | None  # definition of the JSON body
    form: tuple[str, ...]  # multipart/form-data fields
    response: str | None  # definition of the 200 answer ("object": any object)
    pattern: re.Pattern

    @property
    def literal_chars(self) -> int:
        return len(re.sub(r"\{[^}]*\}", "", self.path))


@dataclass(frozen=True)
class Request:
    operation: Operation
    path_params: dict[str, str]
    query: dict[str, Any]  # parsed: str, int, bool, or a list for list[...] parameters
    body: Any  # the JSON body, or {field: (filename, bytes)} of a multipart upload


# ---------------------------------------------------------------- the definitions


def _type_schema(t: str) -> dict:
    t = t.strip()
    if t.startswith("list["):
        return {"type": "array", "items": _type_schema(t[5:-1])}
    if t.startswith("dict("):
        return {"type": "object", "additionalProperties": _type_schema(t[5:-1].split(",", 1)[1])}
    simple = {
        # int64 is `str` in the generated code; protojson reads it from a number or a string.
        "str": {"type": ["string", "integer"]},
        "int": {"type": "integer"},
        "float": {"type": "number"},
        "bool": {"type": "boolean"},
        "datetime": {"type": "string"},
        "date": {"type": "string"},
        "object": {},  # a google.protobuf.Value or Struct: any JSON
    }
    if t in simple:
        return dict(simple[t])
    return {"$ref": f"#/definitions/{t}"}


def _definitions() -> dict[str, dict]:
    defs: dict[str, dict] = {}
    for name, cls in vars(kfp_server_api.models).items():
        if not inspect.isclass(cls) or not hasattr(cls, "openapi_types"):
            continue
        if getattr(cls, "allowable_values", None):
            defs[name] = {"type": "string", "enum": list(cls.allowable_values)}
            continue
        props = {cls.attribute_map[attr]: _type_schema(t) for attr, t in cls.openapi_types.items()}
        props.update(SERVER_EXTRAS.get(name, {}))
        defs[name] = {
            "type": "object",
            "properties": props,
            # google.protobuf.Any carries the packed message's fields beside "@type".
            "additionalProperties": name == "ProtobufAny",
        }
    return defs


# ---------------------------------------------------------------- the operations

_CALL = re.compile(r"call_api\(\s*'([^']+)', '([A-Z]+)'")
_QUERY = re.compile(r"query_params\.append\(\('([\w.]+)', local_var_params\['(\w+)'\]")
_FILE = re.compile(r"local_var_files\['([\w.]+)'\]")
_FORM = re.compile(r"form_params\.append\(\('([\w.]+)'")
_BODY = re.compile(r"body_params = local_var_params\['(\w+)'\]")
_PATH_PARAM = re.compile(r"path_params\['([\w.]+)'\] = local_var_params\['(\w+)'\]")
_REQUIRED = re.compile(r"Missing the required parameter `(\w+)`")
_RESPONSE = re.compile(r"response_type=(?:'([^']+)'|None)")
_TYPE = re.compile(r":type (\w+): ([^\n]+)")


def _operation(name: str, source: str) -> Operation:
    path, method = _CALL.search(source).groups()
    types = {p: t.strip() for p, t in _TYPE.findall(source)}
    wire = {py: w for w, py in _PATH_PARAM.findall(source)}
    query = {}
    for w, py in _QUERY.findall(source):
        query[w] = types.get(py, "str")
        wire[py] = w
    body = _BODY.search(source)
    form = tuple(_FILE.findall(source)) + tuple(_FORM.findall(source))
    response = _RESPONSE.search(source)
    pattern = "".join(
        f"(?P<p{i}>[^/]+)" if part.startswith("{") else re.escape(part)
        for i, part in enumerate(re.split(r"(\{[^}]*\})", path))
    )
    return Operation(
        name=name,
        method=method,
        path=path,
        query=query,
        required=frozenset(wire.get(p, p) for p in _REQUIRED.findall(source)),
        body=types[body.group(1)] if body else None,
        form=form,
        response=response.group(1) if response else None,
        pattern=re.compile(pattern + "$"),
    )


def _operations() -> dict[str, Operation]:
    ops = {}
    for _, cls in inspect.getmembers(kfp_server_api.api, inspect.isclass):
        for attr, fn in inspect.getmembers(cls, inspect.isfunction):
            if attr.endswith("_with_http_info"):
                name = attr[: -len("_with_http_info")]
                ops[name] = _operation(name, inspect.getsource(fn))
    return ops


# ---------------------------------------------------------------- the checks


class Document:
    def __init__(self):
        self.definitions = _definitions()
        self.operations = _operations()
        self._validators: dict[str, jsonschema.Draft4Validator] = {}

    def _validator(self, definition: str) -> jsonschema.Draft4Validator:
        if definition not in self._validators:
            schema = {"$ref": f"#/definitions/{definition}", "definitions": self.definitions}
            jsonschema.Draft4Validator.check_schema(schema)
            self._validators[definition] = jsonschema.Draft4Validator(schema)
        return self._validators[definition]

    def check(self, definition: str, value: Any, what: str) -> None:
        """Raise Violation unless `value` is a valid `definition` (e.g. V2beta1Pipeline)."""
        if definition == "object":
            if not isinstance(value, dict):
                raise Violation(f"{what} must be a JSON object, got {value!r}")
            return
        if definition not in self.definitions:
            raise Violation(f"{what}: the document has no definition {definition}")
        error = jsonschema.exceptions.best_match(self._validator(definition).iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(top)"
            raise Violation(f"{what} is not a valid {definition} at {where}: {error.message}")

    def match(self, method: str, path: str) -> tuple[Operation, dict[str, str]]:
        found = []
        for op in self.operations.values():
            m = op.pattern.match(path)
            if m and op.method == method:
                found.append((op, m))
        if not found:
            raise Violation(f"{method} {path} is not an operation of the document")
        op, m = max(found, key=lambda f: f[0].literal_chars)  # literal paths beat templates
        names = re.findall(r"\{([^}]*)\}", op.path)
        return op, {n: unquote(m.group(f"p{2 * i + 1}")) for i, n in enumerate(names)}

    def request(self, method: str, url: str, headers, body: bytes) -> Request:
        """The operation a request calls, its parameters parsed; Violation if the document
        does not allow it (unknown path or query parameter, wrong type, invalid body)."""
        parsed = urlparse(url)
        op, path_params = self.match(method, parsed.path)
        query: dict[str, Any] = {}
        for name, values in parse_qs(parsed.query, keep_blank_values=True).items():
            if name not in op.query:
                raise Violation(f"{name!r} is not a query parameter of {op.name}")
            query[name] = _query_value(op, name, values)
        missing = (op.required & set(op.query)) - set(query)
        if missing:
            raise Violation(f"{op.name} needs the query parameter(s) {sorted(missing)}")
        ctype = headers.get("Content-Type", "") or ""
        if op.form:
            payload: Any = _multipart(op, ctype, body)
            missing = (op.required & set(op.form)) - set(payload)
            if missing:
                raise Violation(f"{op.name} needs the form field(s) {sorted(missing)}")
        elif op.body:
            if not ctype.startswith("application/json"):
                raise Violation(f"{op.name} takes an application/json body, got {ctype!r}")
            try:
                payload = json.loads(body)
            except ValueError as e:
                raise Violation(f"{op.name}: the body is not JSON: {e}") from None
            self.check(op.body, payload, f"the body of {op.name}")
        elif body:
            raise Violation(f"{op.name} takes no body, got {body[:80]!r}")
        else:
            payload = None
        return Request(op, path_params, query, payload)

    def response(self, op: Operation | None, status: int, payload: Any) -> None:
        """Violation unless `payload` is what the document lets `op` answer with `status`."""
        if status != 200 or op is None:
            self.check("GoogleRpcStatus", payload, f"the {status} answer")
        elif op.response is None:
            if payload not in (None, {}):
                raise Violation(f"{op.name} answers nothing, the stand-in sent {payload!r}")
        else:
            self.check(op.response, payload, f"the answer of {op.name}")

    def parse_filter(self, raw: str) -> list[dict]:
        """The predicates of a `filter` query parameter, each with its operation by name."""
        if not raw:
            return []
        text = unquote(raw)  # parseAPIFilter unescapes once more
        for old, new in _FILTER_KEY_RENAMES.items():
            text = text.replace(f'"{old}":', f'"{new}":')
        try:
            tree = json.loads(text)
        except ValueError as e:
            raise Violation(f"the filter is not JSON: {e}: {raw!r}") from None
        for p in tree.get("predicates", []) if isinstance(tree, dict) else []:
            if isinstance(p, dict) and isinstance(p.get("operation"), int):
                if p["operation"] not in FILTER_OPERATIONS:
                    raise Violation(f"the filter has an unknown operation {p['operation']}")
                p["operation"] = FILTER_OPERATIONS[p["operation"]]
        self.check("V2beta1Filter", tree, "the filter")
        return tree.get("predicates", [])


def _query_value(op: Operation, name: str, values: list[str]) -> Any:
    t = op.query[name]
    if t.startswith("list["):
        return values
    if len(values) != 1:
        raise Violation(f"{op.name}: query parameter {name!r} given {len(values)} times")
    value = values[0]
    if t == "int":
        try:
            return int(value)
        except ValueError:
            raise Violation(f"{op.name}: {name}={value!r} is not an integer") from None
    if t == "bool":
        if value not in ("true", "false"):
            raise Violation(f"{op.name}: {name}={value!r} is not true or false")
        return value == "true"
    return value


def _multipart(op: Operation, ctype: str, body: bytes) -> dict[str, tuple[str, bytes]]:
    if not ctype.startswith("multipart/form-data"):
        raise Violation(f"{op.name} takes multipart/form-data, got {ctype!r}")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {ctype}\r\n\r\n".encode() + body
    )
    parts = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name not in op.form:
            raise Violation(f"{name!r} is not a form field of {op.name} ({list(op.form)})")
        parts[name] = (part.get_filename() or "", part.get_payload(decode=True))
    return parts


DOCUMENT = Document()
