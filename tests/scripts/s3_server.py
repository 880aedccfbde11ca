"""A local S3 endpoint for the object-storage tests: a logging, fault-injecting proxy in front of a real S3
server (``--upstream``: the SeaweedFS of ``tests/seaweedfs.py``), served on 127.0.0.1 by werkzeug; without
``--upstream``, moto's server app stands in for the server.

Run by ``tests/s3_endpoint.py``::

    python tests/scripts/s3_server.py [--upstream http://127.0.0.1:PORT] [--log FILE]

prints ``{"port": N}`` on stdout once it accepts connections, then serves until killed. Requests go upstream
byte for byte (path, query, headers, Host included, so SigV4 signatures made for this endpoint verify there).

Control requests (never logged, never failed):
  ``POST /__inject__``  JSON ``{"status": 503, "count": 3, "method": "GET", "match": "substring of the path",
                        "bucket": "name", "query": "partNumber", "code": "SlowDown", "truncate": 1000,
                        "after": true}``: the next ``count`` matching requests fail with ``status`` (an S3
                        XML error with ``code``); with ``after`` only once the request has taken effect (a
                        lost answer); with ``truncate`` they get the real answer cut off after that many
                        body bytes and the connection closed.
  ``GET /__log__``      every request so far, one JSON object per line: method, bucket, key, path, query
                        (parameter names), range, if_match, if_none_match, status, injected.
  ``POST /__reset_log__`` clears the log and the pending injections.
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional
from urllib.parse import parse_qsl, unquote

_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by the test '
          'endpoint</Message><RequestId>injected</RequestId></Error>')
_CODES = {500: "InternalError", 502: "BadGateway", 503: "SlowDown", 504: "GatewayTimeout", 403: "AccessDenied",
          404: "NoSuchKey", 412: "PreconditionFailed"}


class Middleware:
    """Logs every S3 request and fails the ones an injection rule matches."""

    def __init__(self, app: Callable, log_path: Optional[str]) -> None:
        self.app = app
        self.log_path = log_path
        self.lock = threading.Lock()
        self.entries: List[Dict[str, Any]] = []
        self.rules: List[Dict[str, Any]] = []

    def _control(self, environ: Dict[str, Any], start_response: Callable) -> Optional[Iterable[bytes]]:
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path == "/__inject__" and method == "POST":
            rule = json.loads(self._body(environ) or b"{}")
            rule["count"] = int(rule.get("count", 1))
            with self.lock:
                self.rules.append(rule)
            return self._reply(start_response, "200 OK", b"{}")
        if path == "/__log__" and method == "GET":
            with self.lock:
                data = "".join(json.dumps(e) + "\n" for e in self.entries).encode()
            return self._reply(start_response, "200 OK", data)
        if path == "/__reset_log__" and method == "POST":
            with self.lock:
                self.entries.clear()
                self.rules.clear()
            return self._reply(start_response, "200 OK", b"{}")
        return None

    @staticmethod
    def _body(environ: Dict[str, Any]) -> bytes:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        return environ["wsgi.input"].read(length) if length else b""

    @staticmethod
    def _reply(start_response: Callable, status: str, body: bytes, ctype: str = "application/json") -> List[bytes]:
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def _match(self, entry: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        with self.lock:
            for rule in self.rules:
                if rule["count"] <= 0:
                    continue
                if rule.get("method") and rule["method"] != entry["method"]:
                    continue
                if rule.get("bucket") and rule["bucket"] != entry["bucket"]:
                    continue
                if rule.get("match") and rule["match"] not in entry["path"]:
                    continue
                if rule.get("query") and rule["query"] not in entry["query"]:
                    continue
                rule["count"] -= 1
                return dict(rule)
        return None

    def _record(self, entry: Dict[str, Any]) -> None:
        line = json.dumps(entry)
        with self.lock:
            self.entries.append(entry)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")

    def __call__(self, environ: Dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        control = self._control(environ, start_response)
        if control is not None:
            return control
        path = environ.get("PATH_INFO", "")
        bucket, _, key = path.lstrip("/").partition("/")
        query = sorted({k for k, _ in parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)})
        entry: Dict[str, Any] = {
            "method": environ["REQUEST_METHOD"], "bucket": unquote(bucket), "key": unquote(key), "path": path,
            "query": query, "range": environ.get("HTTP_RANGE"), "if_match": environ.get("HTTP_IF_MATCH"),
            "if_none_match": environ.get("HTTP_IF_NONE_MATCH"), "status": None, "injected": False}
        rule = self._match(entry)
        if rule is not None and rule.get("after"):  # the request takes effect, its answer is lost
            environ["wsgi.input"] = io.BytesIO(self._body(environ))
            environ["CONTENT_LENGTH"] = str(len(environ["wsgi.input"].getvalue()))
            result = self.app(environ, lambda status, headers, exc_info=None: lambda data: None)
            for _ in result:
                pass
            if hasattr(result, "close"):
                result.close()
        if rule is not None and not rule.get("truncate"):
            if not rule.get("after"):
                self._body(environ)  # drain the request body before answering
            status = int(rule.get("status", 503))
            entry.update(status=status, injected=True)
            self._record(entry)
            code = rule.get("code") or _CODES.get(status, "InternalError")
            body = _ERROR.format(code=code).encode()
            return self._reply(start_response, f"{status} Injected", body, "application/xml")

        def logging_start_response(status: str, headers: List, exc_info: Any = None) -> Callable:
            entry["status"] = int(status.split()[0])
            entry["injected"] = bool(rule)
            self._record(entry)  # before the client can see the answer
            return start_response(status, headers, exc_info)

        result = self.app(environ, logging_start_response)
        if rule is not None:
            return self._truncated(result, int(rule["truncate"]), environ.get("werkzeug.socket"))
        return result

    @staticmethod
    def _truncated(result: Iterable[bytes], limit: int, sock: Optional[socket.socket]) -> Iterable[bytes]:
        """Send only ``limit`` body bytes, then cut the connection (a dropped download)."""
        sent = 0
        for chunk in result:
            if sent + len(chunk) >= limit:
                yield chunk[:limit - sent]
                break
            sent += len(chunk)
            yield chunk
        if hasattr(result, "close"):
            result.close()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "expect"}


class Proxy:
    """A WSGI app that forwards each request to ``upstream`` over a persistent connection per thread."""

    def __init__(self, upstream: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.local = threading.local()

    def _conn(self) -> "http.client.HTTPConnection":
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        return conn

    def _drop(self) -> None:
        conn = getattr(self.local, "conn", None)
        self.local.conn = None
        if conn is not None:
            conn.close()

    def __call__(self, environ: Dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        target = environ.get("RAW_URI") or environ.get("PATH_INFO", "/")
        if environ.get("CONTENT_LENGTH"):
            body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        elif environ.get("wsgi.input_terminated"):  # chunked request body, already de-chunked by werkzeug
            body = environ["wsgi.input"].read()
        else:
            body = b""
        headers = []
        for name, value in environ.items():
            if name.startswith("HTTP_"):
                header = name[5:].replace("_", "-").lower()
                if header not in _HOP_BY_HOP and header != "content-length":
                    headers.append((header, value))
        if environ.get("CONTENT_TYPE"):
            headers.append(("content-type", environ["CONTENT_TYPE"]))
        if body or method in ("PUT", "POST"):
            headers.append(("content-length", str(len(body))))
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more on a fresh one
            conn = self._conn()
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                conn.endheaders(body or None)
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException):
                self._drop()
                if attempt:
                    raise
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        start_response(f"{resp.status} {resp.reason}", out)
        return _Body(self, conn, resp)


class _Body:
    """The upstream answer's body as a WSGI iterable; closed early (a truncated answer), it drops the
    connection, whose unread rest would otherwise be read as the next answer."""

    def __init__(self, proxy: Proxy, conn: "http.client.HTTPConnection", resp: "http.client.HTTPResponse") -> None:
        self.proxy, self.conn, self.resp = proxy, conn, resp

    def __iter__(self) -> Iterable[bytes]:
        while True:
            chunk = self.resp.read1(1 << 20) if not self.resp.isclosed() else b""
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        if not self.resp.isclosed() or self.resp.will_close:
            if getattr(self.proxy.local, "conn", None) is self.conn:
                self.proxy._drop()
            else:
                self.conn.close()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", default=None, help="also append the request log to this file")
    parser.add_argument("--upstream", default=None, help="the S3 server to forward to (default: moto in-process)")
    args = parser.parse_args(argv)
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on stderr
    if args.upstream:
        app = Middleware(Proxy(args.upstream), args.log)
        server = make_server("127.0.0.1", 0, app, threaded=True)
    else:
        server = _moto_server(args.log)
    sys.stdout.write(json.dumps({"port": server.server_address[1]}) + "\n")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def _moto_server(log: Optional[str]) -> Any:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["MOTO_ALLOW_NONEXISTENT_REGION"] = "true"
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = Middleware(DomainDispatcherApplication(create_backend_app), log)
    return make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
