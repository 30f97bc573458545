"""Drives `warden mcp` (stdio) and the daemon's /mcp (streamable HTTP) with the official `mcp`
package, as an MCP client (Claude Code, Cursor) would, and checks every answer. Run by
tests/mcp.rs: `python3 mcp_client.py SCENARIO MODE`, with WARDEN (the binary), WORKSPACE, and,
for HTTP, ADDR and TOKEN in the environment. Exits non-zero, saying what was wrong, when
anything is not as it should be."""

import asyncio
import os
import sys

try:
    import httpx2 as httpx
except ImportError:  # older releases of the package's HTTP client
    import httpx
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

TOOLS = {
    "create_cell", "list_cells", "kill_cell", "exec", "read_file", "write_file", "edit_file",
    "list_files", "search_files", "diff", "apply", "snapshot", "list_snapshots",
    "remove_snapshot", "reset", "fork_cell", "list_approvals", "answer_approval",
}

POLICY = """version: 1
commands:
  deny: ['rm *']
  ask: ['touch *']
approvals:
  timeout: 30s
"""


def check(cond, what, result=None):
    if not cond:
        detail = ""
        if result is not None:
            detail = f": is_error={result.is_error} content={[c.text for c in result.content]}"
        sys.exit(f"FAILED: {what}{detail}")


def text(result):
    return "\n".join(c.text for c in result.content)


async def common(c, cell, streamed):
    """What every face must do: tools, a cell, a streamed command, files, a refusal, a diff."""
    tools = {t.name for t in (await c.list_tools()).tools}
    check(tools == TOOLS, f"tools: {sorted(tools)}")
    for t in (await c.list_tools()).tools:
        check(t.description and len(t.description) > 40, f"{t.name} has a description for a model")

    r = await c.call_tool("create_cell", {"name": cell, "policy": POLICY,
                                          "workspace": os.environ["WORKSPACE"]})
    check(not r.is_error and r.structured_content["state"] == "running", "create_cell", r)

    got = []

    async def progress(value, total, message):
        got.append(message)

    r = await c.call_tool("exec", {"cell": cell, "command":
                                   "echo one; sleep 0.3; echo two; echo oops >&2; exit 3"},
                          progress_callback=progress)
    check(not r.is_error, "exec ran", r)
    s = r.structured_content
    check(s["exit"]["reason"] == "exited" and s["status"] == 3, f"exit status: {s}")
    check(s["stdout"] == "one\ntwo\n" and s["stderr"] == "oops\n", f"streams: {s}")
    check("exit 3" in text(r) and "oops" in text(r), "the text a model reads", r)
    if streamed:
        check("".join(got).count("one") == 1 and "two" in "".join(got),
              f"output streamed as progress: {got}")

    # The workspace is the host directory, through the cell's own layer.
    r = await c.call_tool("read_file", {"cell": cell, "path": "notes.txt"})
    check(not r.is_error and r.content[0].text == "from the host\n", "read_file", r)
    r = await c.call_tool("write_file", {"cell": cell, "path": "new.txt", "content": "alpha\nbeta\n"})
    check(not r.is_error, "write_file", r)
    r = await c.call_tool("edit_file", {"cell": cell, "path": "new.txt",
                                        "old_text": "beta", "new_text": "gamma"})
    check(not r.is_error and r.structured_content["replaced"] == 1, "edit_file", r)
    r = await c.call_tool("edit_file", {"cell": cell, "path": "new.txt",
                                        "old_text": "delta", "new_text": "x"})
    check(r.is_error and "does not occur" in text(r), "an edit that finds nothing is refused", r)
    r = await c.call_tool("exec", {"cell": cell, "argv": ["cat", "new.txt"]})
    check(r.structured_content["stdout"] == "alpha\ngamma\n", "a command sees the edit", r)
    r = await c.call_tool("search_files", {"cell": cell, "pattern": "gam+a"})
    check(not r.is_error and "new.txt:2:gamma" in text(r), "search_files", r)
    r = await c.call_tool("search_files", {"cell": cell, "pattern": "nowhere-at-all"})
    check(not r.is_error and text(r) == "no matches", "a search with no match", r)
    r = await c.call_tool("list_files", {"cell": cell})
    names = {e["name"] for e in r.structured_content["entries"]}
    check({"notes.txt", "new.txt"} <= names, f"list_files: {names}")

    # Refusals are tool errors that say why and what to do.
    r = await c.call_tool("exec", {"cell": cell, "argv": ["rm", "-rf", "notes.txt"]})
    check(r.is_error and "rm *" in text(r) and "what to do" in text(r), "a denied command", r)
    check(r.structured_content["code"] == "forbidden", "its code", r)
    r = await c.call_tool("read_file", {"cell": cell, "path": "../../etc/shadow"})
    check(r.is_error and ".." in text(r), "a path out of the workspace", r)
    r = await c.call_tool("read_file", {"cell": "no-such-cell", "path": "x"})
    check(r.is_error and r.structured_content["code"] == "not-found", "a missing cell", r)

    # Nothing reached the host; the diff shows it.
    check(not os.path.exists(os.path.join(os.environ["WORKSPACE"], "new.txt")),
          "a cell's write stays in its layer")
    r = await c.call_tool("diff", {"cell": cell})
    check(not r.is_error and "new.txt" in text(r), "diff", r)


async def approvals(c, cell):
    """An `ask` rule holds a command until someone answers; the answer comes over MCP too."""
    held = asyncio.create_task(c.call_tool("exec", {"cell": cell, "argv": ["touch", "held.txt"]}))
    waiting = []
    for _ in range(200):
        r = await c.call_tool("list_approvals", {})
        waiting = [a for a in r.structured_content["approvals"] if a["cell"] == cell]
        if waiting:
            break
        await asyncio.sleep(0.05)
    check(waiting, "the held command is listed for approval")
    check(not held.done(), "the command waits for the answer")
    r = await c.call_tool("answer_approval", {"cell": cell, "id": waiting[0]["id"], "allow": True})
    check(not r.is_error, "answer_approval", r)
    r = await held
    check(not r.is_error and r.structured_content["status"] == 0, "the approved command ran", r)


async def finish(c, cell):
    r = await c.call_tool("snapshot", {"cell": cell, "name": "s1"})
    check(not r.is_error and r.structured_content["id"] == f"{cell}@s1", "snapshot", r)
    r = await c.call_tool("fork_cell", {"from": f"{cell}@s1", "name": f"{cell}-fork"})
    check(not r.is_error, "fork_cell", r)
    r = await c.call_tool("read_file", {"cell": f"{cell}-fork", "path": "new.txt"})
    check(not r.is_error and r.content[0].text == "alpha\ngamma\n", "the fork has the files", r)
    r = await c.call_tool("remove_snapshot", {"snapshot": f"{cell}@s1"})
    check(r.is_error and "base of" in r.content[0].text, "a fork's base is not removed", r)
    r = await c.call_tool("kill_cell", {"cell": f"{cell}-fork", "delete": True})
    check(not r.is_error, "kill the fork", r)
    r = await c.call_tool("list_snapshots", {"cell": cell})
    ids = [s["id"] for s in r.structured_content["snapshots"]]
    check(not r.is_error and f"{cell}@s1" in ids, f"list_snapshots: {ids}", r)
    r = await c.call_tool("remove_snapshot", {"snapshot": f"{cell}@s1"})
    check(not r.is_error and r.structured_content["removed"] == f"{cell}@s1", "remove_snapshot", r)
    r = await c.call_tool("list_snapshots", {"cell": cell})
    ids = [s["id"] for s in r.structured_content["snapshots"]]
    check(f"{cell}@s1" not in ids, f"the removed snapshot is still listed: {ids}", r)
    r = await c.call_tool("remove_snapshot", {"snapshot": f"{cell}@s1"})
    check(r.is_error and "no snapshot" in r.content[0].text, "a removed snapshot again", r)
    r = await c.call_tool("kill_cell", {"cell": cell})
    check(not r.is_error and r.structured_content["state"] == "ended", "kill_cell", r)
    r = await c.call_tool("list_cells", {})
    states = {x["name"]: x["state"] for x in r.structured_content["cells"]}
    check(states.get(cell) == "ended" and f"{cell}-fork" not in states, f"list_cells: {states}")


def running(marker):
    """Host pids whose command line has `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


async def wait_for(what, cond, seconds=10):
    for _ in range(int(seconds / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    sys.exit(f"FAILED: {what}")


async def cancelled(server, mode, cell):
    """A cancelled call kills its command; so does a session that ends in the middle of one."""
    async with Client(server(), mode=mode) as c:
        r = await c.call_tool("create_cell", {"name": cell})
        check(not r.is_error, "create_cell", r)
        marker = f"sleep 301 # {cell}-one"
        call = asyncio.create_task(c.call_tool("exec", {"cell": cell, "command": marker}))
        await wait_for("the command runs", lambda: running(marker))
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            pass
        await wait_for("a cancelled call's command is killed", lambda: not running(marker))
        r = await c.call_tool("exec", {"cell": cell, "command": "echo still here"})
        check(r.structured_content["stdout"] == "still here\n", "the session goes on", r)
    marker = f"sleep 302 # {cell}-two"
    async with Client(server(), mode=mode) as c:
        call = asyncio.create_task(c.call_tool("exec", {"cell": cell, "command": marker}))
        await wait_for("the command runs", lambda: running(marker))
        # The session ends here, with the call unanswered.
    try:
        await call
    except BaseException:  # the call's connection went with the session
        pass
    await wait_for("an ended session's command is killed", lambda: not running(marker))
    async with Client(server(), mode=mode) as c:
        r = await c.call_tool("kill_cell", {"cell": cell, "delete": True})
        check(not r.is_error, "kill_cell", r)


async def limits(c, stdio, cell):
    """An edit or a write whose file would be larger than the warden writes is refused before
    the daemon holds it: the file stays as it was, and the daemon goes on answering. (The
    write goes over stdio: HTTP takes no body of 64 MiB.)"""
    r = await c.call_tool("create_cell", {"name": cell})
    check(not r.is_error, "create_cell", r)
    r = await c.call_tool("exec", {"cell": cell, "command":
                                   "head -c 16777216 /dev/zero | tr '\\0' a > big && wc -c < big"})
    check(r.structured_content["stdout"] == "16777216\n", "a 16 MiB file of one letter", r)
    # 16 MiB of `a`, each replaced by 257 bytes: 4 GiB asked of the daemon at once.
    r = await c.call_tool("edit_file", {"cell": cell, "path": "big", "old_text": "a",
                                        "new_text": "x" * 257, "replace_all": True})
    check(r.is_error and "16777216 occurrence(s) in big" in text(r)
          and "more than the 67108864" in text(r), "an edit past the write limit", r)
    # Over 16 MiB, rmcp's own bound on a line, which dropped the request unanswered.
    r = await asyncio.wait_for(stdio.call_tool(
        "write_file", {"cell": cell, "path": "mid", "content": "m" * (20 << 20)}), 120)
    check(not r.is_error and r.structured_content["size"] == 20 << 20, "a 20 MiB write", r)
    r = await asyncio.wait_for(stdio.call_tool(
        "write_file", {"cell": cell, "path": "huge", "content": "b" * ((64 << 20) + 1)}), 120)
    check(r.is_error and "67108865 bytes is more than the 67108864" in text(r),
          "a write past the write limit", r)
    r = await c.call_tool("exec", {"cell": cell, "command": "wc -c < big; wc -c < mid; ls huge 2>&1 || true"})
    check(r.structured_content["stdout"].startswith("16777216\n20971520\n")
          and "No such file" in r.structured_content["stdout"],
          "the file is as it was, and nothing was written", r)
    r = await c.call_tool("kill_cell", {"cell": cell, "delete": True})
    check(not r.is_error, "kill_cell", r)


async def main():
    scenario, mode = sys.argv[1], sys.argv[2]
    cell = os.environ["CELL"]
    if scenario == "limits":
        headers = {"Authorization": f"Bearer {os.environ['TOKEN']}"}
        server = streamable_http_client(f"http://{os.environ['ADDR']}/mcp",
                                        http_client=httpx.AsyncClient(headers=headers, timeout=120))
        stdio = StdioServerParameters(command=os.environ["WARDEN"], args=["mcp"],
                                      env=dict(os.environ))
        async with Client(server, mode=mode) as c, Client(stdio, mode=mode) as s:
            await limits(c, s, cell)
        print("ok")
        return
    if scenario.startswith("cancel-"):
        if scenario == "cancel-http":
            headers = {"Authorization": f"Bearer {os.environ['TOKEN']}"}
            server = lambda: streamable_http_client(
                f"http://{os.environ['ADDR']}/mcp", http_client=httpx.AsyncClient(headers=headers))
        else:
            server = lambda: StdioServerParameters(command=os.environ["WARDEN"], args=["mcp"],
                                                   env=dict(os.environ))
        await cancelled(server, mode, cell)
        print("ok")
        return
    if scenario == "http":
        headers = {"Authorization": f"Bearer {os.environ['TOKEN']}"}
        transport = streamable_http_client(f"http://{os.environ['ADDR']}/mcp",
                                           http_client=httpx.AsyncClient(headers=headers))
        server = transport
    else:
        server = StdioServerParameters(command=os.environ["WARDEN"], args=["mcp"],
                                       env=dict(os.environ))
    async with Client(server, mode=mode) as c:
        want = "2025-11-25" if mode == "legacy" else "2026-07-28"
        check(c.protocol_version == want, f"protocol version {c.protocol_version}")
        await common(c, cell, streamed=True)
        await approvals(c, cell)
        await finish(c, cell)
    print("ok")


asyncio.run(main())
