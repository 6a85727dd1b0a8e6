"""The plain-ASGI pieces of the middleware megarl adds to the servers it starts (auth.py's key
check, held_tokens.py's and lora_slots.py's routes): a JSON answer, and a request's whole body."""
from __future__ import annotations

import json


async def send_json(send, status: int, body) -> None:
    """Answer `body` as JSON with HTTP `status`."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def read_body(receive) -> bytes:
    """The request's body, however many messages it came in."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body
