"""deepagents on Warden's own backend (`warden_cells.deepagents.WardenSandbox`), through the
SDK's example (`sdk/python/examples/deepagents_review.py`) with a scripted model: a command the
policy holds is approved while the agent waits, the agent's file stays in the cell until the
review, and the apply writes exactly what was reviewed. Run by tests/frameworks.rs."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from model_server import ScriptedModel  # noqa: E402

import deepagents_review  # noqa: E402  (the example, from sdk/python/examples)
from langchain_openai import ChatOpenAI  # noqa: E402


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


project = os.environ["WORKSPACE"]
marker = os.environ["MARKER"]
model = ScriptedModel([
    ("call", "execute", {"command": f"pip install --no-index nothing-at-all; echo {marker}-ran"}),
    ("call", "write_file", {"file_path": "/workspace/README.md", "content": f"# {marker}\n"}),
    ("text", "Done."),
]).start()
seen = {}


def review(diff):
    seen["paths"] = [c.get("path") for c in diff["changes"]]
    seen["on_host_before"] = os.path.exists(os.path.join(project, "README.md"))
    return True


cell, result, diff, report = deepagents_review.main(
    project, ChatOpenAI(model="scripted-model", base_url=model.base_url, api_key="scripted"),
    review=review)
model.stop()
check(result["messages"][-1].content == "Done.", f"last message {result['messages'][-1]}")
outputs = " ".join(str(o) for o in model.tool_outputs())
check(f"{marker}-ran" in outputs, f"the approved command ran: {outputs!r}")
check(seen.get("paths") == ["README.md"], f"the review saw the agent's file: {seen}")
check(seen.get("on_host_before") is False, "nothing reached the project before the apply")
with open(os.path.join(project, "README.md")) as f:
    check(f.read() == f"# {marker}\n", "the apply wrote what was reviewed")
print("sandbox", cell.name)
print("ok")
