"""`hetero serve` over HTTP with the official `openai` client: chat, streaming, contexts, errors, 429, disconnects."""

from __future__ import annotations

import time

import openai
import pytest

from tests.serve.conftest import RunningServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_health(server: RunningServer) -> None:
    client = server.openai()
    assert [m.id for m in client.models.list().data] == [server.service.model_name]
    with server.http() as http:
        assert http.get("/health").json()["status"] == "ok"


def test_chat_and_stream_agree(server: RunningServer) -> None:
    client = server.openai()
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=8)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 20
    chunks = list(client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # all but the last


@pytest.mark.slow
def test_five_turn_conversation_reuses_earlier_turns(server: RunningServer) -> None:
    client = server.openai()
    messages = [{"role": "system", "content": "Answer in one short sentence."}]
    prompts = []
    for question in ["Name a colour.", "Name a fruit.", "Name a city.", "Name an animal.", "Name a planet."]:
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        prompts.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    (p4, _), (p5, cached5) = prompts[3], prompts[4]
    assert cached5 >= p4  # turn 5 reuses all of turn 4's prompt (and the reply's K/V from decode)
    assert cached5 < p5


def test_context_endpoints(server: RunningServer) -> None:
    client = server.openai()
    with server.http() as http:
        cid = http.post("/v1/contexts", json={"system": "You are terse."}, headers={"X-Client-Id": "a"}).json()["id"]
        r1 = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=6, extra_body={"context_id": cid}, extra_headers={"X-Client-Id": "a"})
        r2 = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Again."}],
                                            max_tokens=6, extra_body={"context_id": cid}, extra_headers={"X-Client-Id": "a"})
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
        ctx = http.get(f"/v1/contexts/{cid}", headers={"X-Client-Id": "a"}).json()
        assert ctx["turns"] == 2 and ctx["messages"][0]["role"] == "system"
        assert http.get(f"/v1/contexts/{cid}", headers={"X-Client-Id": "b"}).status_code == 404  # not b's
        second = http.post("/v1/contexts", json={}, headers={"X-Client-Id": "a"})
        third = http.post("/v1/contexts", json={}, headers={"X-Client-Id": "a"})
        assert third.status_code == 409 and "limit" in third.json()["error"]["message"]
        for c in (cid, second.json()["id"]):
            assert http.delete(f"/v1/contexts/{c}", headers={"X-Client-Id": "a"}).json()["deleted"]
        assert http.get(f"/v1/contexts/{cid}", headers={"X-Client-Id": "a"}).status_code == 404
        stats = http.get("/v1/stats").json()
        assert stats["counts"]["hits"] >= 1 and "ram_float" in stats["bytes"]


def test_completions(server: RunningServer) -> None:
    client = server.openai()
    r = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=4)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=4, stream=True) if c.choices)
    assert text == r.choices[0].text


def test_bad_requests_get_4xx_and_the_server_lives(server: RunningServer) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=server.model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=server.model, messages=QUESTION, temperature="hot")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=server.model, messages=QUESTION, extra_body={"context_id": "ctx-404"})
    with server.http() as http:
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": [10**9]}).status_code == 400
    assert client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2).choices[0].message.content


@pytest.mark.slow
def test_queue_bound_429_and_disconnect_frees_work(server: RunningServer) -> None:
    """max_active=2, max_queue=2: two streams run, two wait, the fifth gets 429; closing streams frees them."""
    client = server.openai()
    streams = []
    for i in range(4):
        s = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": f"Count to {100 + i}."}],
                                           max_tokens=200, stream=True)
        streams.append(s)
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        for s in streams:
            s.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 60
        while (load := http.get("/health").json())["active"] + load["queued"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load["active"] == 0 and load["queued"] == 0
