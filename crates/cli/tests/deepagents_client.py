"""LangChain's deepagents with its E2B backend (`langchain-e2b`, unmodified) on a sandbox of
Warden's E2B-compatible API, pointed at it by E2B's environment variables: the agent graph,
with a scripted chat model (model_server.py, Chat Completions), writes a file with its
`write_file` tool and runs a command with its `execute` tool, both in a cell. Run by
tests/frameworks.rs: `python3 deepagents_client.py`. Prints the sandbox's id and `ok`."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from model_server import ScriptedModel  # noqa: E402

import e2b  # noqa: E402
from deepagents import create_deep_agent  # noqa: E402
from langchain_e2b import E2BSandbox  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def main():
    marker = os.environ["MARKER"]
    model = ScriptedModel([
        ("call", "write_file", {"file_path": "/home/user/plan.txt", "content": f"{marker}\n"}),
        ("call", "execute", {"command": "cat /home/user/plan.txt; echo ran-in $(pwd)"}),
        ("text", "Done."),
    ]).start()
    sandbox = e2b.Sandbox.create()
    try:
        agent = create_deep_agent(
            model=ChatOpenAI(model="scripted-model", base_url=model.base_url, api_key="scripted"),
            backend=E2BSandbox(sandbox=sandbox),
            system_prompt="Do what you are asked in the sandbox.",
        )
        result = agent.invoke({"messages": [{"role": "user", "content": "Write the plan."}]})
        check(result["messages"][-1].content == "Done.", f"last message {result['messages'][-1]}")
        outputs = " ".join(str(o) for o in model.tool_outputs())
        check(f"{marker}" in outputs and "ran-in /home/user" in outputs,
              f"the tools' outputs went back to the model: {outputs!r}")
        check(sandbox.files.read("/home/user/plan.txt").strip() == marker, "the file is there")
        print("sandbox", sandbox.sandbox_id)
    finally:
        sandbox.kill()
        model.stop()
    print("ok")


main()
