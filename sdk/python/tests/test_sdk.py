"""The SDK against a real `warden serve` (started by crates/cli/tests/sdk.rs, which gives the
daemon's runtime directory in WARDEN_RUNTIME_DIR, its TCP address and token in WARDEN_TEST_URL
and WARDEN_TEST_TOKEN, the API's OpenAPI document in WARDEN_OPENAPI, and a host directory for
workspaces in WARDEN_TEST_WORKSPACE). Run: `python3 -m unittest discover -s sdk/python/tests`."""

import asyncio
import dataclasses
import json
import os
import threading
import time
import unittest
import uuid

import warden_cells
from warden_cells import AsyncWarden, Warden


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


DENY = "version: 1\ncommands:\n  deny: ['rm *']\n"
ASK = "version: 1\ncommands:\n  ask: ['touch *']\napprovals:\n  timeout: 30s\n"


class Types(unittest.TestCase):
    def test_every_type_has_exactly_the_fields_of_its_schema(self):
        with open(os.environ["WARDEN_OPENAPI"]) as f:
            schemas = json.load(f)["components"]["schemas"]
        for cls, name in warden_cells.SCHEMAS.items():
            schema = schemas[name]
            fields = {f.name: f for f in dataclasses.fields(cls)}
            self.assertEqual(set(fields), set(schema["properties"]), f"{cls.__name__} vs {name}")
            mandatory = {n for n, f in fields.items()
                         if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING}
            self.assertLessEqual(mandatory, set(schema.get("required", [])), cls.__name__)


class Sync(unittest.TestCase):
    def setUp(self):
        self.w = Warden()
        self.workspace = os.environ["WARDEN_TEST_WORKSPACE"]

    def tearDown(self):
        self.w.close()

    def test_a_cell_from_create_to_delete(self):
        w = self.w
        cell = w.cells.create(unique("sdk"), workspace=self.workspace, labels={"t": "sdk"})
        self.assertEqual(cell.info.state, "running")
        self.assertIn(cell.name, {c.name for c in w.cells.list()})

        r = cell.exec("echo one; echo two >&2; exit 3")
        self.assertEqual((r.exit.reason, r.exit.code), ("exited", 3))
        self.assertEqual((r.stdout, r.stderr), ("one\n", "two\n"))
        self.assertFalse(r.exit.ok)

        events = list(cell.exec_stream(["sh", "-c", "echo a; sleep 0.2; echo b"]))
        kinds = [k for k, _ in events]
        self.assertEqual(kinds[0], "started")
        self.assertEqual(kinds[-1], "exit")
        self.assertEqual("".join(d for k, d in events if k == "stdout"), "a\nb\n")

        p = cell.exec("read x; echo got $x", background=True)
        self.assertTrue(p.info.running)
        p.write("hi\n", close=True)
        exit_info = p.wait()
        self.assertEqual(exit_info.code, 0)
        out = "".join(d for k, d in p.output() if k == "stdout")
        self.assertEqual(out, "got hi\n")
        sleeper = cell.exec(["sleep", "300"], background=True)
        sleeper.kill()
        self.assertEqual(sleeper.wait().reason, "signaled")

        cell.files.write("new.txt", "alpha\n")
        self.assertEqual(cell.files.read("new.txt"), b"alpha\n")
        self.assertEqual(cell.files.stat("new.txt").size, 6)
        self.assertTrue(cell.files.exists("notes.txt"))
        self.assertFalse(cell.files.exists("nothing.txt"))
        cell.files.mkdir("d/e")
        cell.files.move("new.txt", "d/e/moved.txt")
        self.assertEqual({f.name for f in cell.files.list("d/e")}, {"moved.txt"})

        snap = cell.snapshot("before")
        self.assertEqual(snap.id, f"{cell.name}@before")
        cell.files.write("later.txt", "x")
        cell.reset("before")
        self.assertFalse(cell.files.exists("later.txt"))
        self.assertIn(snap.id, {s.id for s in cell.snapshots()})

        fork = cell.fork(unique("fork"), snapshot="before")
        self.assertEqual(fork.files.read("d/e/moved.txt"), b"alpha\n")
        fork.kill()
        fork.delete()
        cell.snapshot("spare")
        cell.remove_snapshot("spare")
        self.assertNotIn(f"{cell.name}@spare", {s.id for s in cell.snapshots()})
        with self.assertRaises(warden_cells.NotFound):
            cell.remove_snapshot("spare")

        diff = cell.diff()
        self.assertIn("d/e/moved.txt", json.dumps(diff))
        self.assertFalse(os.path.exists(os.path.join(self.workspace, "d")))
        report = cell.apply(digest=diff["digest"])
        self.assertTrue(os.path.exists(os.path.join(self.workspace, "d/e/moved.txt")), report)

        entries = w.replay(cell.name)
        kinds = [e["kind"] for e in entries]
        for kind in ["cell.create", "exec.start", "exec.exit", "file.write",
                     "workspace.snapshot", "workspace.snapshot.remove", "workspace.apply"]:
            self.assertIn(kind, kinds)

        self.assertEqual(cell.kill().state, "ended")
        cell.delete()
        with self.assertRaises(warden_cells.NotFound):
            w.cells.get(cell.name)

    def test_refusals_are_typed_exceptions_with_the_servers_words(self):
        w = self.w
        with self.assertRaises(warden_cells.NotFound) as e:
            w.cells.get("no-such-cell")
        self.assertEqual((e.exception.status, e.exception.code), (404, "not-found"))
        self.assertIn("no-such-cell", e.exception.message)
        with self.assertRaises(warden_cells.BadRequest):
            w.cells.create("bad name!")
        cell = w.cells.create(unique("deny"), policy=DENY)
        try:
            with self.assertRaises(warden_cells.Forbidden) as e:
                cell.exec(["rm", "-rf", "/"])
            self.assertIn("rm *", e.exception.message)
            with self.assertRaises(warden_cells.BadRequest):
                cell.files.read("../../etc/shadow")
        finally:
            cell.kill()
            cell.delete()
        with self.assertRaises(ValueError):
            cell.exec([])

    def test_the_journal_pages_back_and_a_cells_use_is_sampled(self):
        w = self.w
        cell = w.cells.create(unique("sdkj"))
        try:
            cell.exec("echo hi")
            page = w.journal(cell=cell.name, limit=2)
            self.assertEqual(len(page.entries), 2)
            self.assertIsInstance(page.entries[0], warden_cells.JournalEntry)
            self.assertGreater(page.entries[0].seq, page.entries[1].seq)
            self.assertEqual((len(page.entries[0].hash), len(page.entries[0].prev)), (64, 64))
            kinds = []
            before = None
            while True:
                older = w.journal(cell=cell.name, limit=2, before=before)
                kinds += [e.kind for e in older.entries]
                if older.next_before is None:
                    break
                before = older.next_before
            self.assertIn("cell.create", kinds)
            self.assertIn("exec.exit", kinds)
            only = w.journal(cell=cell.name, kind="exec.")
            self.assertTrue(only.entries and all(e.kind.startswith("exec.") for e in only.entries))
            check = w.verify_journal()
            self.assertTrue(check.ok, check.error)
            self.assertGreaterEqual(check.last_seq, page.entries[0].seq)
            with self.assertRaises(warden_cells.BadRequest):
                w.journal(limit=5000)
            deadline = time.time() + 15
            samples = []
            while time.time() < deadline and len(samples) < 2:
                histories = w.usage(cell.name)
                samples = histories[0].samples if histories else []
                time.sleep(0.5)
            self.assertGreaterEqual(len(samples), 2, "no usage samples of the cell")
            self.assertIsInstance(samples[0], warden_cells.CellUsage)
            self.assertGreater(samples[-1].memory_bytes or 0, 0)
        finally:
            cell.kill()
            cell.delete()

    def test_a_held_command_waits_for_its_approval(self):
        w = self.w
        cell = w.cells.create(unique("ask"), policy=ASK)
        try:
            done = {}
            t = threading.Thread(target=lambda: done.update(r=cell.exec(["touch", "f"])))
            t.start()
            pending = w.approvals.wait(cell.name, timeout=20)
            self.assertIn("touch", pending.approval.request)
            self.assertTrue(t.is_alive(), "the command waits")
            pending.approve()
            t.join(20)
            self.assertEqual(done["r"].exit.code, 0)
            self.assertTrue(cell.files.exists("f"))
        finally:
            cell.kill()
            cell.delete()

    def test_tcp_needs_the_token(self):
        url = os.environ["WARDEN_TEST_URL"]
        with Warden(url=url, token=os.environ["WARDEN_TEST_TOKEN"]) as w:
            self.assertEqual(w.health()["status"], "ok")
            w.cells.list()
        with Warden(url=url, token="not-the-token") as w:
            with self.assertRaises(warden_cells.WardenError) as e:
                w.cells.list()
            self.assertEqual(e.exception.status, 401)

    @unittest.skipUnless(os.geteuid() == 0, "serves a socket as another user")
    def test_a_socket_another_user_serves_is_sent_nothing(self):
        import socket
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o777)
            path, heard = os.path.join(tmp, "daemon.sock"), os.path.join(tmp, "heard")
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # a stranger's "daemon", as nobody: it keeps what it is sent
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    server = socket.socket(socket.AF_UNIX)
                    server.bind(path)
                    server.listen(8)
                    os.write(ready_w, b"k")
                    while True:
                        conn, _ = server.accept()
                        data = conn.recv(65536)
                        if data:
                            with open(heard, "ab") as f:
                                f.write(data)
                        conn.close()
                finally:
                    os._exit(0)
            try:
                os.read(ready_r, 1)
                with self.assertRaises(warden_cells.ConnectionFailed) as e:
                    with Warden(socket=path) as w:
                        w.cells.create(name="secretive", env={"API_KEY": "s3cret-value"})
                self.assertIn("served by uid 65534", str(e.exception))
                with self.assertRaises(warden_cells.ConnectionFailed):
                    AsyncWarden(socket=path)
                time.sleep(0.2)
                self.assertFalse(os.path.exists(heard), "something was sent to the stranger")
            finally:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                os.close(ready_r)
                os.close(ready_w)

    def test_a_missing_daemon_says_so(self):
        with Warden(socket="/nonexistent/daemon.sock") as w:
            with self.assertRaises(warden_cells.ConnectionFailed) as e:
                w.cells.list()
            self.assertIn("warden serve", str(e.exception))


class MadeAhead(unittest.TestCase):
    """The daemon of these tests keeps one cell of `default` made ahead (`--pool default=1`)."""

    def test_an_unnamed_create_takes_a_cell_made_ahead_and_the_pool_says_so(self):
        with Warden() as w:
            deadline = time.monotonic() + 20
            while w.pools()[0].ready < 1:
                self.assertLess(time.monotonic(), deadline, "the pool made no cell")
                time.sleep(0.05)
            pool = w.pools()[0]
            self.assertEqual((pool.policy, pool.tier, pool.size), ("default", "process", 1))
            self.assertGreater(pool.memory_bytes, 0)
            taken = pool.taken
            cell = w.cells.create(labels={"t": "pool"})
            self.assertEqual(w.pools()[0].taken, taken + 1)
            self.assertEqual(cell.info.labels, {"t": "pool"})
            self.assertEqual(cell.exec("echo ready").stdout, "ready\n")
            # A named one is started for its create.
            named = w.cells.create(unique("named"))
            self.assertEqual(w.pools()[0].taken, taken + 1)
            cell.delete()
            named.delete()

        async def flow():
            async with AsyncWarden() as w:
                self.assertEqual([p.policy for p in await w.pools()], ["default"])

        asyncio.run(flow())

    def test_a_run_makes_a_cell_for_one_command_and_deletes_it(self):
        with Warden() as w:
            ran = w.cells.run("echo out; echo err >&2; exit 3")
            self.assertEqual((ran.exit.code, ran.stdout, ran.stderr), (3, "out\n", "err\n"))
            events = list(w.cells.run_stream(["sh", "-c", "echo hi"], cell={"labels": {"t": "run"}}))
            self.assertEqual(events[0][0], "started")
            self.assertEqual([e for e in events if e[0] == "stdout"], [("stdout", "hi\n")])
            self.assertEqual((events[-1][0], events[-1][1].code), ("exit", 0))
            with self.assertRaises(warden_cells.NotFound):
                w.cells.get(events[0][1]["cell"])
            with self.assertRaises(warden_cells.BadRequest) as refused:
                w.cells.run(["true"], background=True)
            self.assertIn("background", str(refused.exception))

        async def flow():
            async with AsyncWarden() as w:
                ran = await w.cells.run(["sh", "-c", "echo async"], cell={"preset": "default"})
                self.assertEqual((ran.exit.code, ran.stdout), (0, "async\n"))

        asyncio.run(flow())


COUNTER = ("setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; "
           "mv /tmp/n.new /tmp/n; sleep 0.05; done' </dev/null >/dev/null 2>&1 &")


def count(cell):
    deadline = time.monotonic() + 10
    while True:
        out = cell.exec("cat /tmp/n 2>/dev/null").stdout.strip()
        if out.isdigit():
            return int(out)
        if time.monotonic() > deadline:
            raise AssertionError(f"no count in {cell.name}: {out!r}")
        time.sleep(0.05)


class Checkpoints(unittest.TestCase):
    def test_a_restored_checkpoint_goes_on_where_it_stopped(self):
        with Warden() as w:
            try:
                cell = w.cells.create(unique("ckpt"),
                                      policy="version: 1\nextends: default\ntier: gvisor\n",
                                      workspace=os.environ["WARDEN_TEST_WORKSPACE"])
            except warden_cells.WardenError as e:
                self.skipTest(f"no gvisor tier here: {e}")
            cell.exec(COUNTER)
            deadline = time.monotonic() + 20
            while count(cell) < 10:
                self.assertLess(time.monotonic(), deadline, "the counter does not run")
                time.sleep(0.05)
            before = count(cell)
            saved = cell.checkpoint("c1")
            self.assertEqual(saved.id, f"{cell.name}@c1")
            self.assertGreater(saved.memory_bytes, 0)
            self.assertEqual(cell.refresh().state, "ended")
            back = w.cells.restore(saved.id, unique("back"))
            self.assertEqual(back.info.tier, "gvisor")
            first = count(back)
            self.assertTrue(before <= first < before + 200, (before, first))
            time.sleep(0.3)
            self.assertGreater(count(back), first)
            # Its workspace came back with it.
            self.assertEqual(back.files.read("notes.txt"), b"from the host\n")
            with self.assertRaises(warden_cells.NotFound):
                w.cells.restore(f"{cell.name}@nope")
            back.delete()
            cell.delete()


class Async(unittest.TestCase):
    def test_the_async_client_does_the_same(self):
        async def flow():
            async with AsyncWarden() as w:
                cell = await w.cells.create(
                    unique("async"), workspace=os.environ["WARDEN_TEST_WORKSPACE"])
                r = await cell.exec("echo async; exit 4")
                self.assertEqual((r.stdout, r.exit.code), ("async\n", 4))
                chunks = [d async for k, d in cell.exec_stream("echo x; echo y") if k == "stdout"]
                self.assertEqual("".join(chunks), "x\ny\n")
                await cell.write("f.txt", b"data")
                self.assertEqual(await cell.read("f.txt"), b"data")
                snap = await cell.snapshot("kept")
                self.assertIn(snap.id, {s.id for s in await cell.snapshots()})
                await cell.remove_snapshot("kept")
                self.assertNotIn(snap.id, {s.id for s in await cell.snapshots()})
                p = await cell.exec(["sleep", "0.1"], background=True)
                self.assertEqual((await cell.wait(p.id)).code, 0)
                with self.assertRaises(warden_cells.NotFound):
                    await w.cells.get("no-such-cell")
                await cell.kill()
                await cell.delete()

        asyncio.run(flow())


class AgentSessions(unittest.TestCase):
    """The warden's own agent loop through the SDK, against the scripted model of the CLI's
    tests (crates/cli/tests/model_server.py: Chat Completions, streamed)."""

    def test_a_session_stepped_steered_rewound_and_forked(self):
        from model_server import ScriptedModel

        model = ScriptedModel([
            ("call", "write_file", {"path": "a.txt", "content": "one"}),
            ("text", "done"),
            ("text", "fork done"),
        ]).start()
        try:
            with Warden() as w:
                agent = w.agents.start("write a file", "openai:scripted", base_url=model.base_url,
                                       api_key="sk-sdk-test", paused=True)
                self.assertEqual(agent.info.state, "paused")
                self.assertEqual(model.requests, [])
                agent.step()
                info = agent.wait()
                self.assertEqual((info.state, info.turn), ("paused", 1))
                self.assertEqual(info.turns[-1].turn, 1)
                # Paused, the cell is frozen; its diff is read from outside it.
                paths = [c["path"] for c in agent.cell().diff()["changes"]]
                self.assertEqual(paths, ["a.txt"])
                agent.say("finish up")
                agent.resume()
                info = agent.wait()
                self.assertEqual((info.state, info.summary), ("done", "done"))
                self.assertIn("[operator] finish up", json.dumps(model.requests[-1]))
                self.assertEqual(agent.cell().files.read_text("a.txt"), "one")
                self.assertGreater(info.usage.input, 0)
                items = agent.transcript()["items"]
                self.assertEqual(items[0], {"type": "user", "text": "write a file"})
                fork = agent.fork(1, say="another way")
                self.assertEqual(fork.wait().state, "done")
                self.assertTrue(fork.cell().files.exists("a.txt"))
                self.assertIn("[operator] another way", json.dumps(model.requests[-1]))
                agent.rewind(0)
                self.assertFalse(agent.cell().files.exists("a.txt"))
                self.assertTrue(fork.cell().files.exists("a.txt"))
                self.assertIn(fork.id, [a.id for a in w.agents.list()])
                with self.assertRaises(warden_cells.BadRequest):
                    w.agents.start("x", "no-provider")
                with self.assertRaises(warden_cells.NotFound):
                    w.agents.get("agent-none")
        finally:
            model.stop()

    def test_the_async_agents_do_the_same(self):
        from model_server import ScriptedModel

        model = ScriptedModel([("text", "async done")]).start()

        async def flow():
            async with AsyncWarden() as w:
                agent = await w.agents.start("say it", "openai:scripted", base_url=model.base_url,
                                             api_key="sk-sdk-test")
                info = await agent.wait()
                self.assertEqual((info.state, info.summary), ("done", "async done"))
                with self.assertRaises(warden_cells.Conflict):
                    await agent.pause()

        try:
            asyncio.run(flow())
        finally:
            model.stop()


if __name__ == "__main__":
    unittest.main()
