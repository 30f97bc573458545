"""Inside a cell: the official `openai` package talks to the model API at the warden's fixed
name, through the gateway (the proxy variables the cell was given), with the placeholder key
the cell holds; prints what it got and what it holds, for the test to check."""

import os
import sys

from openai import OpenAI

client = OpenAI(base_url="http://inference.warden")
first = client.chat.completions.create(
    model="scripted-1",
    messages=[{"role": "user", "content": "say hello"}],
    stream=True,
    stream_options={"include_usage": True},
)
text = "".join(c.choices[0].delta.content or "" for c in first if c.choices)
print("streamed:", text)
second = client.responses.create(model="scripted-1", input="and again")
print("responses:", second.output_text)
try:
    client.chat.completions.create(model="scripted-1", messages=[{"role": "user", "content": "more"}])
    print("third: answered")
except Exception as err:  # the budget is spent
    print("third:", type(err).__name__, getattr(err, "status_code", None), err)
# A tunnel to the upstream would carry requests unread and uncounted: whatever the gateway
# answers a CONNECT, a plain request sent in it never reaches the upstream (the test counts the
# upstream's requests).
import socket

tunnel = socket.create_connection(("127.0.0.1", 3128), timeout=5)
tunnel.sendall(("CONNECT 127.0.0.1:%s HTTP/1.1\r\nHost: x\r\n\r\n" % os.environ["UPSTREAM_PORT"]).encode())
first = tunnel.recv(4096)
print("tunnel:", first.split(b"\r\n")[0].decode())
if b" 200 " in first.split(b"\r\n")[0]:
    body = b'{"model":"m","messages":[]}'
    tunnel.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        print("in the tunnel:", tunnel.recv(4096)[:80])
    except OSError as err:
        print("in the tunnel:", type(err).__name__)
# Only the model APIs' endpoints below the upstream's prefix, with their methods.
import urllib.error
import urllib.request

for method, url in [
    ("GET", "http://inference.warden/../admin"),
    ("GET", "http://inference.warden/files"),
    ("POST", "http://127.0.0.1:%s/admin/chat/completions" % os.environ["UPSTREAM_PORT"]),
]:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None), timeout=10)
        print("other:", method, url, "answered")
    except urllib.error.HTTPError as err:
        print("other:", method, url, err.code)
    except urllib.error.URLError as err:  # refused before the body was read: a reset
        print("other:", method, url, "refused", err.reason)
print("key in the cell:", os.environ.get("OPENAI_API_KEY"))
sys.stdout.flush()
