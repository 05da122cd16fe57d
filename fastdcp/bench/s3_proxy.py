"""A TCP hop in front of an S3-protocol server: ``python -m fastdcp.bench.s3_proxy``.

It forwards every connection to the server and, on the way:

* delays each direction's bytes by ``--delay-ms`` (one way), so a round trip costs twice that
  as across a network, without limiting bandwidth: each chunk is released ``delay`` after it
  arrived. This kernel has no ``netem`` qdisc (``tc qdisc add ... netem`` answers "unknown"), so
  the latency is injected here, in user space, on loopback;
* with ``--rate-mib-s``, limits the bytes it passes, both directions and every connection
  together, to that rate: a storage link of fixed bandwidth shared by every client (the
  ``read_once`` scenario's "all ranks share the storage");
* classifies every request by its S3 operation (PUT, PUT_PART, CREATE_MULTIPART,
  COMPLETE_MULTIPART, ABORT_MULTIPART, GET, HEAD, LIST, COPY, DELETE, ...) from its request line
  and headers, and counts them;
* answers chosen requests itself with an error status (``503 SlowDown`` by default) instead of
  forwarding them, to exercise clients' retries.

Control requests (never forwarded): ``GET /__proxy/stats`` (JSON counts), ``POST /__proxy/reset``,
``POST /__proxy/fault?op=PUT_PART&count=2&status=503`` (the next ``count`` requests of ``op``, or
of any operation with ``op=ANY``). Requests are parsed only to find their boundaries
(``Content-Length`` or chunked bodies); clients that pipeline requests are not supported (S3
clients do not pipeline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from urllib.parse import parse_qs, urlsplit

__all__ = ["classify", "main"]

_CHUNK = 1 << 20


def classify(method: str, target: str, headers: dict[str, str]) -> str:
    """The S3 operation of a path-style request (``/bucket/key?query``), or the S3 name of an Azure
    Blob request's operation (``/account/container/blob?comp=...``: Put Block is PUT_PART, Put Block
    List COMPLETE_MULTIPART, List Blobs LIST, Copy Blob COPY, a batch DELETE)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    if "x-ms-version" in headers:
        return _classify_azure(method, query, headers)
    path = parts.path.lstrip("/")
    bucket_only = "/" not in path.rstrip("/")
    if method == "PUT":
        if "x-amz-copy-source" in headers:
            return "COPY"
        if "partNumber" in query:
            return "PUT_PART"
        return "CREATE_BUCKET" if bucket_only else "PUT"
    if method == "POST":
        if "uploads" in query:
            return "CREATE_MULTIPART"
        if "uploadId" in query:
            return "COMPLETE_MULTIPART"
        if "delete" in query:
            return "DELETE"
        return "POST"
    if method == "DELETE":
        return "ABORT_MULTIPART" if "uploadId" in query else ("DELETE_BUCKET" if bucket_only else "DELETE")
    if method == "GET":
        if bucket_only or "uploads" in query or "list-type" in query:
            return "LIST"
        return "GET"
    if method == "HEAD":
        return "HEAD_BUCKET" if bucket_only else "HEAD"
    return method


def _classify_azure(method: str, query: dict, headers: dict[str, str]) -> str:
    comp = (query.get("comp") or [""])[0]
    if comp == "list":
        return "LIST"
    if comp == "batch":
        return "DELETE"
    if method == "PUT":
        if comp == "block":
            return "PUT_PART"
        if comp == "blocklist":
            return "COMPLETE_MULTIPART"
        if "x-ms-copy-source" in headers:
            return "COPY"
        return "CREATE_BUCKET" if (query.get("restype") or [""])[0] == "container" else "PUT"
    if method == "GET" and (query.get("restype") or [""])[0] == "container":
        return "LIST" if comp == "list" else "HEAD_BUCKET"
    return method


class _State:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes_up = 0
        self.bytes_down = 0
        self.faults: list[list] = []  # [op, remaining, status]
        self.started = time.time()
        self.rate = _Rate(0.0)

    def take_fault(self, op: str) -> int | None:
        for fault in self.faults:
            if fault[1] > 0 and fault[0] in (op, "ANY"):
                fault[1] -= 1
                return fault[2]
        return None


class _Rate:
    """A fixed rate shared by every connection: each chunk reserves its time on the link."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = time.monotonic()

    async def take(self, nbytes: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + nbytes / self.bytes_per_s
        if self.free_at > now:
            await asyncio.sleep(self.free_at - now)


class _Delayed:
    """One direction of a connection: chunks released ``delay`` seconds after they arrived."""

    def __init__(self, writer: asyncio.StreamWriter, delay: float):
        self.writer = writer
        self.delay = delay
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run())

    def send(self, data: bytes | None) -> None:
        self.queue.put_nowait((time.monotonic() + self.delay, data))

    async def _run(self) -> None:
        try:
            while True:
                due, data = await self.queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001
                pass


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The request body's bytes as they arrive (Content-Length or chunked)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.readuntil(b"\r\n")
            yield line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    yield trailer
                    if trailer == b"\r\n":
                        return
            async for data in _exactly(reader, size + 2):  # the chunk and its CRLF
                yield data
        return
    async for data in _exactly(reader, int(headers.get("content-length", "0") or 0)):
        yield data


async def _exactly(reader: asyncio.StreamReader, nbytes: int):
    """The next ``nbytes`` of the stream, as they arrive."""
    remaining = nbytes
    while remaining:
        data = await reader.read(min(_CHUNK, remaining))
        if not data:
            raise ConnectionError("client closed mid-body")
        remaining -= len(data)
        yield data


def _response(status: int, body: bytes, content_type: str = "application/xml") -> bytes:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: keep-alive\r\n\r\n").encode() + body


async def _control(state: _State, method: str, target: str) -> bytes:
    parts = urlsplit(target)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.path == "/__proxy/stats":
        body = json.dumps({"counts": dict(state.counts), "bytes_up": state.bytes_up, "bytes_down": state.bytes_down})
        return _response(200, body.encode(), "application/json")
    if parts.path == "/__proxy/reset":
        state.counts.clear()
        state.bytes_up = state.bytes_down = 0
        state.faults.clear()
        return _response(200, b"{}", "application/json")
    if parts.path == "/__proxy/fault":
        state.faults.append([query.get("op", "ANY"), int(query.get("count", "1")), int(query.get("status", "503"))])
        return _response(200, b"{}", "application/json")
    return _response(404, b"unknown control request")


async def _handle(client_reader, client_writer, upstream: tuple[str, int], delay: float, state: _State) -> None:
    up_reader = up_writer = None
    to_client = _Delayed(client_writer, delay)
    to_server: _Delayed | None = None
    pump: asyncio.Task | None = None
    try:
        while True:
            head = await _read_head(client_reader)
            if head is None:
                break
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            if target.startswith("/__proxy/"):
                async for _ in _body(client_reader, headers):
                    pass
                client_writer.write(await _control(state, method, target))  # control: no delay
                await client_writer.drain()
                continue
            op = classify(method, target, headers)
            state.counts[op] += 1
            status = state.take_fault(op)
            if status is not None:
                async for _ in _body(client_reader, headers):
                    pass
                code = "SlowDown" if status == 503 else "InternalError"
                to_client.send(_response(status, f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                                                 f"<Message>injected by the test proxy</Message></Error>".encode()))
                continue
            if up_writer is None:
                up_reader, up_writer = await asyncio.open_connection(*upstream)
                to_server = _Delayed(up_writer, delay)

                async def pump_down(reader=up_reader) -> None:
                    while True:
                        data = await reader.read(_CHUNK)
                        if not data:
                            break
                        state.bytes_down += len(data)
                        await state.rate.take(len(data))
                        to_client.send(data)
                    to_client.send(None)

                pump = asyncio.ensure_future(pump_down())
            to_server.send(head)
            async for data in _body(client_reader, headers):
                state.bytes_up += len(data)
                await state.rate.take(len(data))
                to_server.send(data)
    except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
        pass
    finally:
        if to_server is not None:
            to_server.send(None)
            try:
                await asyncio.wait_for(to_server.task, 30)
            except Exception:  # noqa: BLE001
                pass
        if pump is not None:
            try:
                await asyncio.wait_for(pump, 60)
            except Exception:  # noqa: BLE001
                pump.cancel()
        else:
            to_client.send(None)
        try:
            await asyncio.wait_for(to_client.task, 30)
        except Exception:  # noqa: BLE001
            pass


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], delay: float, rate_bytes_s: float = 0.0) -> None:
    state = _State()
    state.rate = _Rate(rate_bytes_s)
    server = await asyncio.start_server(lambda r, w: _handle(r, w, upstream, delay, state), *listen,
                                        limit=1 << 20)
    print(f"listening on {listen[0]}:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: any free port)")
    parser.add_argument("--upstream", required=True, help="host:port of the S3 server")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to each direction")
    parser.add_argument("--rate-mib-s", type=float, default=0.0,
                        help="the most MiB/s passed, both directions and all connections together (0: no limit)")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    up_host, up_port = args.upstream.rsplit(":", 1)
    asyncio.run(_serve((host, int(port)), (up_host, int(up_port)), args.delay_ms / 1000.0, args.rate_mib_s * (1 << 20)))


if __name__ == "__main__":
    main()
