"""What the client commands share: auth headers, the served model's name, SSE events."""

import json

import httpx


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(url: str, api_key: str | None) -> str:
    r = httpx.get(f"{url}/v1/models", headers=headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def sse_events(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            yield json.loads(data)
