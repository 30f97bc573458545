"""The OpenAI Agents SDK's runner drives a `SandboxAgent` on Warden's own sandbox client
(`warden_cells.openai_agents`), on a cell over a host project, with a scripted model: the
agent's command is held by the policy until it is approved, its file stays in the cell's layer
until the review, and the apply writes exactly what was reviewed. Run by tests/frameworks.rs."""

import asyncio
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))

from model_server import ScriptedModel  # noqa: E402

from agents import Runner, RunConfig, set_tracing_disabled  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402
from agents.run_config import SandboxRunConfig  # noqa: E402
from agents.sandbox import SandboxAgent  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from warden_cells import Warden  # noqa: E402
from warden_cells.openai_agents import WardenSandboxClient, WardenSandboxClientOptions  # noqa: E402

POLICY = "version: 1\ncommands:\n  ask: ['*make release*']\napprovals:\n  timeout: 60s\n"


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


async def main():
    project, marker = os.environ["WORKSPACE"], os.environ["MARKER"]
    model = ScriptedModel([
        ("call", "exec_command", {"cmd": f"echo '# {marker}' > NOTES.md; echo make release"}),
        ("text", "Notes written."),
    ]).start()
    set_tracing_disabled(True)
    agent = SandboxAgent(
        name="builder", instructions="Work in the workspace.",
        model=OpenAIResponsesModel(model="scripted-model",
                                   openai_client=AsyncOpenAI(base_url=model.base_url,
                                                             api_key="scripted")))
    w = Warden()
    client = WardenSandboxClient(w)
    session = await client.create(options=WardenSandboxClientOptions(workspace=project,
                                                                      policy=POLICY))
    cell = session._inner.cell
    answered = threading.Event()

    def approve():
        pending = w.approvals.wait(cell.name, timeout=30)
        check("make release" in pending.approval.request, f"held: {pending}")
        pending.approve()
        answered.set()

    approver = threading.Thread(target=approve)
    approver.start()
    async with session:
        result = await Runner.run(agent, "Write the notes.",
                                  run_config=RunConfig(sandbox=SandboxRunConfig(session=session)))
    approver.join(30)
    check(answered.is_set(), "the held command was answered")
    check(result.final_output == "Notes written.", f"final output {result.final_output!r}")
    check(not os.path.exists(os.path.join(project, "NOTES.md")), "nothing reached the project yet")
    diff = cell.diff()
    check([c["path"] for c in diff["changes"]] == ["NOTES.md"], f"the review: {diff['changes']}")
    cell.apply(digest=diff["digest"])
    with open(os.path.join(project, "NOTES.md")) as f:
        check(f.read() == f"# {marker}\n", "the apply wrote what was reviewed")
    await client.delete(session)
    model.stop()
    print("sandbox", cell.name)
    print("ok")


asyncio.run(main())
