"""The HTTP/1.1 protocol `ft serve` runs: uvicorn's h11 protocol, but a request whose HTTP framing
uvicorn refuses before the app sees it (a malformed request line, a header section over h11's limit:
16 KiB by default) gets the API's JSON error shape, as every other 4xx does, not a plain-text body."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["JsonErrorH11Protocol", "framing_error_body"]


def framing_error_body(detail: str) -> bytes:
    """The 400 body of a request refused at the HTTP layer ({"error": {"message", "type", "code"}})."""
    message = (f"the HTTP request could not be read ({detail.rstrip('.')}): a malformed request line or "
               "header, or headers over 16 KiB")
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": 400}}).encode()


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # (uvicorn's hook for requests h11 cannot parse)
        body = framing_error_body(msg)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
