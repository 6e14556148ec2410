"""How pagechat talks to an OpenAI-compatible server (its own, vLLM's, llama-server): the server's
base URL as a user gives it, the key as OpenAI's clients send it, the one line an error answer
says, and the model it serves. The app on a server (tui/remote.py), the peer console
(tui/peer_app.py), `pagechat watch` and `bench-serve` all reach servers through these."""

from __future__ import annotations

import json

import httpx
from pagechat.core.errors import PagechatError, one_line


def server_url(url: str) -> str:
    """The server's base URL: an OpenAI client's base_url (…/v1) names the server too."""
    return url.rstrip("/").removesuffix("/v1")


def bearer(api_key: str | None) -> dict[str, str]:
    """The headers that carry a server's key, as OpenAI clients send it."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client(url: str, api_key: str | None, timeout: float | httpx.Timeout) -> httpx.Client:
    """A client of the server at url, its key in every request."""
    return httpx.Client(base_url=server_url(url), headers=bearer(api_key), timeout=timeout)


def error_message(response: httpx.Response) -> str:
    """The one line an error response says (OpenAI's shape, else its status and text)."""
    try:
        return str(json.loads(response.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def model_card(url: str, api_key: str | None) -> dict:
    """The first model the server lists at /v1/models (its id, and who owns it: pagechat, vllm,
    llamacpp); PagechatError saying why where the server does not answer with one."""
    url = server_url(url)
    try:
        r = httpx.get(f"{url}/v1/models", headers=bearer(api_key), timeout=10.0)
    except httpx.HTTPError as e:
        raise PagechatError(f"cannot reach {url}: {one_line(e)}") from None
    if r.status_code != 200:
        raise PagechatError(f"{url}/v1/models: {error_message(r)}")
    try:
        card = r.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise PagechatError(f"{url}/v1/models is not an OpenAI model list") from None
    if not isinstance(card, dict) or "id" not in card:
        raise PagechatError(f"{url}/v1/models is not an OpenAI model list")
    return card
