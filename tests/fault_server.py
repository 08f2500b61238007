"""A loopback OpenAI-compatible chat server that fails on purpose, deterministically.

    python tests/fault_server.py [--seed 0] [--stall 2.0] [--delay 0]   # prints "port N", serves forever

Each distinct request body gets, from a hash of it and the seed, a number of faulty
attempts (0-3) before it is answered: HTTP 500, HTTP 429, a stall past the client's
timeout, or a dropped connection. The answer itself depends only on the messages, so a
request answers the same whenever it finally gets through, and an interrupted job must end
with exactly what an uninterrupted one writes. Every seventh conversation is "cut by
max_tokens" (finish_reason "length").

A last user message that contains `HOSTILE:<kind>` gets, every time, an answer that is not
a usable completion: `bad-utf8` (a body that is not UTF-8), `array` (a JSON array),
`choices-string`, `usage-text` (non-numeric token counts), `surrogate` (a lone surrogate
in the content), `trickle` (a valid answer sent one byte per second), `huge` (5 MB of
content), or `think` (a valid answer with `reasoning_content` and `tool_calls`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("500", "429", "stall", "drop")


def answer(messages: list[dict]) -> tuple[str, str]:
    h = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    text = f"target says {h[:10]} to: {last[:40]}"
    return text, "length" if int(h[:6], 16) % 7 == 0 else "stop"


def make_handler(seed: int, stall: float, delay: float = 0.0):
    attempts: dict[str, int] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            req = json.loads(body)
            last = next(
                (m.get("content") or "" for m in reversed(req["messages"]) if m["role"] == "user"),
                "",
            )
            if "HOSTILE:" in last:  # the same hostile answer every time, no injected faults first
                return self._hostile(last.split("HOSTILE:")[1].split()[0], req)
            key = hashlib.sha256(body + str(seed).encode()).hexdigest()
            with lock:
                n = attempts.get(key, 0)
                attempts[key] = n + 1
            faulty = int(key[:4], 16) % 4  # attempts that fail before this request succeeds
            if n < faulty:
                kind = FAULTS[(int(key[4:8], 16) + n) % len(FAULTS)]
                if kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if kind == "stall":
                    time.sleep(stall)
                    return self._send(503, {"error": "stalled"})
                return self._send(int(kind), {"error": f"injected {kind}"})
            text, finish = answer(req["messages"])
            time.sleep(delay)  # the time a real target takes to answer
            self._send(200, {
                "id": f"chatcmpl-{key[:8]}", "object": "chat.completion", "model": req["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(json.dumps(req["messages"])) // 4, "completion_tokens": len(text.split())},
            })  # fmt: skip

        def _hostile(self, kind: str, req: dict) -> None:
            good = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                                 "finish_reason": "stop"}], "model": req["model"],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1}}  # fmt: skip
            if kind == "bad-utf8":
                return self._raw(200, b'{"choices": [{"message": {"content": "\xff\xfe"}}]}')
            if kind == "array":
                return self._raw(200, b"[1, 2, 3]")
            if kind == "choices-string":
                return self._raw(200, b'{"choices": "none"}')
            if kind == "usage-text":
                good["usage"]["completion_tokens"] = "many"
                return self._send(200, good)
            if kind == "surrogate":
                return self._raw(200, b'{"choices": [{"message": {"content": "a\\ud800b"}}]}')
            if kind == "huge":
                good["choices"][0]["message"]["content"] = "x" * (5 << 20)
                return self._send(200, good)
            if kind == "think":
                good["choices"][0]["message"].update(
                    reasoning_content="let me think", content="",
                    tool_calls=[{"id": "c1", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a": 1}'}}])  # fmt: skip
                return self._send(200, good)
            if kind == "trickle":
                data = json.dumps(good).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(1.0)
                except OSError:
                    pass
                return None
            raise ValueError(kind)

        def _raw(self, code: int, data: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except OSError:
                pass

        def _send(self, code: int, obj: dict) -> None:
            self._raw(code, json.dumps(obj).encode())

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall", type=float, default=2.0)
    ap.add_argument("--delay", type=float, default=0.0, help="Seconds before each answer.")
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(args.seed, args.stall, args.delay))
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
