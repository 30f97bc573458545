"""A deepagents agent works on a copy-on-write view of a project in a Warden cell; a person
approves the commands the policy holds, reviews what the agent changed, and applies exactly
that to the project.

    pip install ./sdk/python deepagents langchain-openai
    warden serve &
    OPENAI_API_KEY=... python3 sdk/python/examples/deepagents_review.py /path/to/project

Nothing the agent does reaches the project before `apply`, and every command, file change and
answer is in the warden's journal (`warden replay CELL`).
"""

import sys
import threading

from warden_cells import Warden
from warden_cells.deepagents import WardenSandbox

# Commands that install things wait for a person (the rules match the command line the backend
# runs, `sh -c ...`); the rest of the policy is the default's (no network, the host's system
# directories read-only).
POLICY = """version: 1
commands:
  ask: ['*pip install*', '*npm install*']
approvals:
  timeout: 5m
"""


def approve_what_waits(w, cell, stop, approve=lambda pending: True):
    """Answers the cell's questions while the agent runs (here: by `approve`; in real use, a
    person at `warden approvals` or the API)."""
    while not stop.is_set():
        try:
            pending = w.approvals.wait(cell.name, timeout=0.5)
        except TimeoutError:
            continue
        if approve(pending):
            pending.approve()
        else:
            pending.deny()


def main(project, model, task="Add a short README.md describing this project.",
         review=lambda diff: True):
    from deepagents import create_deep_agent

    with Warden() as w:
        cell = w.cells.create(workspace=project, policy=POLICY)
        stop = threading.Event()
        answering = threading.Thread(target=approve_what_waits, args=(w, cell, stop))
        answering.start()
        try:
            agent = create_deep_agent(model=model, backend=WardenSandbox(cell),
                                      system_prompt="Work in /workspace.")
            result = agent.invoke({"messages": [{"role": "user", "content": task}]})
            diff = cell.diff()
            # The review: nothing reached the project yet.
            if review(diff):
                report = cell.apply(digest=diff["digest"])
            else:
                report = None
            return cell, result, diff, report
        finally:
            stop.set()
            answering.join()
            cell.kill()


if __name__ == "__main__":
    from langchain_openai import ChatOpenAI

    def ask_person(diff):
        for change in diff.get("changes", []):
            print(change.get("kind"), change.get("path"))
        return input("apply these changes? [y/N] ").strip().lower() == "y"

    cell, result, diff, report = main(sys.argv[1], ChatOpenAI(model="gpt-4.1"), review=ask_person)
    print(result["messages"][-1].content)
    print("applied" if report else "discarded", f"(journal: warden replay {cell.name})")
