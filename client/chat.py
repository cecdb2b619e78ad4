"""`kvserve chat`: an interactive terminal chat against any OpenAI-compatible server."""

import json

import httpx

from client.http import first_model, headers


def chat_loop(
    url: str, model: str | None, api_key: str | None, system: str | None, max_tokens: int, temperature: float
) -> int:
    """Read a line, stream the answer, keep the conversation; an empty line or EOF ends it."""
    url = url.rstrip("/")
    model = model or first_model(url, api_key)
    messages = [{"role": "system", "content": system}] if system else []
    print(f"chatting with {model} at {url} (empty line to quit)")
    with httpx.Client(headers=headers(api_key), timeout=600) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": temperature, "stream": True}  # fmt: skip
            answer = ""
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    print(f"error: HTTP {response.status_code}: {response.read().decode(errors='replace')}")
                    messages.pop()
                    continue
                for raw in response.iter_lines():
                    if not raw.startswith("data: ") or raw == "data: [DONE]":
                        continue
                    event = json.loads(raw[len("data: ") :])
                    if "error" in event:
                        print(f"\nerror: {event['error'].get('message')}")
                        break
                    delta = event["choices"][0]["delta"].get("content") if event.get("choices") else None
                    if delta:
                        answer += delta
                        print(delta, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": answer})
    return 0
