"""The OpenAPI document the gateway serves at GET /api/openapi.json: a valid OpenAPI 3.1
document that lists every operation, and the truth about each. Schemathesis generates
requests for every operation from the document (valid and invalid ones) and sends them to a
real gateway with real kernels; every answer must be a non-5xx whose status, content type and
body the document describes.

Kernel-scoped operations mostly get the id of a real kernel, so they run real code, real
file operations in its container, real restarts; the rest of the time a generated id (404).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Iterator

import jsonschema
import pytest
import requests
import schemathesis
import schemathesis.openapi
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import OpenAPIV31SpecValidator, validate
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import ARTIFACTS, POLICY, Gateway, start_gateway, stop_gateway

# Generated requests per operation (plus the document's own examples). Kernel creates and
# restarts take a second or more each on a loaded 2-core machine.
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# A generated `timeout` of hours would hold the kernel that long if the code happened to hang.
MAX_RUN_SECONDS = 5.0
# The example of the files API's `path` in the document.
EXAMPLE_FILE = "data/sales.csv"

# Every operation of the HTTP API, as `METHOD path`.
OPERATIONS = sorted(
    [
        "GET /",
        "GET /ui/{file}",
        "GET /api",
        "GET /api/openapi.json",
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
        "GET /v2/sandboxes",
        "POST /v2/sandboxes",
        "GET /sandboxes/{id}",
        "DELETE /sandboxes/{id}",
        "POST /sandboxes/{id}/timeout",
        "POST /v2/sandboxes/{id}/connect",
        "GET /sandboxes/{id}/metrics",
        "PUT /sandboxes/{id}/network",
        "POST /sandboxes/{id}/snapshots",
        "GET /snapshots",
        "DELETE /templates/{id}",
        "POST /sandboxes/{id}/fork",
        "POST /sandboxes/{id}/pause",
        "GET /api/kernelspecs",
        "GET /api/kernelspecs/{name}",
        "GET /kernelspecs/{name}/{file}",
        "GET /api/kernels",
        "POST /api/kernels",
        "GET /api/kernels/{id}",
        "DELETE /api/kernels/{id}",
        "POST /api/kernels/{id}/interrupt",
        "POST /api/kernels/{id}/restart",
        "POST /api/kernels/{id}/hibernate",
        "POST /api/kernels/{id}/discard-state",
        "POST /api/kernels/{id}/snapshots",
        "POST /api/kernels/{id}/fork",
        "GET /api/kernelgate/snapshots",
        "GET /api/kernelgate/snapshots/{id}",
        "DELETE /api/kernelgate/snapshots/{id}",
        "POST /api/kernels/{id}/execute",
        "POST /api/kernels/{id}/packages",
        "GET /api/kernels/{id}/files",
        "GET /api/kernels/{id}/files/{path}",
        "PUT /api/kernels/{id}/files/{path}",
        "DELETE /api/kernels/{id}/files/{path}",
        "GET /api/kernelgate/approvals",
        "POST /api/kernelgate/approvals/{id}",
        "GET /api/kernelgate/packages",
    ]
)


def is_e2b(path: str) -> bool:
    """E2B's control plane: its key goes in X-API-KEY, its errors carry `code` too."""
    return path.startswith(("/v2/sandboxes", "/sandboxes/", "/snapshots", "/templates/"))


@dataclass
class Target:
    gateway: Gateway
    document: dict
    kernel_id: str
    sandbox_id: str = ""

    def create_kernel(self) -> str:
        r = self.gateway.request("POST", "/api/kernels", json={"name": "python3"})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def e2b_headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.gateway.token}

    def live_sandbox(self) -> str:
        """A running E2B sandbox: the one made before, unless a case killed it or moved its
        end so near that it ended."""
        if self.sandbox_id:
            r = requests.get(f"{self.gateway.url}/sandboxes/{self.sandbox_id}", headers=self.e2b_headers(), timeout=30)
            if r.status_code == 200:
                return self.sandbox_id
        r = requests.post(self.gateway.url + "/v2/sandboxes", json={"templateID": "base", "timeout": 3600},
                          headers=self.e2b_headers(), timeout=120)
        assert r.status_code == 201, r.text
        self.sandbox_id = r.json()["sandboxID"]
        return self.sandbox_id


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Iterator[Target]:
    """One gateway for the whole module: a warm pool of 2, a limit of 6 kernels, the
    execution policy of the other tests in force (so the approvals API has a guard)."""
    artifacts = ARTIFACTS / "test_openapi"
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "cases.log").write_text("")  # status, method, URL and body of every case
    policy = tmp_path_factory.mktemp("policy") / "policy.toml"
    policy.write_text(POLICY)
    gw = start_gateway(
        artifacts / "gateway.log",
        ["--pool-size", "2", "--max-kernels", "6", "--policy", str(policy)],
    )
    try:
        # Served without a token, like GET /api.
        r = requests.get(gw.url + "/api/openapi.json", timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        (artifacts / "openapi.json").write_text(json.dumps(r.json(), indent=1))
        t = Target(gw, r.json(), "")
        t.kernel_id = t.create_kernel()
        yield t
    finally:
        stop_gateway(gw)


def operations(document: dict) -> set[str]:
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return {f"{m.upper()} {p}" for p, item in document["paths"].items() for m in item if m in methods}


def test_the_document_is_valid_openapi_3_1_and_lists_every_route(target: Target):
    doc = target.document
    validate(doc, cls=OpenAPIV31SpecValidator)
    assert doc["openapi"].startswith("3.1")
    assert operations(doc) == set(OPERATIONS)
    # The WebSocket is described in prose, not as an operation.
    assert "/api/kernels/{id}/channels" in doc["info"]["description"]
    # Which routes want a token: the document says what the gateway does (past 10 refusals
    # a minute the refusal is a 429, as documented).
    fill = {"{id}": target.kernel_id, "{path}": "x", "{name}": "python3", "{file}": "logo-svg.svg"}
    for op in sorted(operations(doc)):
        method, path = op.split(" ", 1)
        security = doc["paths"][path][method.lower()].get("security")
        url = target.gateway.url + path
        for name, value in fill.items():
            url = url.replace(name, value)
        r = requests.request(method, url, timeout=30)
        if security is None:
            assert r.status_code not in (403, 429), f"{op} is public: {r.status_code} {r.text}"
        elif security == [{"e2b_api_key": []}]:
            assert is_e2b(path), op
            assert r.status_code in (401, 429), f"{op} without X-API-KEY: {r.status_code} {r.text}"
            assert set(r.json()) == {"code", "reason", "message"}
        elif {} not in security:
            assert r.status_code in (403, 429), f"{op} without a token: {r.status_code} {r.text}"
            assert set(r.json()) == {"reason", "message"}


def test_undecodable_path_parameters_are_documented_errors(target: Target):
    """Generated parameters are always UTF-8; `%FF` is not: a JSON 400 on every operation
    with path parameters, as the document says."""
    doc = target.document
    for op in OPERATIONS:
        method, path = op.split(" ", 1)
        if "{" not in path:
            continue
        assert "400" in doc["paths"][path][method.lower()]["responses"], op
        url = target.gateway.url + re.sub(r"\{[a-z]+\}", "%FF", path)
        headers = {**target.gateway.headers(), **target.e2b_headers()}
        r = requests.request(method, url, headers=headers, timeout=30)
        assert r.status_code == 400, f"{op}: {r.status_code} {r.text}"
        assert r.headers["content-type"] == "application/json", op
        assert set(r.json()) == {"reason", "message"}, op


def test_both_answers_of_the_agent_api_match_their_schemas(target: Target):
    """The generated cases rarely produce output; this run has every kind: stdout, stderr,
    a display, the cell's value and an error, as JSON and as NDJSON lines."""
    code = (
        "import sys\nfrom IPython.display import display, HTML\nprint('out')\n"
        "print('err', file=sys.stderr)\ndisplay(HTML('<b>x</b>'))\n"
        "if 'ran' in globals():\n    1 / 0\nran = True\n41 + 1"
    )
    path = f"/api/kernels/{target.kernel_id}/execute"
    r = target.gateway.request("POST", path, json={"code": code, "timeout": 30})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    result = r.json()
    validator(target.document, "ExecuteResult").validate(result)
    assert (result["status"], result["stdout"], result["stderr"]) == ("ok", "out\n", "err\n")
    assert [x["is_main_result"] for x in result["results"]] == [False, True]

    streaming = {**target.gateway.headers(), "Accept": "application/x-ndjson"}
    r = requests.post(target.gateway.url + path, json={"code": code, "timeout": 30}, headers=streaming, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson", r.text
    lines = check_ndjson(target.document, r.text)
    assert [line["type"] for line in lines] == ["stdout", "stderr", "result", "error", "end"]
    assert lines[-1]["status"] == "error"


@pytest.fixture(scope="module")
def api_schema(target: Target):
    config = SchemathesisConfig.from_dict(
        {
            "base-url": target.gateway.url,
            "request-timeout": 120,
            "seed": 20261125,
            # Random tokens would only meet the refusal (and its rate limit): the cases use
            # the gateway's token.
            "generation": {"with-security-parameters": False},
        }
    )
    return schemathesis.openapi.from_dict(target.document, config=config)


def uses_real_kernel(value: object) -> bool:
    """Most cases get the real kernel (real work), some keep the generated id (404)."""
    return zlib.crc32(repr(value).encode()) % 5 != 0


@pytest.mark.parametrize("label", OPERATIONS)
def test_every_operation_answers_as_documented(label: str, target: Target, api_schema):
    """Generated requests, valid and (where the operation takes input) invalid ones."""
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label
    strategy = operation.as_strategy(GenerationMode.POSITIVE)
    if operation.path_parameters or operation.body or operation.query:
        strategy = strategy | operation.as_strategy(GenerationMode.NEGATIVE)

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    def answers_as_documented(case):
        check_case(case, target)

    answers_as_documented()


def check_case(case, target: Target) -> None:
    path = case.operation.path
    if "id" in (case.path_parameters or {}) and path.startswith("/api/kernels/{id}"):
        if uses_real_kernel(case.path_parameters["id"]):
            case.path_parameters["id"] = target.kernel_id
    headers = {"Authorization": f"token {target.gateway.token}"}
    if is_e2b(path):
        headers = target.e2b_headers()
        if "id" in (case.path_parameters or {}) and uses_real_kernel(case.path_parameters["id"]):
            case.path_parameters["id"] = target.live_sandbox()
    # The document's example file exists whenever a case names it, so reads and deletes of
    # real files (and listings of real directories) are exercised too.
    if path.startswith("/api/kernels/{id}/files") and case.path_parameters["id"] == target.kernel_id:
        r = target.gateway.request("PUT", f"/api/kernels/{target.kernel_id}/files/{EXAMPLE_FILE}", data=b"m,sales\n1,100\n")
        assert r.status_code == 201, r.text
    # A fork of the real kernel starts real kernels: at most two, within --max-kernels.
    if path in ("/api/kernels/{id}/fork", "/sandboxes/{id}/fork") and isinstance(case.body, dict):
        count = case.body.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 2:
            case.body["count"] = 2
    if path == "/api/kernels/{id}/execute" and isinstance(case.body, dict):
        timeout = case.body.get("timeout")
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if timeout is None or (number and timeout > MAX_RUN_SECONDS):
            case.body["timeout"] = MAX_RUN_SECONDS
        if zlib.crc32(repr(case.body).encode()) % 2:
            headers["Accept"] = "application/x-ndjson"

    response = case.call(headers=headers, timeout=120)
    with open(ARTIFACTS / "test_openapi" / "cases.log", "a") as log:
        sent = f"{case.method} {response.request.url} {str(case.body)[:200]!r}"
        log.write(f"{response.status_code} {content_type(response)} {sent}\n")
    case.validate_response(response, checks=CHECKS, headers=headers)

    if content_type(response).startswith("application/x-ndjson"):
        check_ndjson(target.document, response.text)
    # Keep the table within --max-kernels: what a case created goes again; what it deleted
    # is replaced.
    if case.method == "POST" and path == "/api/kernels" and response.status_code == 201:
        target.gateway.request("DELETE", f"/api/kernels/{response.json()['id']}")
    if case.method == "POST" and path == "/api/kernels/{id}/fork" and response.status_code == 200:
        for fork in response.json()["forks"]:
            if fork.get("kernel"):
                target.gateway.request("DELETE", f"/api/kernels/{fork['kernel']['id']}")
    if case.method == "POST" and path == "/api/kernels/{id}/snapshots" and response.status_code == 201:
        target.gateway.request("DELETE", f"/api/kernelgate/snapshots/{response.json()['id']}")
    if case.method == "POST" and path == "/sandboxes/{id}/fork" and response.status_code == 201:
        for fork in response.json():
            if fork.get("sandbox"):
                sandbox = fork["sandbox"]["sandboxID"]
                requests.delete(f"{target.gateway.url}/sandboxes/{sandbox}", headers=target.e2b_headers(), timeout=60)
    if case.method == "POST" and path == "/sandboxes/{id}/snapshots" and response.status_code == 201:
        snapshot = response.json()["snapshotID"]
        requests.delete(f"{target.gateway.url}/templates/{snapshot}", headers=target.e2b_headers(), timeout=60)
    if case.method == "POST" and path == "/v2/sandboxes" and response.status_code == 201:
        sandbox = response.json()["sandboxID"]
        r = requests.delete(f"{target.gateway.url}/sandboxes/{sandbox}", headers=target.e2b_headers(), timeout=60)
        assert r.status_code == 204, r.text
    if case.method == "DELETE" and path == "/api/kernels/{id}" and case.path_parameters["id"] == target.kernel_id:
        target.kernel_id = target.create_kernel()


def content_type(response) -> str:
    """Schemathesis keeps every value of a header."""
    values = {k.lower(): v for k, v in response.headers.items()}.get("content-type")
    return values[0] if values else ""


def validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    """A validator of the document's schema `name`."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def check_ndjson(document: dict, text: str) -> list[dict]:
    """Each line of a streamed run is one `Line` object of the document; the last is `end`."""
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines, "a streamed run sends at least its end line"
    for line in lines:
        validator(document, "Line").validate(line)
    assert lines[-1]["type"] == "end"
    return lines
