"""Inside a cell: the official `openai` package speaks HTTPS to the model API itself (as a
coding agent does to its provider), through the gateway's proxy, with the placeholder key the
cell holds; the gateway opens the TLS (the destination binds a credential) and reads each call.
Prints what it got, for the test to check."""

import os
import sys

from openai import OpenAI

client = OpenAI(base_url="https://127.0.0.2:%s/v1" % os.environ["UPSTREAM_PORT"], max_retries=0)
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
except Exception as err:  # the budget is spent, off the route as well
    print("third:", type(err).__name__, getattr(err, "status_code", None), err)
print("key in the cell:", os.environ.get("OPENAI_API_KEY"))
sys.stdout.flush()
