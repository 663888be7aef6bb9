"""A local HTTP server that speaks the Anthropic Messages and OpenAI Chat Completions wire formats and
replays a scripted transcript, so tests drive the real SDKs without a network.

- ``POST /v1/messages``: a non-streaming Anthropic ``message`` (``id``, ``type``, ``role``, ``model``,
  ``content`` blocks — ``text`` and ``tool_use`` —, ``stop_reason``, ``usage``).
- ``POST /v1/chat/completions``: a ``chat.completion`` whose ``choices[0].message.tool_calls`` carry the
  calls (``finish_reason: "tool_calls"``) and ``usage``.

The script is one list of ``Turn``s; each API replays it independently (the n-th request to an
endpoint gets the n-th turn; past the end, a plain text reply). Or, for conversations that run at
once, ``by_key``: the script whose key appears in a request's first user message (the task)
answers it, its turn chosen by how many assistant messages the request carries, so
each conversation replays its own script whatever the interleaving. A ``Call`` whose ``args`` is a
string is sent as such (OpenAI: raw ``arguments``, to script malformed JSON); a ``Turn``'s ``before`` runs
before it is sent (a test's hold). Tool-call ids are deterministic:
``toolu_<turn>_<j>`` (Anthropic) and ``call_<turn>_<j>`` (OpenAI). Every request is recorded
(path, headers, JSON body) so a test can check what the SDK sent back.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Call:
    name: str
    args: dict | str


@dataclass(frozen=True)
class Turn:
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    # Called (in the server's thread for the request) before the turn is sent: a test holds a reply
    # there until something else has happened, to fix the order of conversations that run at once.
    before: Callable[[], object] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Fail:
    """An API error reply in place of a turn: ``status`` with the provider's error body (401 a wrong key,
    404 a model the server does not know, 429 a rate limit, 529/503 overloaded)."""

    status: int
    kind: str  # the error type, e.g. "rate_limit_error"
    message: str


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict


class ScriptedServer:
    """``with ScriptedServer(turns) as srv:`` — ``srv.url`` is the root (Anthropic's base URL);
    ``srv.openai_url`` ends in ``/v1``."""

    def __init__(self, turns: list[Turn] = (), by_key: dict[str, list[Turn] | Fail] | None = None,
                 fail: Fail | None = None):
        """``fail``: answer every request with that error; a ``by_key`` value may be a `Fail` too."""
        self.turns = list(turns)
        self.by_key = dict(by_key or {})
        self.fail = fail
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def bodies(self, path: str) -> list[dict]:
        return [r.body for r in self.requests if r.path == path]

    # --- replies ---------------------------------------------------------------------------------

    def _next(self, path: str, body: dict, headers: dict[str, str]) -> int:
        with self._lock:
            n = sum(1 for r in self.requests if r.path == path)
            self.requests.append(Recorded(path, headers, body))
            return n

    def keyed(self, body: dict) -> list[Turn] | Fail | None:
        """The ``by_key`` value whose key appears in ``body``'s first user message (the task)."""
        task = next((m for m in body.get("messages", []) if m.get("role") == "user"), {})
        head = json.dumps(task.get("content", ""))
        return next((v for k, v in self.by_key.items() if k in head), None)

    def failure(self, body: dict) -> Fail | None:
        """The error this request gets instead of a turn, if any."""
        script = self.keyed(body)
        return self.fail or (script if isinstance(script, Fail) else None)

    def turn(self, n: int, body: dict) -> Turn:
        """The turn answering request ``n`` (sequential mode) or ``body``'s conversation (keyed mode)."""
        turns = self.turns
        if self.by_key:
            script = self.keyed(body)
            turns = script if isinstance(script, list) else []
            n = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        turn = turns[n] if n < len(turns) else Turn(text="I have nothing more to do.")
        if turn.before is not None:
            turn.before()
        return turn

    def anthropic_reply(self, n: int, body: dict) -> dict:
        turn = self.turn(n, body)
        content: list[dict] = [{"type": "text", "text": turn.text}] if turn.text else []
        content += [{"type": "tool_use", "id": f"toolu_{n}_{j}", "name": c.name, "input": c.args}
                    for j, c in enumerate(turn.calls)]
        return {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": body.get("model", ""),
                "content": content, "stop_reason": "tool_use" if turn.calls else "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 100 + n, "output_tokens": 10 + n}}

    def openai_reply(self, n: int, body: dict) -> dict:
        turn = self.turn(n, body)
        message: dict = {"role": "assistant", "content": turn.text or None, "refusal": None}
        if turn.calls:
            message["tool_calls"] = [{"id": f"call_{n}_{j}", "type": "function",
                                      "function": {"name": c.name,
                                                   "arguments": c.args if isinstance(c.args, str) else json.dumps(c.args)}}
                                     for j, c in enumerate(turn.calls)]
        return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1_700_000_000 + n,
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if turn.calls else "stop"}],
                "usage": {"prompt_tokens": 100 + n, "completion_tokens": 10 + n, "total_tokens": 110 + 2 * n}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("request-id", "req_test")
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON"}})
                    return
                path = self.path.split("?", 1)[0]
                headers = {k.lower(): v for k, v in self.headers.items()}
                if path in ("/v1/messages", "/v1/chat/completions") and (fail := server.failure(body)):
                    server._next(path, body, headers)
                    self._send(fail.status, {"type": "error", "error": {"type": fail.kind, "message": fail.message,
                                                                        "code": fail.kind}})
                elif path == "/v1/messages":
                    self._send(200, server.anthropic_reply(server._next(path, body, headers), body))
                elif path == "/v1/chat/completions":
                    self._send(200, server.openai_reply(server._next(path, body, headers), body))
                else:
                    server._next(path, body, headers)
                    self._send(404, {"error": {"type": "not_found_error", "message": f"no route {path}"}})

        return Handler
