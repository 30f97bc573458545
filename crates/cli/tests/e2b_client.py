"""Drives Warden's E2B-compatible API with the real `e2b` SDK, pointed at it by its documented
environment variables only (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY), and checks every
answer. Run by tests/e2b.rs with the SDK's version on PYTHONPATH: `python3 e2b_client.py
sync|async`. Exits non-zero, saying what was wrong, when anything is not as it should be."""

import asyncio
import os
import sys
import time

import e2b
from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import NotFoundException, SandboxException

try:
    from e2b import CommandExitException
except ImportError:
    from e2b.sandbox.commands.command_handle import CommandExitException


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def sync_flow():
    sbx = Sandbox.create(timeout=120, metadata={"k": "v"}, envs={"A": "1"})
    out = []
    r = sbx.commands.run("echo hi; echo err >&2; echo $A", on_stdout=out.append)
    check(r.exit_code == 0 and r.stdout == "hi\n1\n" and r.stderr == "err\n", f"run: {r}")
    check("".join(out) == "hi\n1\n", f"on_stdout: {out}")
    try:
        sbx.commands.run("exit 3")
        check(False, "a failed command raises")
    except CommandExitException as e:
        check(e.exit_code == 3, f"exit code {e.exit_code}")

    # Files and commands see one home.
    sbx.files.write("a.txt", "from files\n")
    check(sbx.commands.run("cat a.txt").stdout == "from files\n", "a command reads what files wrote")
    sbx.commands.run("mkdir -p sub && echo made > sub/b.txt")
    check(sbx.files.read("/home/user/sub/b.txt") == "made\n", "files read what a command wrote")
    names = {e.name for e in sbx.files.list("/home/user")}
    check({"a.txt", "sub"} <= names, f"list: {names}")
    check(sbx.files.exists("a.txt") and not sbx.files.exists("nope.txt"), "exists")
    sbx.files.remove("a.txt")
    check(not sbx.files.exists("a.txt"), "remove")
    check(sbx.files.make_dir("newdir"), "make_dir")
    try:
        sbx.files.read("/etc/passwd")
        check(False, "a path outside the home is refused")
    except SandboxException as e:
        check("home/user" in str(e), f"the refusal says why: {e}")
    for sneaky in ["/home/user/../../etc/passwd", "../etc/passwd", "/home/user/sub/../../x"]:
        try:
            sbx.files.read(sneaky)
            check(False, f"{sneaky} is refused")
        except SandboxException:
            pass
    # A symlink the sandbox made, leading out of its home, is not followed by the files API.
    sbx.commands.run("ln -s /etc/hostname out-link")
    try:
        sbx.files.read("out-link")
        check(False, "a symlink out of the home is not followed")
    except SandboxException:
        pass
    # A watched directory: what was made and removed in it, since the last look.
    sbx.files.make_dir("watched")
    watch = sbx.files.watch_dir("watched", recursive=True)
    sbx.files.write("watched/a.txt", "a")
    sbx.commands.run("mkdir -p watched/deep && echo b > watched/deep/b.txt")
    events = {(e.name, e.type.name) for e in watch.get_new_events()}
    check({("a.txt", "CREATE"), ("deep", "CREATE"), ("deep/b.txt", "CREATE")} <= events,
          f"watch events: {events}")
    sbx.commands.run("rm watched/a.txt")
    events = {(e.name, e.type.name) for e in watch.get_new_events()}
    check(events == {("a.txt", "REMOVE")}, f"watch events after a removal: {events}")
    watch.stop()
    big = os.urandom(5 << 20)
    sbx.files.write("big.bin", big)
    check(bytes(sbx.files.read("big.bin", format="bytes")) == big, "a 5 MiB file round-trips")

    # Background, stdin, kill.
    h = sbx.commands.run("read line; echo got $line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    r = h.wait()
    check(r.stdout == "got hello\n", f"stdin: {r}")
    h = sbx.commands.run("sleep 300", background=True)
    check(h.pid in {p.pid for p in sbx.commands.list()}, "list shows a running command")
    check(h.kill(), "kill")
    try:
        h.wait()
    except CommandExitException:
        pass
    check(h.pid not in {p.pid for p in sbx.commands.list()}, "a killed command is gone")

    # A terminal: the shell reads what is typed, its output is the terminal's.
    from e2b import PtySize
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(term.pid, b"echo pty-$((6*7)) $(stty size)\nexit\n")
    seen = []
    try:
        term.wait(on_pty=lambda data: seen.append(bytes(data)))
    except CommandExitException:
        pass
    check(b"pty-42 30 100" in b"".join(seen), f"the terminal's output: {b''.join(seen)!r}")
    # A background command, connected to again from another handle.
    h = sbx.commands.run("sleep 0.5; echo later", background=True)
    again = sbx.commands.connect(h.pid)
    check(again.wait().stdout.strip() == "later", "connect sees the output to come")

    sbx.set_timeout(60)
    check(sbx.is_running(), "is_running")
    ids = {s.sandbox_id for s in Sandbox.list().next_items()} if hasattr(Sandbox.list(), "next_items") else None
    if ids is not None:
        check(sbx.sandbox_id in ids, f"list: {ids}")
    info = sbx.get_info()
    check(info.metadata == {"k": "v"}, f"metadata: {info.metadata}")
    sbx.kill()
    check(not Sandbox.kill(sbx.sandbox_id), "a killed sandbox is gone")
    return sbx.sandbox_id


async def async_flow():
    sbx = await AsyncSandbox.create()
    r = await sbx.commands.run("echo async")
    check(r.stdout == "async\n", f"async run: {r}")
    await sbx.files.write("x.txt", b"bytes")
    check(await sbx.files.read("x.txt") == "bytes", "async files")
    # The streaming watch: events as they happen.
    await sbx.files.make_dir("w2")
    seen = []
    handle = await sbx.files.watch_dir(
        "w2", on_event=lambda e: seen.append((e.name, e.type.name)), recursive=True)
    async def until(event):
        for _ in range(100):
            if event in seen:
                return
            await asyncio.sleep(0.05)
        check(False, f"{event} was not seen: {seen}")

    await sbx.files.write("w2/new.txt", "x")
    await until(("new.txt", "CREATE"))
    await sbx.commands.run("rm w2/new.txt")
    await until(("new.txt", "REMOVE"))
    await handle.stop()
    await sbx.kill()
    # The SDK's stop() leaves the watch's HTTP stream to the interpreter's exit, where the 2.6x
    # SDK's transport (pyqwest) can abort the process on a stream still open: the warden ends
    # the stream once the sandbox is gone (its next look fails), so give it that look.
    await asyncio.sleep(0.6)
    return sbx.sandbox_id


def timeout_flow():
    sbx = Sandbox.create(timeout=1)
    check(sbx.commands.run("echo alive").stdout == "alive\n", "alive before its timeout")
    for _ in range(150):
        time.sleep(0.1)
        try:
            Sandbox.connect(sbx.sandbox_id)
        except (NotFoundException, SandboxException):
            return sbx.sandbox_id
    check(False, "a sandbox past its timeout is gone within 15 s")


if __name__ == "__main__":
    which = sys.argv[1]
    ids = {"sync": sync_flow, "async": lambda: asyncio.run(async_flow()), "timeout": timeout_flow}[which]()
    print("sandbox", ids)
    print("ok", e2b.__version__ if hasattr(e2b, "__version__") else "")
