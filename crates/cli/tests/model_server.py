"""A scripted stand-in for an LLM API (the one thing a test cannot have for real): a local HTTP
server that speaks the OpenAI Responses and Chat Completions wire formats, plain and streamed
(server-sent events), and answers each request with the next step of a script. A step is a tool call (name and JSON
arguments) or a final text; the requests it got are kept, so a test can check what the agent
sent back (a tool's output, for one).

    server = ScriptedModel([("call", "exec_command", {"cmd": "echo hi"}), ("text", "done")])
    server.start()          # server.base_url is http://127.0.0.1:PORT/v1
"""

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ids = itertools.count(1)


def _response(output, model):
    return {
        "id": f"resp_{next(_ids)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        },
    }


def _item(step):
    kind = step[0]
    if kind == "call":
        _, name, arguments = step
        n = next(_ids)
        return {
            "type": "function_call",
            "id": f"fc_{n}",
            "call_id": f"call_{n}",
            "name": name,
            "arguments": json.dumps(arguments),
            "status": "completed",
        }
    _, text = step
    return {
        "type": "message",
        "id": f"msg_{next(_ids)}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


class ScriptedModel:
    def __init__(self, script):
        self.script = list(script)
        self.requests = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                chat = self.path.endswith("/chat/completions")
                if not chat and not self.path.endswith("/responses"):
                    self.send_error(404, "only /v1/responses and /v1/chat/completions are scripted")
                    return
                with owner._lock:
                    owner.requests.append(body)
                    step = owner.script.pop(0) if owner.script else ("text", "(script ended)")
                if chat:
                    self._chat(step, body)
                    return
                response = _response([_item(step)], body.get("model", "scripted"))
                if body.get("stream"):
                    self._stream(response)
                else:
                    data = json.dumps(response).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def _chat(self, step, body):
                n = next(_ids)
                if step[0] == "call":
                    message = {"role": "assistant", "content": None, "tool_calls": [{
                        "id": f"call_{n}", "type": "function",
                        "function": {"name": step[1], "arguments": json.dumps(step[2])}}]}
                    finish = "tool_calls"
                else:
                    message = {"role": "assistant", "content": step[1]}
                    finish = "stop"
                base = {"id": f"chatcmpl-{n}", "created": int(time.time()),
                        "model": body.get("model", "scripted")}
                usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
                if not body.get("stream"):
                    data = json.dumps(dict(base, object="chat.completion", usage=usage, choices=[
                        {"index": 0, "message": message, "finish_reason": finish}])).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def chunk(delta, finish_reason=None, **extra):
                    payload = dict(base, object="chat.completion.chunk", choices=[
                        {"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra)
                    self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                    self.wfile.flush()

                chunk({"role": "assistant", "content": ""})
                if finish == "tool_calls":
                    call = message["tool_calls"][0]
                    chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"],
                                                        "arguments": ""}}]})
                    chunk({"tool_calls": [{"index": 0, "function": {
                        "arguments": call["function"]["arguments"]}}]})
                else:
                    text = message["content"]
                    for piece in [text[i:i + 8] for i in range(0, len(text), 8)]:
                        chunk({"content": piece})
                chunk({}, finish)
                if (body.get("stream_options") or {}).get("include_usage"):
                    payload = dict(base, object="chat.completion.chunk", choices=[], usage=usage)
                    self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _stream(self, response):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                seq = itertools.count()

                def event(kind, **fields):
                    payload = {"type": kind, "sequence_number": next(seq), **fields}
                    self.wfile.write(f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode())
                    self.wfile.flush()

                started = dict(response, status="in_progress", output=[])
                event("response.created", response=started)
                for index, item in enumerate(response["output"]):
                    event("response.output_item.added", output_index=index,
                          item=dict(item, status="in_progress"))
                    if item["type"] == "message":
                        text = item["content"][0]["text"]
                        for piece in [text[i:i + 8] for i in range(0, len(text), 8)]:
                            event("response.output_text.delta", item_id=item["id"],
                                  output_index=index, content_index=0, delta=piece,
                                  logprobs=[])
                        event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text, logprobs=[])
                    else:
                        event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
                        event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=item["arguments"],
                              name=item["name"])
                    event("response.output_item.done", output_index=index, item=item)
                event("response.completed", response=response)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self._server.shutdown()

    def tool_outputs(self):
        """Every tool output the agent sent back (Responses' `function_call_output` items, Chat
        Completions' `tool` messages), in order."""
        out = []
        for request in self.requests:
            items = request.get("input")
            if isinstance(items, list):
                out += [i.get("output") for i in items
                        if isinstance(i, dict) and i.get("type") == "function_call_output"]
            for message in request.get("messages") or []:
                if isinstance(message, dict) and message.get("role") == "tool":
                    out.append(message.get("content"))
        return out
