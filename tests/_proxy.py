"""A TCP proxy on loopback that puts faults between a client and a real server, for the fault tests.

    proxy = FaultyProxy("127.0.0.1", server_port)   # listens on proxy.port, forwards to the server
    proxy.drop_next(2)        # the next 2 connections are accepted, then closed unanswered
    proxy.cut_next(2)         # the next 2 replies end halfway through their body
    proxy.corrupt_next(1)     # the next reply has one byte of its body flipped
    proxy.garble_next(1)      # the next reply is replaced by a bare "400 Bad Request" page
    proxy.latency = 0.5       # every reply waits this long before its first byte
    proxy.down = True         # every connection is closed unanswered, until set back
    proxy.close()

Each fault counts connections or replies, not seconds, so a test says exactly how many the client
must get through. A connection carries several requests (keep-alive): a reply's end is found
from its Content-Length, so the proxy cuts or corrupts a reply, not a connection. It speaks
HTTP/1.1 with Content-Length bodies only (what S3 servers send for these calls); anything else is
passed through untouched. Written here: the proxies on PyPI (toxiproxy needs its own server
binary; mitmproxy is a large dependency for a test) do not fit a test that starts in milliseconds.
"""

from __future__ import annotations

import socket
import threading


class FaultyProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.latency = 0.0
        self.down = False
        self.faults_done = {"dropped": 0, "cut": 0, "corrupted": 0, "garbled": 0}
        self._to_drop = self._to_cut = self._to_corrupt = self._to_garble = 0
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next(self, n: int) -> None:
        self._add("_to_drop", n)

    def cut_next(self, n: int) -> None:
        self._add("_to_cut", n)

    def corrupt_next(self, n: int) -> None:
        self._add("_to_corrupt", n)

    def garble_next(self, n: int) -> None:
        self._add("_to_garble", n)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _add(self, name: str, n: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def _take(self, name: str) -> bool:
        with self._lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
            return left > 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down or self._take("_to_drop"):
                self.faults_done["dropped"] += 1
                client.shutdown(socket.SHUT_RDWR)
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        methods: list[bytes] = []  # of the requests sent on, in order: a HEAD's reply has no body
        threading.Thread(target=_requests, args=(client, server, methods), daemon=True).start()
        try:
            self._replies(server, client, methods)
        finally:
            for s in (client, server):  # shutdown first: the other thread's makefile keeps the fd open
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _replies(self, server: socket.socket, client: socket.socket, methods: list) -> None:
        """Forward the server's replies one at a time, each possibly delayed, cut or corrupted."""
        reader = server.makefile("rb")
        while (head := _read_head(reader)) is not None:
            if head.startswith(b"HTTP/1.1 100"):
                client.sendall(head)
                continue
            method = methods.pop(0) if methods else b"GET"
            status = int(head.split(None, 2)[1])
            length = 0 if method == b"HEAD" or status in (204, 304) else _content_length(head)
            body = reader.read(length) if length else b""
            if self.latency:
                threading.Event().wait(self.latency)
            if self.down:
                return
            if self._take("_to_garble"):  # what Go's HTTP server answers to a request it cannot parse
                self.faults_done["garbled"] += 1
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                               b"Connection: close\r\nContent-Length: 15\r\n\r\n400 Bad Request")
                return
            if length and self._take("_to_cut"):
                self.faults_done["cut"] += 1
                client.sendall(head + body[: length // 2])
                return  # the connection closes mid-body
            if length and self._take("_to_corrupt"):
                self.faults_done["corrupted"] += 1
                body = body[:-1] + bytes([body[-1] ^ 0xFF])
            client.sendall(head + body)


def _read_head(reader) -> bytes | None:
    """A message's start line and headers, through the blank line; None at the end of the stream."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline()
        if not line:
            return None
        head += line
    return head


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _requests(client: socket.socket, server: socket.socket, methods: list) -> None:
    """Forward the client's requests, noting each one's method before it goes on."""
    reader = client.makefile("rb")
    try:
        while (head := _read_head(reader)) is not None:
            methods.append(head.split(None, 1)[0])
            server.sendall(head)
            left = _content_length(head)
            while left > 0:
                data = reader.read1(min(left, 1 << 16))
                if not data:
                    return
                server.sendall(data)
                left -= len(data)
    except OSError:
        pass
    finally:
        try:
            server.shutdown(socket.SHUT_WR)
        except OSError:
            pass
