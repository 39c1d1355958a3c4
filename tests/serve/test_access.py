"""The server a browser cannot abuse and what serving users expect:
JSON-only bodies, the Host allow-list, API keys that own their contexts, unguessable context ids, 404 for
an unknown model, /metrics, the prefix-cache flush, the last prefill's timeline, streams ended on shutdown."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hetero
from hetero.serve import Service, StoreConfig
from hetero.serve.access import owner_of_key
from tests.serve.conftest import RunningServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BODY = {"messages": QUESTION, "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(default_model: hetero.Model) -> Iterator[RunningServer]:
    service = Service(hetero.Runtime(default_model, chunk=32), StoreConfig(block=16), max_active=2, max_queue=4)
    running = RunningServer(service, api_keys=("key-one", "key-two"))
    yield running
    running.stop()


def test_only_json_bodies(server: RunningServer) -> None:
    with server.http() as http:
        for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
            r = http.post("/v1/chat/completions", content=json.dumps(BODY).encode(), headers=headers)
            assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type", r.text
        r = http.post("/v1/cache/flush", headers={"content-type": "text/plain"})  # no body is no exception
        assert r.status_code == 415
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200


def test_foreign_host_is_refused(server: RunningServer) -> None:
    with server.http() as http:
        r = http.get("/v1/models", headers={"host": f"attacker.example:{server.port}"})
        assert r.status_code == 421 and r.json()["error"]["param"] == "Host"
        for name in ("localhost", "127.0.0.1"):
            assert http.get("/v1/models", headers={"host": f"{name}:{server.port}"}).status_code == 200


def test_unknown_model_is_404_in_openais_shape(server: RunningServer) -> None:
    client = server.openai()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)


def test_context_ids_are_unguessable(server: RunningServer) -> None:
    with server.http() as http:
        ids = [http.post("/v1/contexts", json={}, headers={"X-Client-Id": "ids"}).json()["id"] for _ in range(2)]
        for cid in ids:
            assert re.fullmatch(r"ctx-[0-9a-f]{32}", cid)
            http.delete(f"/v1/contexts/{cid}", headers={"X-Client-Id": "ids"})
    assert ids[0] != ids[1]


def test_api_key_required_and_owns_contexts(keyed: RunningServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        keyed.openai().chat.completions.create(model=keyed.model, messages=QUESTION, max_tokens=2)
    with keyed.http() as http:
        assert http.get("/v1/models").status_code == 401
        r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert http.get("/health").status_code == 200 and http.get("/").status_code == 200  # no secrets there
        one, two = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
        ctx = http.post("/v1/contexts", json={}, headers={**one, "X-Client-Id": "someone"}).json()
        assert ctx["client"] == owner_of_key("key-one")  # the key, not the header
        spoof = {**two, "X-Client-Id": owner_of_key("key-one")}
        assert http.get(f"/v1/contexts/{ctx['id']}", headers=spoof).status_code == 404
        assert http.get(f"/v1/contexts/{ctx['id']}", headers={**one, "X-Client-Id": "other"}).status_code == 200
        assert http.delete(f"/v1/contexts/{ctx['id']}", headers=one).json()["deleted"]
    r = keyed.openai(api_key="key-two").chat.completions.create(model=keyed.model, messages=QUESTION, max_tokens=2)
    assert r.choices[0].message.content


def _samples(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_metrics_move_flush_and_timeline(server: RunningServer) -> None:
    client = server.openai()
    with server.http() as http:
        before = _samples(http)
        prompt = [{"role": "user", "content": "Name three rivers of Europe, please."}]
        r1 = client.chat.completions.create(model=server.model, messages=prompt, max_tokens=3)
        r = client.chat.completions.create(model=server.model, messages=prompt, max_tokens=3)
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
        after = _samples(http)
        assert after["hetero_prefix_cache_queries_total"] - before["hetero_prefix_cache_queries_total"] \
            == 2 * r.usage.prompt_tokens
        assert after["hetero_prefix_cache_hits_total"] - before["hetero_prefix_cache_hits_total"] \
            == r1.usage.prompt_tokens_details.cached_tokens + r.usage.prompt_tokens_details.cached_tokens
        assert after["hetero_time_to_first_token_seconds_count"] == before["hetero_time_to_first_token_seconds_count"] + 2
        assert after["hetero_inter_token_latency_seconds_count"] >= before["hetero_inter_token_latency_seconds_count"] + 4
        assert after["hetero_requests_total{outcome=ok}"] - before.get("hetero_requests_total{outcome=ok}", 0) == 2
        assert after["hetero_kv_cache_bytes{tier=ram_float}"] > 0
        assert "hetero_queue_length" in after and "hetero_active_requests" in after
        timeline = http.get("/v1/prefill/last").json()
        assert timeline["nodes"] and set(n[3] for n in timeline["nodes"]) <= set(timeline["lanes"])
        assert {n[2] for n in timeline["nodes"]} == {"qkv", "attn", "o_ffn"}
        flushed = http.post("/v1/cache/flush", json={}).json()
        assert flushed["flushed"] and flushed["blocks_dropped"] > 0
        assert _samples(http)["hetero_kv_cache_bytes{tier=ram_float}"] == 0
    r = client.chat.completions.create(model=server.model, messages=prompt, max_tokens=3)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing left to reuse


def test_save_without_state_folder_is_400(server: RunningServer) -> None:
    with server.http() as http:
        cid = http.post("/v1/contexts", json={}, headers={"X-Client-Id": "s"}).json()["id"]
        r = http.post(f"/v1/contexts/{cid}/save", json={}, headers={"X-Client-Id": "s"})
        assert r.status_code == 400 and "--state-dir" in r.json()["error"]["message"]
        http.delete(f"/v1/contexts/{cid}", headers={"X-Client-Id": "s"})


def test_shutdown_ends_a_stream_with_an_error_event(default_model: hetero.Model,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A stream running when the server stops gets an error event and [DONE], and nothing logs a
    traceback."""
    service = Service(hetero.Runtime(default_model, chunk=32), StoreConfig(block=16))
    running = RunningServer(service)
    lines = []
    with caplog.at_level(logging.WARNING):
        with running.http() as http, http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Count from one to one thousand."}], "max_tokens": 2000,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    running.server.should_exit = True  # what SIGTERM does
        running.thread.join(30)
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "server_shutting_down" and lines[-1] == "data: [DONE]"
    assert not [rec for rec in caplog.records if rec.exc_info], [rec.getMessage() for rec in caplog.records]


@pytest.mark.parametrize("body, field", [
    ({"messages": QUESTION, "stream": True, "stream_options": "x"}, "stream_options"),
    ({"messages": QUESTION, "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
    ({"messages": QUESTION, "context_id": 5}, "context_id"),
    ({"messages": QUESTION, "stop": [1, 2]}, "stop"),
])
def test_bad_fields_are_400_naming_the_field(server: RunningServer, body: dict, field: str) -> None:
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text


def test_allowed_hosts() -> None:
    import socket

    from hetero.serve.access import allowed_hosts, host_name

    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert "proxy.example" in allowed_hosts("127.0.0.1", ["proxy.example:443"])
    assert socket.gethostname().lower() in allowed_hosts("0.0.0.0")  # a wildcard: this machine's own names
    assert "attacker.example" not in allowed_hosts("0.0.0.0")
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost:80") == "localhost"
