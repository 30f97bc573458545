//! Workspace benchmark: on a tree of 10,000 files of which a cell changed 1,000, time `warden
//! diff`, `snapshot`, `reset` (of the running cell) and `fork`, and cold start with a
//! copy-on-write workspace beside one without. Each figure is the wall time of the whole
//! `warden` command, as a user sees it.
//!
//! Then, through a daemon of its own, the curve of a snapshot and of a reset to a snapshot by how
//! many of the 10,000 files the cell changed (10 to 10,000): of a cell whose init runs alone
//! (its upper layer turned into the snapshot's, nothing copied), beside the same snapshot of the
//! same cell with a process running (copied). Each figure is the time of the API request.
//!
//! Usage: `workspace-ops [--runs N] [--warden PATH]` (as root or as an ordinary user).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

const DIRS: usize = 100;
const FILES_PER_DIR: usize = 100;
const CHANGED: usize = 1000;

fn warden(bin: &str, args: &[&str]) -> Result<Duration> {
    let start = Instant::now();
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin}"))?;
    let took = start.elapsed();
    if !out.status.success() {
        bail!(
            "warden {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

fn make_tree(root: &Path) -> Result<()> {
    let content = vec![b'x'; 1024];
    for d in 0..DIRS {
        let dir = root.join(format!("d{d:03}"));
        std::fs::create_dir_all(&dir)?;
        for f in 0..FILES_PER_DIR {
            std::fs::write(dir.join(format!("f{f:03}.txt")), &content)?;
        }
    }
    Ok(())
}

struct Stats {
    name: &'static str,
    samples: Vec<Duration>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len().saturating_sub(1))]
}

fn main() -> Result<()> {
    warden_bench::end_on_signal()?;
    let mut runs = 15usize;
    let mut bin = String::from("target/release/warden");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().context("--runs needs a number")?.parse()?,
            "--warden" => bin = args.next().context("--warden needs a path")?,
            "--help" | "-h" => {
                warden_bench::say!("usage: workspace-ops [--runs N] [--warden PATH]");
                return Ok(());
            }
            other => {
                bail!("unknown argument {other}; usage: workspace-ops [--runs N] [--warden PATH]")
            }
        }
    }
    let bin = std::fs::canonicalize(&bin)
        .with_context(|| format!("{bin} not found; build with `cargo build --release`"))?;
    let bin = bin.to_str().context("warden path is not UTF-8")?.to_owned();
    warden_bench::settle(std::path::Path::new(&bin))?;
    let tmp = std::env::temp_dir().join(format!("warden-bench-ws-{}", std::process::id()));
    let tree = tmp.join("tree");
    make_tree(&tree)?;
    let result = measure(&bin, &tree, runs);
    // Each file system a layer's disk can have, where this host can make it.
    let kinds: Vec<&str> = ["btrfs", "ext4"]
        .into_iter()
        .filter(|kind| {
            let program = match *kind {
                "btrfs" => "mkfs.btrfs",
                _ => "mke2fs",
            };
            ["/usr/sbin", "/sbin", "/usr/bin"]
                .iter()
                .any(|dir| Path::new(dir).join(program).exists())
        })
        .collect();
    let curves = result.as_ref().ok().map(|_| {
        kinds
            .iter()
            .map(|kind| {
                let curve = curve(&bin, &tmp, &tree, runs.min(20), kind)?;
                let cost = kernel_cost(&bin, &tmp, &tree, kind)?;
                Ok((*kind, curve, cost))
            })
            .collect::<Result<Vec<_>>>()
    });
    let _ = std::fs::remove_dir_all(&tmp);
    let stats = result?;
    warden_bench::say!(
        "workspace of {} files, {CHANGED} changed by the cell ({runs} runs each)",
        DIRS * FILES_PER_DIR
    );
    warden_bench::say!();
    warden_bench::say!(
        "| {:<40} | {:>11} | {:>8} |",
        "operation",
        "median (ms)",
        "p90 (ms)"
    );
    warden_bench::say!("|{:-<42}|{:->13}|{:->10}|", "", "", "");
    let mut medians = Vec::new();
    for mut s in stats {
        s.samples.sort();
        let median = percentile(&s.samples, 0.5);
        medians.push((s.name, median));
        warden_bench::say!(
            "| {:<40} | {:>11.2} | {:>8.2} |",
            s.name,
            ms(median),
            ms(percentile(&s.samples, 0.9))
        );
    }
    let get = |name: &str| {
        medians
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, d)| ms(*d))
            .unwrap_or(0.0)
    };
    warden_bench::say!();
    warden_bench::say!(
        "{FLOOR}: the {CHANGED} files the reset to a snapshot writes, rewritten in place (open, write, cut to length, close) in a scratch folder of the cell's disk ({}), without the overlay or the cell: what the file system alone takes for them",
        floor_fs().unwrap_or("the state folder's file system")
    );
    warden_bench::say!(
        "fork beyond a plain cold start: {:.2} ms; overlay workspace beyond no workspace: {:.2} ms",
        get("fork from a snapshot, run `true`") - get("cold start, no workspace"),
        get("cold start, copy-on-write workspace") - get("cold start, no workspace"),
    );
    let curves = curves.context("no curve")??;
    warden_bench::say!();
    warden_bench::say!(
        "through the daemon: snapshot and reset by files changed (of {}), median ms ({} runs each), by the file system of the cell's disk",
        DIRS * FILES_PER_DIR,
        runs.min(20)
    );
    warden_bench::say!();
    let mut head = format!("| {:>13} |", "files changed");
    let mut rule = format!("|{:->15}|", "");
    for (kind, _, _) in &curves {
        for column in [
            "snapshot (quiet)",
            "snapshot (process runs)",
            "reset (quiet)",
        ] {
            let name = format!("{kind}: {column}");
            head.push_str(&format!(" {name:>30} |"));
            rule.push_str(&format!("{:->32}|", ""));
        }
    }
    warden_bench::say!("{head}");
    warden_bench::say!("{rule}");
    for (i, changed) in CURVE_POINTS.iter().enumerate() {
        let mut line = format!("| {changed:>13} |");
        for (_, curve, _) in &curves {
            let row = &curve[i];
            for value in [row.snapshot, row.copied, row.reset] {
                line.push_str(&format!(" {:>30.2} |", ms(value)));
            }
        }
        warden_bench::say!("{line}");
    }
    warden_bench::say!();
    warden_bench::say!(
        "quiet: the cell's init runs alone, and its upper layer becomes the snapshot's (the \
         workspace is mounted again on a fresh one); process runs: a `sleep` holds the \
         workspace, and the snapshot is a clone of the disk's tree taken while the cell is \
         frozen (btrfs) or a copy (ext4). A reset of a quiet cell mounts the target's layers \
         again. Up to 100 entries are copied on either. Each cell keeps its rounds' \
         snapshots, on an 8 GiB disk limit (past half of a disk's inodes or blocks, snapshots copy \
         instead)"
    );
    warden_bench::say!();
    warden_bench::say!(
        "what a mounted disk costs the kernel ({KERNEL_CELLS} daemon cells with a workspace, each with a disk of its own, against none)"
    );
    warden_bench::say!();
    warden_bench::say!(
        "| {:<17} | {:>33} | {:>23} |",
        "disk file system",
        "kernel memory per cell (KiB)",
        "kernel threads per cell"
    );
    warden_bench::say!("|{:-<19}|{:->35}|{:->25}|", "", "", "");
    for (kind, _, (memory, threads)) in &curves {
        warden_bench::say!("| {kind:<17} | {memory:>33} | {threads:>23.1} |");
    }
    warden_bench::say!();
    warden_bench::say!(
        "kernel memory: unreclaimable slab and kernel stacks, read from /proc/meminfo before and after (the cells' other kernel objects, namespaces and cgroups, are in both rows alike)"
    );
    Ok(())
}

/// The curve's cells keep every round's snapshot, each up to 10,000 files: their disk is
/// large enough that those stay under half of its inodes, where snapshots are kept in it
/// (turned over or cloned) rather than copied (past half, they copy out of it by design).
const CURVE_POLICY: &str = "version: 1\nextends: default\nlimits:\n  disk: 8GiB\n";

/// One point of the curve: medians.
struct Point {
    snapshot: Duration,
    reset: Duration,
    copied: Duration,
}

/// The row of the file system's own floor under a running cell's reset to a snapshot.
const FLOOR: &str = "same rewrites, cell's disk, no overlay";

/// The file system the floor was measured on, once measured.
static FLOOR_FS: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn floor_fs() -> Option<&'static str> {
    FLOOR_FS.get().copied()
}

/// What the file system alone takes to rewrite the files a running cell's reset to a snapshot
/// writes: `CHANGED` files of the tree's size, written and synced (untimed), then each opened,
/// written with the snapshot's content, cut to its length and closed (timed), as the reset's
/// helper does through the overlay. In a scratch folder of the cell's disk (its file system,
/// mounted beside the layer), or of the state folder where the cell has none.
fn rewrite_floor(layer_dir: &Path) -> Result<Duration> {
    use nix::sys::statfs::{BTRFS_SUPER_MAGIC, EXT4_SUPER_MAGIC, statfs};
    use std::os::unix::fs::{FileExt as _, MetadataExt as _};
    let disk = layer_dir.join("fs");
    // The disk's file system is mounted there (another device than the layer's folder).
    let mounted = std::fs::metadata(&disk)
        .ok()
        .zip(std::fs::metadata(layer_dir).ok())
        .is_some_and(|(d, l)| d.dev() != l.dev());
    let kind = statfs(&disk)
        .ok()
        .filter(|_| mounted)
        .map(|s| s.filesystem_type());
    let (dir, name) = match kind {
        Some(t) if t == BTRFS_SUPER_MAGIC => (disk, "btrfs"),
        Some(t) if t == EXT4_SUPER_MAGIC => (disk, "ext4"),
        Some(_) => (disk, "its file system"),
        None => (layer_dir.to_path_buf(), "the state folder's file system"),
    };
    let _ = FLOOR_FS.set(name);
    let scratch = dir.join(format!(".bench-floor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir(&scratch)?;
    let content = vec![b'x'; 1024];
    for i in 0..CHANGED {
        std::fs::write(scratch.join(format!("f{i}")), &content)?;
    }
    quiesce()?;
    let start = Instant::now();
    for i in 0..CHANGED {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(scratch.join(format!("f{i}")))?;
        file.write_all_at(b"changed\n", 0)?;
        file.set_len(8)?;
    }
    let took = start.elapsed();
    std::fs::remove_dir_all(&scratch)?;
    Ok(took)
}

/// Files changed at each point of the curve.
const CURVE_POINTS: [usize; 4] = [10, 100, 1000, 10_000];

/// Snapshots and resets of daemon cells on `tree` that changed 10 to 10,000 of its files.
fn curve(bin: &str, tmp: &Path, tree: &Path, runs: usize, kind: &str) -> Result<Vec<Point>> {
    let daemon = warden_bench::Daemon::start_with_env(
        Path::new(bin),
        &tmp.join(format!("daemon-{kind}")),
        &[],
        &[("WARDEN_LAYER_FS", kind)],
    )?;
    let call = |method: &str, path: &str, body: &str| -> Result<Duration> {
        let start = Instant::now();
        let (status, raw) = warden_bench::request(&daemon.socket, method, path, body)?;
        let took = start.elapsed();
        // An exec's stream ends with its exit event, which must say it exited with 0.
        let failed =
            raw.contains("event: exit") && !raw.contains("\"reason\":\"exited\",\"code\":0");
        if status >= 300 || failed {
            bail!("{method} {path} answered {status}: {raw}");
        }
        Ok(took)
    };
    let mut out = Vec::new();
    for (i, changed) in CURVE_POINTS.into_iter().enumerate() {
        let cell = format!("curve{i}");
        call(
            "POST",
            "/v1/cells",
            &serde_json::json!({
                "name": cell,
                "workspace": tree.display().to_string(),
                "policy": CURVE_POLICY,
            })
            .to_string(),
        )?;
        // Each round rewrites `changed` files (untimed) with new content.
        let change = |round: usize| {
            let script = format!(
                "cd /workspace && n=0; for f in d*/f*.txt; do echo {round} > $f; n=$((n+1)); \
                 [ $n -ge {changed} ] && break; done"
            );
            call(
                "POST",
                &format!("/v1/cells/{cell}/exec"),
                &serde_json::json!({ "argv": ["sh", "-c", script] }).to_string(),
            )
        };
        let snapshot = |name: &str| {
            call(
                "POST",
                &format!("/v1/cells/{cell}/snapshot"),
                &format!(r#"{{"as":"{name}"}}"#),
            )
        };
        change(0)?;
        snapshot("base")?;
        let (mut snaps, mut resets, mut copies) = (Vec::new(), Vec::new(), Vec::new());
        for round in 1..=runs {
            change(round)?;
            quiesce()?;
            snaps.push(snapshot(&format!("q{round}"))?);
            change(round)?;
            quiesce()?;
            resets.push(call(
                "POST",
                &format!("/v1/cells/{cell}/reset"),
                r#"{"to":"base"}"#,
            )?);
        }
        // The same, with a process holding the workspace: copied.
        call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            r#"{"argv":["sleep","3600"],"background":true}"#,
        )?;
        for round in 1..=runs {
            change(round + runs)?;
            quiesce()?;
            copies.push(snapshot(&format!("c{round}"))?);
        }
        call("DELETE", &format!("/v1/cells/{cell}"), "")?;
        let median = |samples: &mut Vec<Duration>| warden_bench::percentile(samples, 0.5);
        out.push(Point {
            snapshot: median(&mut snaps),
            reset: median(&mut resets),
            copied: median(&mut copies),
        });
    }
    Ok(out)
}

/// Cells made for the kernel's share.
const KERNEL_CELLS: usize = 20;

/// What the kernel holds per daemon cell with a workspace whose disk is `kind`: KiB of
/// unreclaimable slab and kernel stacks, and kernel threads.
fn kernel_cost(bin: &str, tmp: &Path, tree: &Path, kind: &str) -> Result<(i64, f64)> {
    let daemon = warden_bench::Daemon::start_with_env(
        Path::new(bin),
        &tmp.join(format!("kernel-{kind}")),
        &[],
        &[("WARDEN_LAYER_FS", kind)],
    )?;
    let memory = || -> Result<i64> {
        let info = std::fs::read_to_string("/proc/meminfo")?;
        Ok(info
            .lines()
            .filter(|l| l.starts_with("SUnreclaim:") || l.starts_with("KernelStack:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<i64>().ok())
            .sum())
    };
    // Kernel threads: children of kthreadd (pid 2).
    let threads = || -> i64 {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter(|e| {
                std::fs::read_to_string(e.path().join("stat")).is_ok_and(|stat| {
                    stat.rsplit(')')
                        .next()
                        .and_then(|rest| rest.split_whitespace().nth(1))
                        == Some("2")
                })
            })
            .count() as i64
    };
    std::thread::sleep(Duration::from_millis(500));
    let (memory_before, threads_before) = (memory()?, threads());
    for i in 0..KERNEL_CELLS {
        let body = serde_json::json!({
            "name": format!("kernel{i}"),
            "workspace": tree.display().to_string(),
        });
        let (status, raw) =
            warden_bench::request(&daemon.socket, "POST", "/v1/cells", &body.to_string())?;
        if status != 201 {
            bail!("creating a cell failed: {raw}");
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let (memory_after, threads_after) = (memory()?, threads());
    for i in 0..KERNEL_CELLS {
        let _ = warden_bench::request(
            &daemon.socket,
            "DELETE",
            &format!("/v1/cells/kernel{i}"),
            "",
        );
    }
    // The layers of cells that went are removed in the background: the daemon stays until they
    // are (its end would leave their disks mounted).
    let layers = tmp.join(format!("kernel-{kind}")).join("state/layers");
    wait_while(
        Duration::from_secs(30),
        "the layers of the removed cells were not removed",
        || holds(&layers, |n| n.starts_with("kernel") || n.contains(".gone-")),
    )?;
    drop(daemon);
    let cells = KERNEL_CELLS as i64;
    Ok((
        (memory_after - memory_before) / cells,
        (threads_after - threads_before) as f64 / cells as f64,
    ))
}

/// The warden's state directory, as it chooses it (see `Store::default_root`).
fn state_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("WARDEN_STATE_DIR") {
        return dir.into();
    }
    let root =
        std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0);
    if root {
        return "/var/lib/warden".into();
    }
    match std::env::var_os("XDG_DATA_HOME") {
        Some(dir) => Path::new(&dir).join("warden"),
        None => {
            Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".local/share/warden")
        }
    }
}

/// Writes back (untimed) what earlier steps left dirty, so that a copying step is not charged
/// for the previous step's disk writes.
fn quiesce() -> Result<()> {
    let status = Command::new("sync").status()?;
    if !status.success() {
        bail!("sync failed");
    }
    Ok(())
}

/// Waits (untimed) until a reset's old layer, removed in the background, is gone, so that the
/// next measurement does not share the disk with it.
fn settle(layer_dir: &Path) -> Result<()> {
    // A reset's old upper in the layer, and layers of cells that went (`.gone-*`) beside it.
    let layers = layer_dir.parent().unwrap_or(layer_dir);
    wait_while(
        Duration::from_secs(10),
        "the old layers of a reset were not removed",
        || {
            holds(layer_dir, |n| n.contains(".old-"))
                || holds(&layer_dir.join("fs"), |n| n.contains(".old-"))
                || holds(layers, |n| n.contains(".gone-"))
        },
    )
}

/// Whether `dir` holds an entry whose name `matches`.
fn holds(dir: &Path, matches: impl Fn(&str) -> bool) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| matches(&e.file_name().to_string_lossy()))
    })
}

/// Waits (untimed) while `busy()` holds, at most `limit`; `what` says what did not happen.
fn wait_while(limit: Duration, what: &str, busy: impl Fn() -> bool) -> Result<()> {
    let deadline = Instant::now() + limit;
    while busy() {
        if Instant::now() > deadline {
            bail!("{what} within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn measure(bin: &str, tree: &Path, runs: usize) -> Result<Vec<Stats>> {
    let tree_str = tree.to_str().context("path is not UTF-8")?;
    let cell = format!("bench-{}", std::process::id());
    // The cell changes 1,000 files and stays up, so that diff, snapshot and reset see a live cell.
    let script = format!(
        "cd /workspace && n=0; for f in d0[0-9][0-9]/f00[0-9].txt; do echo changed > $f; n=$((n+1)); \
         [ $n -ge {CHANGED} ] && break; done; echo ready; exec sleep 3600"
    );
    let mut child: Child = Command::new(bin)
        .args([
            "run",
            "--rm",
            "--name",
            &cell,
            "--workspace",
            tree_str,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    {
        use std::io::BufRead as _;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("the benchmark cell did not start: {line:?}");
        }
    }
    let result = (|| -> Result<Vec<Stats>> {
        let mut stats = vec![
            Stats {
                name: "diff (running cell, frozen while read)",
                samples: Vec::new(),
            },
            Stats {
                name: "snapshot (running cell)",
                samples: Vec::new(),
            },
            Stats {
                name: "reset to the start (running cell)",
                samples: Vec::new(),
            },
            Stats {
                name: "reset to a snapshot (running cell)",
                samples: Vec::new(),
            },
            Stats {
                name: "fork from a snapshot, run `true`",
                samples: Vec::new(),
            },
            Stats {
                name: "cold start, copy-on-write workspace",
                samples: Vec::new(),
            },
            Stats {
                name: "cold start, no workspace",
                samples: Vec::new(),
            },
            Stats {
                name: FLOOR,
                samples: Vec::new(),
            },
        ];
        warden(bin, &["snapshot", &cell, "--as", "base"])?;
        let layers = state_dir().join("layers").join(&cell);
        let base = format!("{cell}@base");
        for i in 0..runs {
            stats[0]
                .samples
                .push(warden(bin, &["diff", &cell, "--stat"])?);
            let snap = format!("s{i}");
            quiesce()?;
            stats[1]
                .samples
                .push(warden(bin, &["snapshot", &cell, "--as", &snap])?);
            warden(bin, &["rm", &format!("{cell}@{snap}")])?;
            stats[2].samples.push(warden(bin, &["reset", &cell])?);
            settle(&layers)?;
            quiesce()?;
            stats[3]
                .samples
                .push(warden(bin, &["reset", &cell, "--to", "base"])?);
            settle(&layers)?;
            let fork = format!("{cell}-f{i}");
            stats[4].samples.push(warden(
                bin,
                &["fork", &base, "--rm", "--name", &fork, "--", "true"],
            )?);
            settle(&layers)?;
            stats[5].samples.push(warden(
                bin,
                &["run", "--rm", "--workspace", tree_str, "--", "true"],
            )?);
            settle(&layers)?;
            stats[6]
                .samples
                .push(warden(bin, &["run", "--rm", "--", "true"])?);
            stats[7].samples.push(rewrite_floor(&layers)?);
        }
        Ok(stats)
    })();
    let _ = warden(bin, &["kill", &cell]);
    let _ = child.wait();
    let _ = warden(bin, &["rm", &cell]);
    let _ = warden(bin, &["rm", &format!("{cell}@base")]);
    result
}
