//! One function per subcommand, each a thin translation onto the core crates.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use warden_cell::{Ending, Registry, SnapshotInfo, Store, changes, control, probe, snapshot};
use warden_policy::Policy;
use warden_protocol::{CellState, CellSummary, exit};
use warden_workspace::{Change, ChangeKind, EntryKind};

use crate::cli::{Cli, Command, PolicyCommand, RunArgs};

pub fn dispatch(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Run(args) => run(args, None),
        Command::Ps { json, all } => ps(json, all),
        Command::Diff { name, json, stat } => diff(&name, json, stat),
        Command::Apply {
            name,
            paths,
            dry_run,
            force,
            include_sensitive,
            digest,
            json,
        } => {
            let request = warden_protocol::ApplyRequest {
                paths,
                dry_run,
                force,
                include_sensitive,
                digest,
            };
            apply(&name, request, json)
        }
        Command::Rm { name, force } => {
            if name.contains('@') && crate::daemon::remove_snapshot_through_daemon(&name)? {
                // The daemon removed it, and journaled it.
            } else if name.contains('@') {
                let store = store()?;
                snapshot::remove(&store, &name)?;
                // A checkpoint's memory image goes with its workspace snapshot.
                let image = store.root().join("checkpoints").join(&name);
                if !name.contains('/') && image.is_dir() {
                    std::fs::remove_dir_all(&image)
                        .with_context(|| format!("removing {}", image.display()))?;
                }
            } else if crate::daemon::remove_through_daemon(&name, force)? {
                // A daemon cell: the daemon removed it with its layer and records.
            } else {
                let store = store()?;
                // A cell that only has an egress log left still counts as something to remove.
                let log = store.net_log_path(&name);
                let had_log = warden_cell::check_name(&name).is_ok() && log.exists();
                match snapshot::remove_layer(&registry()?, &store, &name) {
                    Err(changes::ChangesError::NoLayer(_)) if had_log => {}
                    other => other?,
                }
                if had_log {
                    std::fs::remove_file(&log)
                        .with_context(|| format!("removing {}", log.display()))?;
                }
            }
            println!("removed {name}");
            Ok(0)
        }
        Command::Net { name, json } => net(&name, json),
        Command::Approvals { name, json } => approvals(name.as_deref(), json),
        Command::Approve { name, id, scope } => {
            let answer = warden_protocol::Answer {
                decision: warden_protocol::Decision::Approve,
                scope: match scope.as_str() {
                    "cell" => warden_protocol::Scope::Cell,
                    "always" => warden_protocol::Scope::Always,
                    _ => warden_protocol::Scope::Once,
                },
            };
            let warden = crate::core::for_cell(&name)?;
            warden.answer(&name, id, &answer)?;
            match warden.who() {
                "the daemon" => println!("approved question {id} of {name} (scope {scope})"),
                _ => println!("approved question {id} of {name}"),
            }
            Ok(0)
        }
        Command::Deny { name, id } => {
            let answer = warden_protocol::Answer {
                decision: warden_protocol::Decision::Deny,
                scope: warden_protocol::Scope::Once,
            };
            crate::core::for_cell(&name)?.answer(&name, id, &answer)?;
            println!("denied question {id} of {name}");
            Ok(0)
        }
        Command::Snapshot { name, as_name } => {
            let info = crate::core::for_cell(&name)?.snapshot(&name, as_name.as_deref())?;
            match info.size {
                Some(size) => println!("{} ({size} bytes)", info.id),
                None => println!("{} (taken without a copy)", info.id),
            }
            Ok(0)
        }
        Command::Snapshots { json } => snapshots(json),
        Command::Checkpoint { name, as_name } => crate::daemon::checkpoint(&name, as_name),
        Command::Restore { checkpoint, name } => crate::daemon::restore(&checkpoint, name),
        Command::Reset { name, to } => {
            let to = to.map(|t| {
                if t.contains('@') {
                    t
                } else {
                    format!("{name}@{t}")
                }
            });
            crate::core::for_cell(&name)?.reset(&name, to.as_deref())?;
            println!("reset {name} to {}", to.as_deref().unwrap_or("its start"));
            Ok(0)
        }
        Command::Fork { source, run } => {
            let (registry, store) = (registry()?, store()?);
            let from = if source.contains('@') {
                snapshot::get(&store, &source)?
            } else {
                snapshot::take(&registry, &store, &source, None)?
            };
            self::run(run, Some(from))
        }
        Command::Pause { name } => control_cell(&name, warden_protocol::ControlAction::Pause),
        Command::Resume { name } => control_cell(&name, warden_protocol::ControlAction::Resume),
        Command::Kill { name } => control_cell(&name, warden_protocol::ControlAction::Kill),
        Command::Policy { command } => policy(command),
        Command::Doctor { json } => doctor(json),
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            let mut command = crate::cli::Cli::command();
            clap_complete::generate(shell, &mut command, "warden", &mut std::io::stdout());
            Ok(0)
        }
        Command::Man => {
            use clap::CommandFactory as _;
            // The whole tree on one page: each subcommand with its own synopsis and options.
            let command = crate::cli::Cli::command();
            let mut out = Vec::new();
            clap_mangen::Man::new(command.clone())
                .render(&mut out)
                .context("writing the manual page")?;
            for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
                let name = format!("warden {}", sub.get_name());
                let page = clap_mangen::Man::new(sub.clone().bin_name(name.clone()));
                out.extend_from_slice(format!(".SH \"{}\"\n", name.to_uppercase()).as_bytes());
                page.render_synopsis_section(&mut out)
                    .and_then(|()| page.render_description_section(&mut out))
                    .and_then(|()| page.render_options_section(&mut out))
                    .context("writing the manual page")?;
            }
            std::io::Write::write_all(&mut std::io::stdout(), &out)
                .context("writing the manual page")?;
            Ok(0)
        }
        Command::Mcp => crate::daemon::mcp(),
        Command::Image { command } => image(command),
        Command::Dashboard => crate::daemon::dashboard(),
        Command::Serve {
            listen,
            token_file,
            e2b,
            journal_segment_mib,
            journal_keep_segments,
            keepers_ahead,
            pool,
            api_threads,
        } => crate::daemon::serve(crate::daemon::ServeArgs {
            listen,
            token_file,
            e2b,
            journal_segment_mib,
            journal_keep_segments: journal_keep_segments.map(|n| n as usize),
            keepers_ahead: keepers_ahead as usize,
            pools: pool,
            api_threads: api_threads.map(|n| n as usize),
        }),
        Command::Agent { command } => crate::daemon::agent(command),
        Command::Create(args) => crate::daemon::create(args),
        Command::Cp { source, dest } => crate::daemon::copy(&source, &dest),
        Command::Logs {
            name,
            follow,
            process,
        } => crate::daemon::logs(&name, follow, process),
        Command::Exec(args) => crate::daemon::exec(args),
        Command::Audit { command } => crate::daemon::audit(command),
        Command::Replay { name, json, rerun } => match rerun {
            true => crate::daemon::rerun(&name, json),
            false => crate::daemon::replay(&name, json),
        },
        Command::Keep => crate::daemon::keep(),
        Command::Keepers => crate::daemon::keepers(),
    }
}

fn registry() -> Result<Registry> {
    Ok(Registry::open(Registry::default_root())?)
}

fn store() -> Result<Store> {
    Ok(Store::open(Store::default_root())?)
}

fn run(args: RunArgs, from: Option<SnapshotInfo>) -> Result<i32> {
    let policy = crate::policy::effective(&args.policy)?;
    let mut env = Vec::new();
    for pair in &args.env {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--env {pair}: write it as KEY=VALUE");
        };
        if key.is_empty() || key.contains('\0') || value.contains('\0') {
            bail!("--env {pair}: the name must be non-empty and neither part may contain NUL");
        }
        env.push((key.to_owned(), value.to_owned()));
    }
    // With a daemon running, the run goes through it (and into its journal).
    if let Some(client) = crate::daemon::client_if_running() {
        warden_cell::let_go_of_early_network();
        return crate::daemon::run_through(&client, &args, &policy, &env, from.map(|f| f.id));
    }
    let outcome = match run_in_process(args, &policy, env, from.map(|f| f.id))? {
        Ok(end) => end.attached,
        Err(status) => return Ok(status),
    };
    for notice in &outcome.notices {
        eprintln!("warden: note: {notice}");
    }
    let name = &outcome.name;
    if outcome.kept_changes {
        eprintln!(
            "warden: cell {name} changed its workspace; the host directory is untouched. Review with \
             `warden diff {name}`, then `warden apply {name}` or `warden rm {name}`."
        );
    }
    Ok(match outcome.ending {
        Ending::Exited(code) => code,
        Ending::Signaled(signal) => 128 + signal,
        Ending::MemoryLimit { limit } => {
            eprintln!(
                "warden: cell {name}: memory limit {} exceeded: killed",
                warden_policy::ByteSize(limit)
            );
            exit::MEMORY_LIMIT
        }
        Ending::WallLimit { limit } => {
            eprintln!(
                "warden: cell {name}: wall-clock limit {} exceeded: killed",
                humanize(limit)
            );
            exit::WALL_LIMIT
        }
        Ending::OutputLimit { limit } => {
            eprintln!(
                "warden: cell {name}: output limit {} exceeded: killed",
                warden_policy::ByteSize(limit)
            );
            exit::OUTPUT_LIMIT
        }
        Ending::DiskLimit { limit } => {
            eprintln!(
                "warden: cell {name}: disk limit {} of its workspace exceeded: killed",
                warden_policy::ByteSize(limit)
            );
            exit::DISK_LIMIT
        }
        Ending::Killed => {
            eprintln!("warden: cell {name} was killed by `warden kill`");
            exit::KILLED
        }
        Ending::CommandNotFound(message) => {
            eprintln!(
                "warden: {message} (in cell {name}; is it under a read-only path of the policy?)"
            );
            exit::NOT_FOUND
        }
        Ending::CannotExecute(message) => {
            eprintln!("warden: {message}");
            exit::CANNOT_EXECUTE
        }
    })
}

/// `warden run` without a daemon: an ephemeral harness in this process, with the same checks,
/// command rules and journal as the daemon's, runs the cell with this process's stdio. `Err`
/// of the inner result: the exit status of a command the policy refused.
fn run_in_process(
    args: RunArgs,
    policy: &Policy,
    env: Vec<(String, String)>,
    from: Option<String>,
) -> Result<std::result::Result<warden_harness::AttachedEnd, i32>> {
    // The signals that would end the warden are the cell's: blocked here, before any thread
    // starts (threads take the mask of their maker), and forwarded from the cell's signalfd.
    warden_cell::block_forwarded_signals().context("blocking signals")?;
    let state = Store::default_root();
    let tiers = warden_cell::Tiers::built_in(warden_cell::ProcessConfig {
        runtime: Registry::default_root(),
        state: state.clone(),
        warden_exe: std::env::current_exe().context("finding the warden binary")?,
        keeper_open_files: None,
        keeper_env: Vec::new(),
        keepers_ahead: 0,
    });
    // What the tier can make ahead of the cell starts now (the process tier, as root: its
    // network namespace, on a thread of its own, while this thread goes on to the cell).
    let tier = tiers.get(policy.tier)?;
    tier.prepare_run(policy);
    // What only the tier and this host can tell, before the journal is opened.
    tier.check(policy, args.workspace.as_deref())?;
    let workspace = match &args.workspace {
        Some(dir) => Some(
            std::fs::canonicalize(dir)
                .with_context(|| format!("workspace {}", dir.display()))?
                .display()
                .to_string(),
        ),
        None => None,
    };
    // A preset as it is goes by its name (its text is not written out only to be kept).
    let preset = crate::policy::preset_as_is(&args.policy);
    let request = warden_protocol::CreateCell {
        name: args.name,
        policy: preset.is_none().then(|| warden_policy::to_yaml(policy)),
        preset,
        workspace,
        from,
        labels: [("made-by".to_owned(), "warden run".to_owned())].into(),
        ..Default::default()
    };
    let run = warden_harness::AttachedRun {
        argv: args.command,
        env,
        discard_changes: args.rm,
        checked: true,
        parsed: Some(policy.clone()),
        by: format!(
            "warden run (uid {}, pid {})",
            rustix::process::getuid().as_raw(),
            std::process::id()
        ),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let harness = warden_harness::Harness::open(warden_harness::Config {
            runtime: Registry::default_root(),
            state,
            journal_segments: Default::default(),
            tiers: std::sync::Arc::new(tiers),
            ephemeral: true,
            pools: Vec::new(),
        })
        .await?;
        let ended = harness.run_attached(request, run).await;
        harness.shutdown().await;
        match ended {
            Ok(end) => Ok(Ok(end)),
            Err(err) if err.kind == warden_harness::ErrorKind::Forbidden => {
                eprintln!("warden: refused: {}", err.message);
                Ok(Err(exit::REFUSED))
            }
            Err(err) => Err(err.into()),
        }
    })
}

fn humanize(duration: std::time::Duration) -> String {
    warden_policy::Duration(duration).to_string()
}

fn ps(json: bool, all: bool) -> Result<i32> {
    let registry = registry()?;
    let cells = registry.list()?;
    // Cells a daemon made ahead are its pools' (shown below), not cells of anyone's yet.
    let pooled = warden_harness::made_ahead(&Store::default_root());
    let mut summaries: Vec<CellSummary> = cells
        .iter()
        .filter(|record| !pooled.contains(&record.name))
        .map(|record| CellSummary {
            name: record.name.clone(),
            state: if control::is_paused(record) {
                CellState::Paused
            } else {
                CellState::Running
            },
            pid: Some(record.pid),
            started_unix_ms: record.started_unix_ms,
            command: record.argv.clone(),
            workspace: record.workspace.as_ref().map(|w| w.display().to_string()),
        })
        .collect();
    if all {
        for (name, meta) in store()?.layers() {
            if summaries.iter().any(|s| s.name == name) {
                continue;
            }
            summaries.push(CellSummary {
                name,
                state: CellState::Ended,
                pid: None,
                started_unix_ms: meta
                    .started
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                command: Vec::new(),
                workspace: Some(meta.lower.display().to_string()),
            });
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&summaries)?);
        return Ok(0);
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    println!(
        "{:<20} {:<8} {:>8} {:>8}  COMMAND",
        "NAME", "STATE", "PID", "AGE"
    );
    for cell in &summaries {
        let age = now.saturating_sub(cell.started_unix_ms) / 1000;
        let state = match cell.state {
            CellState::Running => "running",
            CellState::Paused => "paused",
            CellState::Ended => "ended",
        };
        let pid = cell.pid.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let what = if cell.command.is_empty() && cell.state != CellState::Ended {
            "(takes `warden exec`)".to_owned()
        } else if cell.command.is_empty() {
            format!(
                "(kept changes of {})",
                cell.workspace.as_deref().unwrap_or("?")
            )
        } else {
            crate::render::safe(&cell.command.join(" ")).into_owned()
        };
        println!(
            "{:<20} {:<8} {:>8} {:>7}s  {}",
            cell.name, state, pid, age, what
        );
    }
    // A daemon that cannot say now leaves the pools out, not the cells.
    if let Ok(Some(pools)) = crate::daemon::pools_through_daemon()
        && !pools.is_empty()
    {
        println!(
            "\n{:<20} {:<8} {:>8} {:>10} {:>8}",
            "POOL", "TIER", "READY", "MEMORY", "TAKEN"
        );
        for pool in pools {
            println!(
                "{:<20} {:<8} {:>8} {:>10} {:>8}{}",
                crate::render::safe(&pool.policy),
                pool.tier,
                format!("{}/{}", pool.ready, pool.size),
                format!("{:.1} MiB", pool.memory_bytes as f64 / (1024.0 * 1024.0)),
                pool.taken,
                pool.error
                    .map(|e| format!("  (last try failed: {})", crate::render::safe(&e)))
                    .unwrap_or_default()
            );
        }
    }
    Ok(0)
}

/// Pauses, resumes or kills a cell, through the warden that keeps it.
fn control_cell(name: &str, action: warden_protocol::ControlAction) -> Result<i32> {
    crate::core::for_cell(name)?.control(name, action)?;
    let done = match action {
        warden_protocol::ControlAction::Pause => "paused",
        warden_protocol::ControlAction::Resume => "resumed",
        warden_protocol::ControlAction::Kill => "killed",
    };
    println!("{done} {name}");
    Ok(0)
}

fn diff(name: &str, json: bool, stat: bool) -> Result<i32> {
    let diff = crate::core::for_cell(name)?.diff(name)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&diff)?);
        return Ok(0);
    }
    use std::io::Write as _;
    // Written in blocks, not a write per line (a thousand changes: a thousand writes).
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let (mut added, mut modified, mut deleted) = (0, 0, 0);
    for change in &diff.changes {
        match change.kind {
            ChangeKind::Added => added += 1,
            ChangeKind::Modified => modified += 1,
            ChangeKind::Deleted => deleted += 1,
        }
        writeln!(out, "{}", describe(change))?;
    }
    if !stat {
        for change in diff.changes.iter().filter(|c| c.patch.is_some()) {
            write!(
                out,
                "\n{}",
                crate::render::safe_lines(change.patch.as_deref().unwrap_or_default())
            )?;
        }
    }
    writeln!(
        out,
        "\n{} changed: {added} added, {modified} modified, {deleted} deleted",
        diff.changes.len()
    )?;
    if !diff.changes.is_empty() {
        writeln!(
            out,
            "digest {}: `warden apply {name} --digest {}` applies exactly this, or nothing",
            diff.digest, diff.digest
        )?;
    }
    out.flush()?;
    Ok(0)
}

/// A path the cell chose, as it may reach a terminal: as it is, or, where it holds what could
/// steer the terminal, quoted as Rust writes strings (and escaped again, for whatever that
/// leaves as it is).
fn shown_path(path: &str) -> String {
    use crate::render::safe;
    match safe(path) {
        std::borrow::Cow::Borrowed(path) => path.to_owned(),
        std::borrow::Cow::Owned(_) => safe(&format!("{path:?}")).into_owned(),
    }
}

/// One line per change: marker, path, details (whatever the cell chose is escaped).
fn describe(change: &Change) -> String {
    use crate::render::safe;
    let path = shown_path(&change.path);
    let mut line = format!("{} {path}", change.marker());
    match change.entry {
        EntryKind::Dir => line.push('/'),
        EntryKind::Symlink => line.push_str(&format!(
            " -> {}",
            safe(change.link_target.as_deref().unwrap_or(""))
        )),
        EntryKind::File | EntryKind::Special => {}
    }
    if let (Some(old), Some(new)) = (change.old_mode, change.new_mode)
        && old != new
    {
        line.push_str(&format!(" (mode {old:o} -> {new:o})"));
    }
    if change.patch.is_none()
        && change.entry == EntryKind::File
        && change.kind != ChangeKind::Deleted
        && let (Some(size), Some(hash)) = (change.size, &change.hash)
    {
        line.push_str(&format!(
            " [binary, {size} bytes, blake3 {}]",
            &hash[..16.min(hash.len())]
        ));
    }
    if let Some(reason) = &change.sensitive {
        line.push_str(&format!("  ! sensitive: {}", safe(reason)));
    }
    if let Some(reason) = &change.refused {
        line.push_str(&format!("  x refused: {}", safe(reason)));
    }
    line
}

/// The questions of one cell, or of every cell: the daemon's when one runs (its ids, which
/// survive its restarts, and questions about commands too), else each running cell's gateway's.
fn approvals(name: Option<&str>, json: bool) -> Result<i32> {
    if let Some(name) = name {
        warden_cell::check_name(name)?;
    }
    let mut questions: Vec<warden_protocol::Approval> =
        match crate::daemon::approvals_through_daemon()? {
            Some(all) => all,
            None => {
                let registry = registry()?;
                let names = match name {
                    Some(name) => vec![name.to_owned()],
                    None => registry.list()?.into_iter().map(|r| r.name).collect(),
                };
                let mut out = Vec::new();
                for cell in names {
                    let pending = match control::pending_questions(&registry, &cell) {
                        Ok(pending) => pending,
                        // A cell that ended between listing and asking has no questions.
                        Err(_) if name.is_none() => continue,
                        Err(err) => return Err(err.into()),
                    };
                    out.extend(pending.into_iter().map(|q| warden_protocol::Approval {
                        cell: cell.clone(),
                        id: q.id,
                        request: q.request,
                        rule: q.rule,
                        asked_at: q.asked_at,
                        timeout_s: q.timeout_s,
                    }));
                }
                out
            }
        };
    if let Some(name) = name {
        questions.retain(|q| q.cell == name);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&questions)?);
        return Ok(0);
    }
    if questions.is_empty() {
        match name {
            Some(name) => eprintln!("cell {name} waits on no question"),
            None => eprintln!("no cell waits on a question"),
        }
        return Ok(0);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    use crate::render::safe;
    println!(
        "{:<16} {:<6} {:<50} {:<16} {:>8}",
        "CELL", "ID", "REQUEST", "RULE", "LEFT"
    );
    for q in &questions {
        let left = (q.asked_at + q.timeout_s).saturating_sub(now);
        println!(
            "{:<16} {:<6} {:<50} {:<16} {:>7}s",
            safe(&q.cell),
            q.id,
            safe(&q.request),
            safe(&q.rule),
            left
        );
    }
    eprintln!(
        "answer with `warden approve CELL ID [--scope once|cell|always]` or `warden deny CELL ID`"
    );
    Ok(0)
}

fn net(name: &str, json: bool) -> Result<i32> {
    warden_cell::check_name(name)?;
    let path = store()?.net_log_path(name);
    let decisions = warden_egress::read_log(&path).with_context(|| {
        format!(
            "cell `{name}` has no egress record (its policy lets nothing out, or it was removed)"
        )
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&decisions)?);
        return Ok(0);
    }
    println!(
        "{:<8} {:<6} {:<40} {:<8} {:>10} {:>10}  RULE / REASON",
        "VERDICT", "KIND", "DESTINATION", "METHOD", "UP", "DOWN"
    );
    use crate::render::safe;
    for d in &decisions {
        let destination = format!("{}:{}{}", d.host, d.port, d.path.as_deref().unwrap_or(""));
        let repeats = if d.repeats > 0 && d.kind != "summary" {
            format!(" (x{})", d.repeats)
        } else {
            String::new()
        };
        println!(
            "{:<8} {:<6} {:<40} {:<8} {:>10} {:>10}  {}: {}{repeats}",
            if d.allowed { "allow" } else { "DENY" },
            safe(&d.kind),
            safe(&destination),
            safe(d.method.as_deref().unwrap_or("-")),
            d.bytes_up,
            d.bytes_down,
            safe(&d.rule),
            safe(&d.reason)
        );
    }
    Ok(0)
}

fn snapshots(json: bool) -> Result<i32> {
    let all = snapshot::listed(&store()?);
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!(
        "{:<32} {:>12} {:>7}  {:<10}  WORKSPACE",
        "SNAPSHOT", "SIZE", "LAYERS", "MEMORY"
    );
    let checkpoints = store()?.root().join("checkpoints");
    for snap in &all {
        // A checkpoint is a snapshot with its cell's memory beside it.
        let memory = match checkpoints.join(&snap.id).is_dir() {
            true => "checkpoint",
            false => "-",
        };
        println!(
            "{:<32} {:>12} {:>7}  {:<10}  {}",
            snap.id,
            warden_policy::ByteSize(snap.size.unwrap_or(0)).to_string(),
            snap.stack().len(),
            memory,
            snap.lower.display()
        );
    }
    Ok(0)
}

fn apply(name: &str, request: warden_protocol::ApplyRequest, json: bool) -> Result<i32> {
    let dry_run = request.dry_run;
    let report = crate::core::for_cell(name)?.apply(name, &request)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(0);
    }
    // The paths, and the reasons that may quote what the cell chose, are escaped as the diff
    // escapes them: they reach a terminal.
    let verb = if dry_run { "would apply" } else { "applied" };
    for path in &report.applied {
        println!("{verb} {}", shown_path(path));
    }
    for (path, reason) in &report.skipped {
        println!(
            "skipped {}: {}",
            shown_path(path),
            crate::render::safe(reason)
        );
    }
    println!(
        "{} {verb}, {} skipped",
        report.applied.len(),
        report.skipped.len()
    );
    Ok(0)
}

fn policy(command: PolicyCommand) -> Result<i32> {
    match command {
        PolicyCommand::Check { file } => {
            let policy = warden_policy::from_file(&file)?;
            // What only this host can tell: the tier, and the paths the cell would see.
            warden_cell::check_paths(&policy, store()?.root(), registry()?.root())
                .with_context(|| format!("{}", file.display()))?;
            println!("{}: ok", file.display());
        }
        PolicyCommand::Show { policy } => {
            print!(
                "{}",
                warden_policy::to_yaml(&crate::policy::effective(&policy)?)
            );
        }
        PolicyCommand::Explain { file, preset } => {
            let policy = crate::policy::load(file.as_deref(), preset.as_deref())?;
            // The policy's patterns are its author's text, which may be a cell's agent's.
            print!(
                "{}",
                crate::render::safe_lines(&warden_policy::explain(&policy))
            );
        }
        PolicyCommand::Set { name, file } => {
            if let Some(closed) = crate::daemon::set_policy_through_daemon(&name, &file)? {
                println!(
                    "network and command rules of {name} replaced; {closed} open connection(s) closed"
                );
                return Ok(0);
            }
            let closed = control::set_network_policy(&registry()?, &name, &file)?;
            println!("network rules of {name} replaced; {closed} open connection(s) closed");
        }
        PolicyCommand::Presets => {
            for (name, description, _) in warden_policy::PRESETS {
                println!("{name:<10} {description}");
            }
        }
    }
    Ok(0)
}

fn doctor(json: bool) -> Result<i32> {
    let checks = probe::doctor(&Store::default_root());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&checks).context("rendering the report")?
        );
    } else {
        for check in &checks {
            let mark = match check.status {
                probe::Status::Ok => "ok  ",
                probe::Status::Warn => "warn",
                probe::Status::Missing => "MISS",
            };
            println!(
                "[{mark}] {:<8} {:<16} {}",
                check.tier, check.feature, check.detail
            );
            if let Some(fix) = &check.fix {
                println!("                              fix: {fix}");
            }
        }
    }
    let process_ok = checks
        .iter()
        .filter(|c| c.tier == "process")
        .all(|c| c.status != probe::Status::Missing);
    Ok(if process_ok { 0 } else { 1 })
}

/// `warden image import|pull|ls|rm`: the image store under the state directory, which the process
/// tier reads when a policy names an `image`.
fn image(command: crate::cli::ImageCommand) -> Result<i32> {
    use crate::cli::ImageCommand;
    let images = warden_image::Store::new(store()?.root());
    let line = |image: &warden_image::Image| {
        format!(
            "{}  {}  {} layers  {}",
            image.name,
            &image.digest[..image.digest.len().min(19)],
            image.layers.len(),
            warden_policy::ByteSize(image.size)
        )
    };
    match command {
        ImageCommand::Import { file, name, json } => {
            let image = images
                .import(&file, name.as_deref())
                .with_context(|| format!("importing {} (nothing was kept)", file.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&image)?);
            } else {
                println!("imported {}", line(&image));
                println!("use it with `image: {}` in a policy", image.name);
            }
        }
        ImageCommand::Pull {
            reference,
            name,
            platform,
            insecure,
            json,
        } => {
            let login = match (
                std::env::var("WARDEN_REGISTRY_USER"),
                std::env::var("WARDEN_REGISTRY_PASSWORD"),
            ) {
                (Ok(user), Ok(password)) => Some((user, password)),
                (Ok(_), Err(_)) | (Err(_), Ok(_)) => bail!(
                    "set both WARDEN_REGISTRY_USER and WARDEN_REGISTRY_PASSWORD for a registry login, or neither for an anonymous pull"
                ),
                _ => None,
            };
            let options = warden_image::PullOptions {
                platform,
                insecure,
                login,
            };
            let pulled = images
                .pull(&reference, name.as_deref(), &options)
                .with_context(|| format!("pulling {reference} (nothing was kept)"))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "image": pulled.image,
                        "reference": pulled.reference,
                        "manifest": pulled.manifest,
                        "fetched_bytes": pulled.fetched,
                    }))?
                );
            } else {
                println!(
                    "pulled {} ({} fetched from {})",
                    line(&pulled.image),
                    warden_policy::ByteSize(pulled.fetched),
                    pulled.reference
                );
                println!("use it with `image: {}` in a policy", pulled.image.name);
            }
        }
        ImageCommand::Ls { json } => {
            let list = images.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no images; `warden image import FILE` adds one");
            } else {
                for image in &list {
                    println!("{}", line(image));
                }
            }
        }
        ImageCommand::Rm { name } => {
            // Its layers are the root of the cells made from it: they stay while one runs. A
            // cell whose init has ended is still listed while its keeper lets go of it (a
            // delete answers before that): waited for, a few seconds at most.
            let users = |registry: &warden_cell::Registry| -> Result<(Vec<String>, bool)> {
                let users: Vec<_> = registry
                    .list()?
                    .into_iter()
                    .filter(|r| r.image.as_deref() == Some(name.as_str()))
                    .collect();
                let ending = users.iter().any(|r| r.init_pidfd().is_none());
                Ok((users.into_iter().map(|r| r.name).collect(), ending))
            };
            let registry = registry()?;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let users = loop {
                let (users, ending) = users(&registry)?;
                if !ending || std::time::Instant::now() > deadline {
                    break users;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            if !users.is_empty() {
                bail!(
                    "image {name} is the root of running cells: {}; end them first (`warden kill {}`)",
                    users.join(", "),
                    users[0]
                );
            }
            let image = images.remove(&name)?;
            println!("removed {}", image.name);
        }
    }
    Ok(0)
}
