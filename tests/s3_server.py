"""A real S3 endpoint on the loopback interface for the tests: moto's server in a thread, behind
a small proxy that injects the faults of a hostile store (503 SlowDown, a body cut short) on
the requests whose path holds a given text. Fake credentials; nothing leaves 127.0.0.1."""

import http.client
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faults:
    """Rules the proxy applies: [(method, text in the path, kind, times left)]; kind "503" or
    "cut" (headers with the full length, then half the body and a closed connection). A
    negative count: always. `seen` counts the requests per method, `served` the body bytes
    answered per method."""

    def __init__(self):
        self.rules, self.lock, self.seen, self.served = [], threading.Lock(), {}, {}

    def count(self, method: str, nbytes: int) -> None:
        with self.lock:
            self.served[method] = self.served.get(method, 0) + nbytes

    def add(self, method: str, text: str, kind: str, times: int = -1) -> None:
        with self.lock:
            self.rules.append([method, text, kind, times])

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def take(self, method: str, path: str):
        with self.lock:
            self.seen[method] = self.seen.get(method, 0) + 1
            for rule in self.rules:
                if rule[0] == method and rule[1] in path and rule[3] != 0:
                    rule[3] -= 1
                    return rule[2]
        return None


def _handler(upstream_port: int, faults: Faults):
    local = threading.local()  # one connection to moto per proxy thread, kept

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _forward(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            fault = faults.take(self.command, self.path)
            if fault == "503":
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn = getattr(local, "conn", None)
            try:
                if conn is None:
                    raise ConnectionError
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
            except (ConnectionError, http.client.HTTPException, OSError):
                local.conn = conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
            data = r.read()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(k, v)
            self.send_header("Content-Length", r.getheader("Content-Length", "0") if self.command == "HEAD"
                             else str(len(data)))
            self.end_headers()
            if fault == "cut" and self.command == "GET" and len(data) > 1:
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if self.command != "HEAD":
                self.wfile.write(data)
                faults.count(self.command, len(data))

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Proxy


@contextmanager
def s3_endpoint():
    """(endpoint URL, Faults, environment for clients) of a fresh moto server behind the proxy;
    UCP_TEST_MOTO_URL in the environment: moto itself, for the tests' own quick changes."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    moto_port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    server.start()
    faults = Faults()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler(moto_port, faults))
    proxy.daemon_threads = True
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
           "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "UCP_S3_MAX_ATTEMPTS": "3"}
    try:
        yield url, faults, dict(env, UCP_TEST_MOTO_URL=f"http://127.0.0.1:{moto_port}")
    finally:
        proxy.shutdown()
        proxy.server_close()
        server.stop()
