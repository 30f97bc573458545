"""The OpenAI Agents SDK's own runner drives a `SandboxAgent` whose sandbox is its built-in E2B
backend (`openai-agents[e2b]`, unmodified), pointed at Warden's E2B-compatible API by E2B's
environment variables, with a scripted model (model_server.py) that has the agent run a shell
command in the sandbox. Run by tests/frameworks.rs: `python3 agents_client.py plain|stream`.
Prints the sandbox's id and `ok`; exits non-zero saying what was wrong otherwise."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from model_server import ScriptedModel  # noqa: E402

from agents import Runner, RunConfig, set_tracing_disabled  # noqa: E402
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions  # noqa: E402
from agents.models.openai_responses import OpenAIResponsesModel  # noqa: E402
from agents.run_config import SandboxRunConfig  # noqa: E402
from agents.sandbox import SandboxAgent  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


async def main(streamed):
    marker = os.environ["MARKER"]
    model = ScriptedModel([
        ("call", "exec_command", {"cmd": f"echo {marker} > proof.txt && cat proof.txt && pwd"}),
        ("text", "The file is written."),
    ]).start()
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=model.base_url, api_key="scripted")
    agent = SandboxAgent(
        name="builder",
        instructions="Do what you are asked in the sandbox.",
        model=OpenAIResponsesModel(model="scripted-model", openai_client=client),
    )
    sandbox = E2BSandboxClient()
    session = await sandbox.create(options=E2BSandboxClientOptions(sandbox_type="e2b"))
    config = RunConfig(sandbox=SandboxRunConfig(session=session))
    async with session:
        if streamed:
            result = Runner.run_streamed(agent, "Write the proof file.", run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "Write the proof file.", run_config=config)
        check(result.final_output == "The file is written.", f"final output {result.final_output!r}")
        asked_streamed = [bool(r.get("stream")) for r in model.requests]
        check(asked_streamed == [streamed, streamed], f"the model was asked: {asked_streamed}")
        outputs = " ".join(str(o) for o in model.tool_outputs())
        check(marker in outputs, f"the tool's output went back to the model: {outputs!r}")
        # What the agent's command wrote is in the sandbox, seen through its own API.
        data = await session.read(__import__("pathlib").Path("proof.txt"))
        check(data.read().decode().strip() == marker, "the sandbox holds the file")
        print("sandbox", session.state.sandbox_id)
    await sandbox.delete(session)
    model.stop()
    print("ok")


asyncio.run(main(sys.argv[1] == "stream"))
