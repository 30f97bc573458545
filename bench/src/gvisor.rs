//! The gVisor tier against runsc driven by hand, in one run: cold start (`warden run --tier
//! gvisor -- true` beside `runsc run` of a bundle made by hand and `runsc do`), exec round trip
//! (the API's exec into a gVisor cell beside `runsc exec` into a container made by hand), memory
//! of an idle cell (everything of it: keeper, host side, runsc, gofer, sandbox; beside runsc's own
//! three), and checkpoint/restore times. The process tier's rows give the scale.
//!
//! `cargo build --release --workspace && target/release/gvisor-bench [--runs N]` (as root, with
//! runsc installed).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use warden_bench::{Daemon, is_root, request, table, tree_memory, which};

/// runsc hands its stdio to the sandbox and re-owns what they are: it only ever gets pipes.
fn piped(command: &mut Command) -> &mut Command {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

fn run(command: &mut Command) -> Result<Duration> {
    let start = Instant::now();
    let out = piped(command).output().context("starting a command")?;
    let took = start.elapsed();
    if !out.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(took)
}

/// runsc with the flags the warden gives it, and a state directory of the benchmark's.
struct Runsc {
    binary: PathBuf,
    root: PathBuf,
}

impl Runsc {
    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        command.arg("--root").arg(&self.root).args([
            "--platform=ptrace",
            "--network=none",
            "--ignore-cgroups",
        ]);
        command
    }

    /// Waits until container `id` runs, as the warden waits for a restored cell: runsc's state
    /// file read every 2 ms (its `status`), and runsc asked (`runsc state`, a start of runsc)
    /// only every quarter of a second, so that neither restore is timed with starts of runsc
    /// beside it and found late by one.
    fn wait_running(&self, id: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let record = self.root.join(format!("{id}_sandbox:{id}.state"));
        let mut asked = Instant::now();
        while Instant::now() < deadline {
            let status = std::fs::read(&record)
                .ok()
                .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
                .is_some_and(|state| state["id"] == id && state["status"] == "running");
            if status {
                return Ok(());
            }
            if asked.elapsed() >= Duration::from_millis(250) {
                asked = Instant::now();
                let out = piped(self.command().args(["state", id])).output()?;
                if String::from_utf8_lossy(&out.stdout).contains("\"running\"") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        bail!("container {id} did not come up")
    }

    fn end(&self, id: &str, child: Option<Child>) {
        let _ = piped(self.command().args(["kill", id, "KILL"])).output();
        if let Some(mut child) = child {
            let _ = child.wait();
        }
        let _ = piped(self.command().args(["delete", "--force", id])).output();
    }
}

/// A bundle made by hand, as a user of runsc would write it: the host's directories read-only
/// under an empty root, its own /proc and /tmp, no network, running `args`.
fn bundle(dir: &Path, args: &[&str]) -> Result<PathBuf> {
    let bundle = dir.join(format!("bundle-{}", args.join("-").replace('/', "_")));
    let root = bundle.join("root");
    std::fs::create_dir_all(&root)?;
    for sub in ["usr", "etc", "proc", "tmp", "dev", "sys"] {
        std::fs::create_dir_all(root.join(sub))?;
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ] {
        let path = root.join(link);
        if std::fs::symlink_metadata(&path).is_err() {
            std::os::unix::fs::symlink(target, path)?;
        }
    }
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false, "user": { "uid": 1000, "gid": 1000 }, "args": args,
            "env": ["PATH=/usr/bin:/bin"], "cwd": "/tmp", "noNewPrivileges": true,
            "capabilities": { "bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": [] }
        },
        "root": { "path": root, "readonly": true },
        "hostname": "bench",
        "mounts": [
            { "destination": "/proc", "type": "proc", "source": "proc" },
            { "destination": "/tmp", "type": "tmpfs", "source": "tmpfs" },
            { "destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"] },
            { "destination": "/etc", "type": "bind", "source": "/etc", "options": ["rbind", "ro"] }
        ],
        "linux": { "namespaces": [{ "type": "pid" }, { "type": "network" }, { "type": "ipc" }, { "type": "uts" }, { "type": "mount" }] }
    });
    std::fs::write(bundle.join("config.json"), config.to_string())?;
    Ok(bundle)
}

struct Setup {
    warden: PathBuf,
    runsc: Runsc,
    dir: PathBuf,
}

impl Setup {
    fn warden(&self) -> Command {
        let mut command = Command::new(&self.warden);
        command
            .env("WARDEN_RUNTIME_DIR", self.dir.join("run"))
            .env("WARDEN_STATE_DIR", self.dir.join("state"));
        command
    }
}

/// The policy of the gVisor cells the benchmark makes through a daemon.
const GVISOR_POLICY: &str = "version: 1\nextends: default\ntier: gvisor\n";

/// Create, exec `true`, delete through the API of a daemon whose pool keeps gVisor cells made
/// ahead (the pool's refill waited for, untimed, before and after); `taken`: how many the pool
/// handed out before.
fn through_pool(pool: &Daemon, taken: usize) -> Result<Duration> {
    warden_bench::wait_for_pool(&pool.socket, 2, Duration::from_secs(30))?;
    let body = serde_json::json!({ "policy": GVISOR_POLICY }).to_string();
    let start = Instant::now();
    warden_bench::create_exec_delete(&pool.socket, &body)?;
    let took = start.elapsed();
    let (_, pools) = request(&pool.socket, "GET", "/v1/pools", "")?;
    if !pools.contains(&format!("\"taken\":{}", taken + 1)) {
        bail!("the create was not the pool's: {pools}");
    }
    // The refill (a whole gVisor cell's start) is not left running under the next row.
    warden_bench::wait_for_pool(&pool.socket, 2, Duration::from_secs(30))?;
    Ok(took)
}

fn cold_start(setup: &Setup, pool: &Daemon, runs: usize) -> Result<Vec<(String, Vec<Duration>)>> {
    let by_hand = bundle(&setup.dir, &["true"])?;
    let mut rows: Vec<(String, Vec<Duration>)> = [
        "warden run --tier gvisor",
        "runsc run (bundle by hand)",
        "runsc do",
        "warden run (process tier)",
        "warden (daemon, warm gVisor pool)",
    ]
    .iter()
    .map(|n| ((*n).to_owned(), Vec::new()))
    .collect();
    let mut taken = 0;
    // A new order each round, as the cold-start benchmark's: in a fixed cycle the gVisor run
    // always came right after the warm pool's row and its refill.
    let mut order = [0usize, 1, 2, 3, 4];
    let mut seed = warden_bench::SHUFFLE_SEED;
    for round in 0..runs + 2 {
        warden_bench::shuffle(&mut order, &mut seed);
        for &row in &order {
            let took = match row {
                0 => run(setup
                    .warden()
                    .args(["run", "--tier", "gvisor", "--", "true"]))?,
                1 => {
                    let id = format!("bench-cold-{round}");
                    let took = run(setup
                        .runsc
                        .command()
                        .args(["run", "--bundle"])
                        .arg(&by_hand)
                        .arg(&id))?;
                    let _ = piped(setup.runsc.command().args(["delete", "--force", &id])).output();
                    took
                }
                2 => run(setup.runsc.command().args(["do", "true"]))?,
                3 => run(setup.warden().args(["run", "--", "true"]))?,
                _ => {
                    let took = through_pool(pool, taken)?;
                    taken += 1;
                    took
                }
            };
            if round >= 2 {
                rows[row].1.push(took);
            }
        }
    }
    Ok(rows)
}

fn exec_round_trip(
    setup: &Setup,
    daemon: &Daemon,
    runs: usize,
) -> Result<Vec<(String, Vec<Duration>)>> {
    let sleeper = bundle(&setup.dir, &["sleep", "3600"])?;
    let id = "bench-exec";
    let container = piped(
        setup
            .runsc
            .command()
            .args(["run", "--bundle"])
            .arg(&sleeper)
            .arg(id),
    )
    .spawn()?;
    setup.runsc.wait_running(id)?;
    let (mut api, mut by_hand, mut process) = (Vec::new(), Vec::new(), Vec::new());
    let exec = |cell: &str| warden_bench::timed_exec(&daemon.socket, cell);
    for i in 0..runs + 3 {
        let a = exec("gv")?;
        let b = run(setup
            .runsc
            .command()
            .args(["exec", "--user", "1000:1000", id, "true"]))?;
        let c = exec("pt")?;
        if i >= 3 {
            api.push(a);
            by_hand.push(b);
            process.push(c);
        }
    }
    setup.runsc.end(id, Some(container));
    Ok(vec![
        ("warden exec (API) into a gVisor cell".to_owned(), api),
        ("runsc exec (container by hand)".to_owned(), by_hand),
        ("warden exec (API) into a process cell".to_owned(), process),
    ])
}

/// Memory of `cells` idle cells of each kind, per cell: the warden's gVisor cells (each one's
/// keeper and everything below it: host side, runsc, gofer, sandbox) beside containers made by
/// hand (`runsc run` and below). Shared pages (the binaries') are divided among the processes
/// that map them, as PSS divides them.
fn idle_memory(setup: &Setup, daemon: &Daemon, cells: usize) -> Result<()> {
    let sleeper = bundle(&setup.dir, &["sleep", "3600"])?;
    let mut containers = Vec::new();
    for i in 0..cells {
        let id = format!("bench-idle-{i}");
        let child = piped(
            setup
                .runsc
                .command()
                .args(["run", "--bundle"])
                .arg(&sleeper)
                .arg(&id),
        )
        .spawn()?;
        setup.runsc.wait_running(&id)?;
        containers.push((id, child));
        let body = serde_json::json!({
            "name": format!("idle{i}"),
            "policy": "version: 1\nextends: default\ntier: gvisor\n",
        });
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body.to_string())?;
        if status != 201 {
            bail!("creating an idle cell failed: {raw}");
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let (mut cell_pss, mut cell_rss, mut cell_procs) = (0, 0, 0);
    // Of those, the warden's own processes (the keeper, the host side of its execs).
    let warden = std::fs::canonicalize(&setup.warden).unwrap_or_default();
    let (mut warden_pss, mut warden_rss) = (0, 0);
    for i in 0..cells {
        // The cell's keeper (its registry record names it) and everything below it.
        let record: serde_json::Value = serde_json::from_slice(&std::fs::read(
            daemon
                .runtime()
                .join("cells")
                .join(format!("idle{i}"))
                .join("cell.json"),
        )?)?;
        let keeper = record["warden_pid"]
            .as_u64()
            .context("the cell's record has no keeper")? as u32;
        for pid in warden_bench::tree_pids(keeper) {
            if std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == warden) {
                let (pss, rss) = warden_bench::memory_kib(pid);
                warden_pss += pss;
                warden_rss += rss;
            }
        }
        let (pss, rss, procs) = tree_memory(keeper);
        cell_pss += pss;
        cell_rss += rss;
        cell_procs += procs;
    }
    let (mut own_pss, mut own_rss, mut own_procs) = (0, 0, 0);
    for (_, child) in &containers {
        let (pss, rss, procs) = tree_memory(child.id());
        own_pss += pss;
        own_rss += rss;
        own_procs += procs;
    }
    let n = cells as u64;
    warden_bench::say!(
        "{:<44} {:>12} {:>12} {:>10}",
        "per cell",
        "PSS",
        "RSS",
        "processes"
    );
    for (name, pss, rss, procs) in [
        (
            "a gVisor cell of the warden's",
            cell_pss / n,
            cell_rss / n,
            cell_procs / cells,
        ),
        (
            "runsc run (container by hand)",
            own_pss / n,
            own_rss / n,
            own_procs / cells,
        ),
    ] {
        warden_bench::say!("{name:<44} {:>8} KiB {:>8} KiB {procs:>10}", pss, rss);
    }
    warden_bench::say!(
        "{:<44} {:>+8} KiB {:>+8} KiB",
        "the warden's own part",
        (cell_pss / n) as i64 - (own_pss / n) as i64,
        (cell_rss / n) as i64 - (own_rss / n) as i64
    );
    warden_bench::say!(
        "{:<44} {:>8} KiB {:>8} KiB {:>10}",
        "  of it, the keeper and its host side",
        warden_pss / n,
        warden_rss / n,
        2
    );
    // Once per daemon, not per cell (as the daemon itself): the server that forks keepers.
    for server in warden_bench::children_named(daemon.child.id(), "keepers") {
        let (pss, rss) = warden_bench::memory_kib(server);
        warden_bench::say!(
            "{:<44} {:>8} KiB {:>8} KiB {:>10}",
            "(once per daemon) the keepers' fork server",
            pss,
            rss,
            1
        );
    }
    for i in 0..cells {
        let _ = request(&daemon.socket, "DELETE", &format!("/v1/cells/idle{i}"), "");
    }
    for (id, child) in containers {
        setup.runsc.end(&id, Some(child));
    }
    Ok(())
}

fn checkpoints(
    setup: &Setup,
    daemon: &Daemon,
    rounds: usize,
) -> Result<Vec<(String, Vec<Duration>)>> {
    let workspace = setup.dir.join("ckpt-ws");
    std::fs::create_dir_all(&workspace)?;
    let (mut save, mut back, mut save_hand, mut back_hand) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let sleeper = bundle(&setup.dir, &["sleep", "3600"])?;
    for round in 0..rounds {
        let body = serde_json::json!({
            "name": format!("ck{round}"),
            "policy": "version: 1\nextends: default\ntier: gvisor\n",
            "workspace": workspace,
        });
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body.to_string())?;
        if status != 201 {
            bail!("creating a cell failed: {raw}");
        }
        std::thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        let (status, raw) = request(
            &daemon.socket,
            "POST",
            &format!("/v1/cells/ck{round}/checkpoint"),
            r#"{"as":"c"}"#,
        )?;
        save.push(start.elapsed());
        if status != 201 {
            bail!("checkpoint failed: {raw}");
        }
        let start = Instant::now();
        let body = format!(r#"{{"name":"back{round}","restore":"ck{round}@c"}}"#);
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body)?;
        back.push(start.elapsed());
        if status != 201 {
            bail!("restore failed: {raw}");
        }
        let _ = request(
            &daemon.socket,
            "DELETE",
            &format!("/v1/cells/back{round}"),
            "",
        );

        let id = format!("bench-ck{round}");
        let container = piped(
            setup
                .runsc
                .command()
                .args(["run", "--bundle"])
                .arg(&sleeper)
                .arg(&id),
        )
        .spawn()?;
        setup.runsc.wait_running(&id)?;
        std::thread::sleep(Duration::from_millis(200));
        let image = setup.dir.join(format!("image-{round}"));
        std::fs::create_dir_all(&image)?;
        save_hand.push(run(setup
            .runsc
            .command()
            .arg("checkpoint")
            .arg("--image-path")
            .arg(&image)
            .arg(&id))?);
        setup.runsc.end(&id, Some(container));
        let start = Instant::now();
        let restored = piped(
            setup
                .runsc
                .command()
                .arg("restore")
                .arg("--image-path")
                .arg(&image)
                .arg("--bundle")
                .arg(&sleeper)
                .arg(&id),
        )
        .spawn()?;
        setup.runsc.wait_running(&id)?;
        back_hand.push(start.elapsed());
        setup.runsc.end(&id, Some(restored));
    }
    Ok(vec![
        ("warden checkpoint (API)".to_owned(), save),
        ("runsc checkpoint (container by hand)".to_owned(), save_hand),
        (
            "warden restore (API, until it takes execs)".to_owned(),
            back,
        ),
        ("runsc restore (until it runs)".to_owned(), back_hand),
    ])
}

fn main() -> Result<()> {
    warden_bench::end_on_signal()?;
    let mut runs = 30usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().context("--runs needs a number")?.parse()?,
            "--help" | "-h" => {
                warden_bench::say!("usage: gvisor-bench [--runs N]");
                return Ok(());
            }
            other => bail!("unknown argument {other}; use --runs N"),
        }
    }
    if !is_root() {
        bail!("run it as root: the gVisor tier and runsc make their sandboxes as root");
    }
    let runsc = which("runsc").context("runsc is not installed (apt-get install runsc)")?;
    let warden = std::env::current_exe()?.with_file_name("warden");
    if !warden.exists() {
        bail!(
            "{} is missing: build it with `cargo build --release`",
            warden.display()
        );
    }
    warden_bench::settle(&warden)?;
    let dir = std::env::temp_dir().join(format!("warden-bench-gvisor-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let setup = Setup {
        warden,
        runsc: Runsc {
            binary: runsc,
            root: dir.join("runsc"),
        },
        dir: dir.clone(),
    };

    warden_bench::say!("cold start: create, run `true`, tear down ({runs} rounds, interleaved)");
    // A daemon of its own (its pool's cells are not idle cells of the memory table below).
    let pool_dir = dir.join("pool");
    std::fs::create_dir_all(&pool_dir)?;
    let policy_file = pool_dir.join("gvisor.yaml");
    std::fs::write(&policy_file, GVISOR_POLICY)?;
    let pool = Daemon::start(
        &setup.warden,
        &pool_dir,
        &["--pool", &format!("{}=2", policy_file.display())],
    )?;
    let mut rows = cold_start(&setup, &pool, runs)?;
    drop(pool);
    rows.swap(0, 1);
    table(&mut rows, "median/runsc run");

    let daemon = Daemon::start(&setup.warden, &dir, &[])?;
    for (name, policy) in [
        ("gv", GVISOR_POLICY),
        ("pt", "version: 1\nextends: default\n"),
    ] {
        let body = serde_json::json!({ "name": name, "policy": policy });
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body.to_string())?;
        if status != 201 {
            bail!("creating cell {name} failed: {raw}");
        }
    }
    warden_bench::say!("\nexec round trip of `true` ({runs} runs each, interleaved)");
    let mut rows = exec_round_trip(&setup, &daemon, runs)?;
    rows.swap(0, 1);
    table(&mut rows, "median/runsc exec");

    let cells = 5;
    warden_bench::say!("\nmemory of an idle cell ({cells} idle cells of each kind, at once)");
    idle_memory(&setup, &daemon, cells)?;

    let rounds = (runs / 5).max(3);
    warden_bench::say!(
        "\ncheckpoint and restore ({rounds} rounds; a cell running `sleep`, a workspace with nothing changed)"
    );
    let mut rows = checkpoints(&setup, &daemon, rounds)?;
    table(&mut rows, "median/warden ckpt");
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
