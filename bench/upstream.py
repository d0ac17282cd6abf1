"""A fast OpenAI-compatible upstream for benchmarks and fault tests: canned completions shaped like
vLLM's (token ids, prompt token ids, per-token logprobs, the version in ``X-Flywheel-Model-Version``),
served by a bare asyncio HTTP/1.1 server so that it costs as little CPU as possible.

It answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain or ``stream: true``;
a chat request that offers ``tools`` gets a call to the first one, as a tool-parsing server returns
it; ``n`` choices, each the canned completion, a stream interleaving them token by token as vLLM
does), and ``GET /v1/models``; ``delay_ms`` holds every completion that long (a model's decode time).
Every response is a fresh ``id``; the payload sizes follow ``prompt_tokens`` / ``completion_tokens``.

Run it alone: ``python -m bench.upstream --port 9100 --delay-ms 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

MODEL = "tiny-sim"


class CannedUpstream:
    def __init__(self, *, delay_ms: float = 0.0, version: int = 1, prompt_tokens: int = 96,
                 completion_tokens: int = 32) -> None:
        self.delay_s = delay_ms / 1000.0
        self.version = version
        self.prompt_ids = [(7 * i) % 500 + 4 for i in range(prompt_tokens)]
        self.token_ids = [(11 * i) % 500 + 4 for i in range(completion_tokens)]
        self.logprobs = [-0.25 - (i % 7) * 0.125 for i in range(completion_tokens)]
        self.text = " ".join(f"w{t}" for t in self.token_ids)
        self._ids = itertools.count()
        self.received = 0  # requests that reached a handler (before any delay)
        self.served = 0
        self.last_request: dict = {}

    # Bodies --------------------------------------------------------------------------------------

    def tool_call(self, request: dict) -> dict | None:
        """The call a tool-parsing server (vLLM ``--tool-call-parser``) returns when the request
        offers tools: the first function, with fixed arguments."""
        tools = request.get("tools")
        if not tools or not isinstance(tools, list) or request.get("tool_choice") == "none":
            return None
        name = (tools[0].get("function") or {}).get("name", "tool") if isinstance(tools[0], dict) else "tool"
        return {"id": f"call-{next(self._ids)}", "type": "function",
                "function": {"name": name, "arguments": '{"letters": "q w e"}'}}

    def chat(self, call: dict | None = None, n: int = 1) -> dict:
        body = self._chat(n)
        if call is not None:
            for choice in body["choices"]:
                choice["finish_reason"] = "tool_calls"
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        return body

    def _chat(self, n: int) -> dict:
        return {
            "id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": 0, "model": MODEL,
            "model_version": self.version, "prompt_token_ids": self.prompt_ids,
            "choices": [{
                "index": index, "finish_reason": "stop", "token_ids": self.token_ids,
                "message": {"role": "assistant", "content": self.text},
                "logprobs": {"content": [{"token": f"w{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                         for t, lp in zip(self.token_ids, self.logprobs)]},
            } for index in range(n)],
            "usage": self.usage(n),
        }

    def text_completion(self, n: int = 1) -> dict:
        return {
            "id": f"cmpl-{next(self._ids)}", "object": "text_completion", "created": 0, "model": MODEL,
            "model_version": self.version,
            "choices": [{
                "index": index, "finish_reason": "stop", "text": self.text, "token_ids": self.token_ids,
                "prompt_token_ids": self.prompt_ids,
                "logprobs": {"tokens": [f"w{t}" for t in self.token_ids], "token_logprobs": self.logprobs},
            } for index in range(n)],
            "usage": self.usage(n),
        }

    def usage(self, n: int = 1) -> dict:
        prompt, completion = len(self.prompt_ids), n * len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunks(self, chat: bool, call: dict | None = None, n: int = 1) -> Iterator[dict]:
        """A stream as vLLM sends it: prompt ids first, a token per chunk (the ``n`` choices' chunks
        interleaved), finish, then usage; with a tool ``call``, its name on the first chunk and its
        arguments spread over the others."""
        base = {"id": f"chatcmpl-{next(self._ids)}", "created": 0, "model": MODEL, "model_version": self.version,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        for i, (t, lp) in enumerate(zip(self.token_ids, self.logprobs)):
            last = i == len(self.token_ids) - 1
            for index in range(n):
                if chat:
                    delta: dict = {"content": f"w{t} "}
                    if call is not None:
                        args = call["function"]["arguments"]
                        part = args[i * len(args) // len(self.token_ids):(i + 1) * len(args) // len(self.token_ids)]
                        function = {"arguments": part} | ({"name": call["function"]["name"]} if i == 0 else {})
                        delta = {"tool_calls": [{"index": 0, "function": function}
                                                | ({"id": call["id"], "type": "function"} if i == 0 else {})]}
                    choice = {"index": index, "delta": delta | ({"role": "assistant"} if i == 0 else {}),
                              "logprobs": {"content": [{"token": f"w{t}", "logprob": lp, "bytes": None,
                                                        "top_logprobs": []}]}}
                else:
                    choice = {"index": index, "text": f"w{t} ",
                              "logprobs": {"tokens": [f"w{t}"], "token_logprobs": [lp]}}
                finish = ("tool_calls" if call is not None else "stop") if last else None
                choice |= {"token_ids": [t], "finish_reason": finish}
                chunk = base | {"choices": [choice]}
                if i == 0:
                    chunk["prompt_token_ids"] = self.prompt_ids
                yield chunk
        yield base | {"choices": [], "usage": self.usage(n)}

    # HTTP ----------------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                await self.respond(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        headers = {"X-Flywheel-Model-Version": str(self.version), "X-Flywheel-Node": "canned"}
        if method == "GET" and path == "/v1/models":
            return self.send(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}, headers)
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return self.send(writer, 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}})
        try:
            request = json.loads(body)
        except ValueError:
            return self.send(writer, 400, {"error": {"message": "bad JSON", "type": "invalid_request_error"}})
        self.received += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.served += 1
        self.last_request = request
        chat = path == "/v1/chat/completions"
        call = self.tool_call(request) if chat else None
        n = request["n"] if type(request.get("n")) is int and request["n"] > 0 else 1
        if request.get("stream"):
            head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(head.encode() + b"\r\n")
            for chunk in self.chunks(chat, call, n):
                writer.write(_chunked(b"data: " + json.dumps(chunk).encode() + b"\n\n"))
            writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return None
        return self.send(writer, 200, self.chat(call, n) if chat else self.text_completion(n), headers)

    @staticmethod
    def send(writer: asyncio.StreamWriter, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(head.encode() + b"\r\n" + data)

    async def serve(self, host: str, port: int, started: threading.Event | None = None,
                    stop: asyncio.Event | None = None) -> None:
        server = await asyncio.start_server(self.handle, host, port, backlog=2048)
        if started is not None:
            started.set()
        async with server:
            if stop is None:
                await server.serve_forever()
            else:
                await stop.wait()


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@contextmanager
def running(port: int, **kwargs: float) -> Iterator[CannedUpstream]:
    """The upstream on ``127.0.0.1:port`` in a background thread (for tests)."""
    upstream = CannedUpstream(**kwargs)
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(upstream.serve("127.0.0.1", port, started, stop),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("canned upstream did not start")
    try:
        yield upstream
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(CannedUpstream(delay_ms=args.delay_ms, version=args.version).serve(args.host, args.port))


if __name__ == "__main__":
    main()
