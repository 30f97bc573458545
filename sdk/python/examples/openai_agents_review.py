"""An OpenAI Agents SDK `SandboxAgent` works in a Warden cell on a copy-on-write view of a
project; commands the policy holds wait for a person, and what the agent changed is reviewed
before it is applied to the project.

    pip install ./sdk/python openai-agents
    warden serve &
    OPENAI_API_KEY=... python3 sdk/python/examples/openai_agents_review.py /path/to/project

Every command, file change and answer is in the warden's journal (`warden replay CELL`).
"""

import asyncio
import sys

from agents import Runner, RunConfig
from agents.run_config import SandboxRunConfig
from agents.sandbox import SandboxAgent
from warden_cells import Warden
from warden_cells.openai_agents import WardenSandboxClient, WardenSandboxClientOptions

POLICY = """version: 1
commands:
  ask: ['*pip install*', '*git push*']
approvals:
  timeout: 10m
"""


async def main(project):
    w = Warden()
    client = WardenSandboxClient(w)
    session = await client.create(
        options=WardenSandboxClientOptions(workspace=project, policy=POLICY))
    cell = session._inner.cell
    print(f"cell {cell.name}: answer held commands with `warden approvals` / `warden approve`")
    agent = SandboxAgent(name="maintainer", instructions="Improve the project's README.")
    async with session:
        result = await Runner.run(agent, "Improve the README.",
                                  run_config=RunConfig(sandbox=SandboxRunConfig(session=session)))
    print(result.final_output)
    diff = cell.diff()
    for change in diff["changes"]:
        print(change["kind"], change["path"])
    if diff["changes"] and input("apply these changes? [y/N] ").strip().lower() == "y":
        cell.apply(digest=diff["digest"])
    await client.delete(session)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
