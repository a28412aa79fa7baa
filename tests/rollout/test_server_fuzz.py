"""The policy server fuzzed from its own OpenAPI schema (issue 40, item 3) with ``schemathesis``: FastAPI's
``/openapi.json`` of :meth:`screl.rollout.server.server.PolicyServer.app`, called in-process over ASGI, in front of a real
:class:`~screl.rollout.worker.GenerationWorker` (the torch engine and its batching decode thread, a tiny model) in
this process: only Ray's hop between the server and the worker is left out (``tests/rollout/inprocess_server.py``).

Bounded and seeded (``derandomize``): the same examples on every run. For every answer:

* no 5xx (``not_a_server_error``);
* the status code, content type and body are the ones the schema documents (``status_code_conformance``,
  ``content_type_conformance``, ``response_schema_conformance``);
* a request the schema calls invalid is refused (``negative_data_rejection``);
* every 4xx carries OpenAI's error body, and a 400 names the field at fault in ``param`` and in its message
  (:func:`openai_error_body`).

Not checked: that every schema-valid request is accepted (``positive_data_acceptance``): the server refuses requests
by state the schema cannot say (an unknown ``previous_response_id``, a ``tool_choice`` naming a tool the request
does not offer, a past that does not splice), each a 400 naming the field, which the check above holds it to.

Below the fuzzing, one regression test per defect it found.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from screl.rollout.server.server import PolicyServer
from tests.rollout.inprocess_server import POLICY, InProcess, build_server

SERVER = build_server()
APP = SERVER.app()
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 4xx answers OpenAI's error body; a 400 names the field at fault (``param``, and in the message)."""
    if not 400 <= response.status_code < 500:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, f"not OpenAI's error body: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), body
    if response.status_code == 400:
        param = error["param"]
        assert isinstance(param, str) and param, f"a 400 that names no field: {body}"
        assert param.split("[")[0].split(".")[0] in error["message"], f"the message does not name {param!r}: {body}"
    return True


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
EXAMPLES = 250
"""Per POST route and generation mode: about 50 s in all on two shared cores (seeded: the same requests each run)."""
ROUTES = [("GET", "/health", POSITIVE, 5), ("GET", "/v1/models", POSITIVE, 5)] + [
    ("POST", path, mode, EXAMPLES) for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    for mode in (POSITIVE, NEGATIVE)]
"""(method, path, generation mode, examples). A GET takes no input: there is nothing to make invalid."""


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode", "examples"), ROUTES)
def test_the_server_answers_every_generated_request_as_its_schema_says(method: str, path: str, mode: GenerationMode,
                                                                       examples: int) -> None:
    operation = SCHEMA[path][method]
    calls = []

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        calls.append(case.call_and_validate(checks=CHECKS, additional_checks=[openai_error_body]).status_code)

    fuzz()
    print(f"\n{method} {path} ({mode}): {len(calls)} requests, status codes {sorted(set(calls))}")
    assert calls, "nothing was generated"


# -- regressions: what the fuzzing found ------------------------------------------------------------------------
CLIENT = TestClient(APP)
USER = [{"role": "user", "content": "3+4"}]


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_the_schema_documents_openais_error_body_and_no_422() -> None:
    """Was: every route documented FastAPI's 422 ``{"detail": [...]}``, the server answered 400 with OpenAI's body."""
    spec = CLIENT.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and responses["4XX"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"}, responses
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert "text/event-stream" in spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    messages = spec["components"]["schemas"]["ChatRequest"]["properties"]["messages"]
    assert messages["items"]["required"] == ["role"], messages  # was {}: a message without a role is refused


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/nope", 404), ("DELETE", "/v1/models", 405),
                                                        ("GET", "/v1/chat/completions", 405)])
def test_an_unknown_route_or_method_gets_openais_error_body(method: str, path: str, status: int) -> None:
    """Was: ``{"detail": "Not Found"}`` / ``{"detail": "Method Not Allowed"}``."""
    error = _error(CLIENT.request(method, path), status)
    assert error["message"].startswith(f"{method} {path}: ") and error["code"] == str(status)


@pytest.mark.parametrize(("content", "says"), [
    (b"", "body: the request body must be a JSON object"),  # was param "", message ": Field required"
    (b"[1, 2]", "body: the request body must be a JSON object"),
    (b"{\"messages\": [", "body: the request body is not valid JSON"),
    (b"\r\xf10\xbf\xff", "body: There was an error parsing the body"),  # not UTF-8: was param null, no field
])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_the_body(content: bytes, says: str) -> None:
    error = _error(CLIENT.post("/v1/responses", content=content, headers={"content-type": "application/json"}), 400)
    assert error["param"] == "body" and error["message"].startswith(says), error


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"prompt": "1+1=", "stream": 0}, "stream"),  # was accepted: 0 coerced to false
    ("/v1/chat/completions", {"messages": USER, "max_tokens": "4"}, "max_tokens"),  # was accepted as 4
    ("/v1/responses", {"input": "hi", "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(path: str, extra: dict[str, Any], param: str) -> None:
    error = _error(CLIENT.post(path, json=extra), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_beyond_64_bits_is_a_400_naming_it(seed: int) -> None:
    """Was: a 400 blaming ``messages`` with numpy's 'Overflow when unpacking long long'."""
    error = _error(CLIENT.post("/v1/chat/completions", json={"messages": USER, "seed": seed, "max_tokens": 2}), 400)
    assert error["param"] == "seed" and error["message"].startswith("seed: "), error
    ok = CLIENT.post("/v1/chat/completions", json={"messages": USER, "seed": -(2**63), "max_tokens": 2, "n": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("top_k", [2**31, 3 * 10**22])
def test_a_top_k_beyond_32_bits_is_a_400_naming_it(top_k: int) -> None:
    """Was: a 400 blaming ``messages`` with 'Overflow when unpacking long long' (the engine's top-k tensor); found by
    the fuzz under xdist after its first landing."""
    error = _error(CLIENT.post("/v1/chat/completions", json={"messages": USER, "top_k": top_k, "max_tokens": 2}), 400)
    assert error["param"] == "top_k" and error["message"].startswith("top_k: "), error
    ok = CLIENT.post("/v1/chat/completions", json={"messages": USER, "top_k": 2**31 - 1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # beyond the vocabulary: every token kept


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3 * 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "max_completion_tokens": 10**12},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 129}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**12}, "max_output_tokens"),
])
def test_a_token_budget_beyond_the_context_is_a_400_not_an_allocation(path: str, body: dict[str, Any],
                                                                      param: str) -> None:
    """Was: the engine sized a buffer by it; ``max_tokens: 3e9`` took 24 GB and the host's OOM killer ended the
    process. Now bounded by the model's context (128 here) or the run's max_new_tokens when larger."""
    assert SERVER.max_request_tokens == 128
    error = _error(CLIENT.post(path, json=body), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and "(128: " in error["message"]
    at_limit = CLIENT.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 128, "seed": 1})
    assert at_limit.status_code == 200, at_limit.text
    assert len(at_limit.json()["choices"][0]["token_ids"]) <= 128


def test_the_runs_max_new_tokens_is_allowed_beyond_the_context() -> None:
    server = PolicyServer([InProcess(SERVER.workers[0].target)], POLICY, max_tokens=200)
    assert server.max_request_tokens == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [6693]}, "prompt"),
    ("/v1/completions", {"prompt": [[3, 4], [5, 10**6]]}, "prompt"),  # negative ids: the schema refuses them
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": "x", "prompt_token_ids": [3],
                                                   "generation_token_ids": [10**6]}, *USER]}, "messages"),
])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(path: str, body: dict[str, Any],
                                                                     param: str) -> None:
    """Was: a 400 whose message was the engine's ('generate: request 'srv-…' has token ids outside the vocabulary')
    and named no field; found by the fuzz in CI (``{"prompt": [6693]}``)."""
    vocab = SERVER.vocab_size
    assert vocab is not None and 0 < vocab <= 6693
    error = _error(CLIENT.post(path, json={**body, "max_tokens": 2}), 400)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: token ids outside the model's vocabulary (0 to {vocab - 1})"), error
    ok = CLIENT.post("/v1/completions", json={"prompt": [vocab - 1], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
