//! One function per subcommand, each a thin translation onto the core crates.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use warden_cell::{Ending, Registry, RunRequest, control, probe};
use warden_policy::Policy;
use warden_protocol::{CellState, CellSummary, exit};

use crate::cli::{Cli, Command, PolicyCommand, RunArgs};

pub fn dispatch(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::Ps { json } => ps(json),
        Command::Pause { name } => {
            control::pause(&registry()?, &name)?;
            println!("paused {name}");
            Ok(0)
        }
        Command::Resume { name } => {
            control::resume(&registry()?, &name)?;
            println!("resumed {name}");
            Ok(0)
        }
        Command::Kill { name } => {
            control::kill(&registry()?, &name)?;
            println!("killed {name}");
            Ok(0)
        }
        Command::Policy { command } => policy(command),
        Command::Doctor { json } => doctor(json),
    }
}

fn registry() -> Result<Registry> {
    Ok(Registry::open(Registry::default_root())?)
}

fn load_policy(file: Option<&std::path::Path>, preset: Option<&str>) -> Result<Policy> {
    Ok(match (file, preset) {
        (Some(file), _) => warden_policy::from_file(file)?,
        (None, Some(name)) => warden_policy::preset(name)?,
        (None, None) => warden_policy::preset("default")?,
    })
}

fn run(args: RunArgs) -> Result<i32> {
    let policy = load_policy(args.policy.as_deref(), args.preset.as_deref())?;
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
    let request = RunRequest {
        policy,
        name: args.name,
        workspace: args.workspace,
        argv: args.command,
        env,
    };
    let outcome = warden_cell::run(&registry()?, request)?;
    for notice in &outcome.notices {
        eprintln!("warden: note: {notice}");
    }
    let name = &outcome.name;
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

fn humanize(duration: std::time::Duration) -> String {
    warden_policy::Duration(duration).to_string()
}

fn ps(json: bool) -> Result<i32> {
    let cells = registry()?.list()?;
    let summaries: Vec<CellSummary> = cells
        .iter()
        .map(|record| CellSummary {
            name: record.name.clone(),
            state: if control::is_paused(record) {
                CellState::Paused
            } else {
                CellState::Running
            },
            pid: record.pid,
            started_unix_ms: record.started_unix_ms,
            command: record.argv.clone(),
            workspace: record.workspace.as_ref().map(|w| w.display().to_string()),
        })
        .collect();
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
        };
        println!(
            "{:<20} {:<8} {:>8} {:>7}s  {}",
            cell.name,
            state,
            cell.pid,
            age,
            cell.command.join(" ")
        );
    }
    Ok(0)
}

fn policy(command: PolicyCommand) -> Result<i32> {
    match command {
        PolicyCommand::Check { file } => {
            warden_policy::from_file(&file)?;
            println!("{}: ok", file.display());
        }
        PolicyCommand::Explain { file, preset } => {
            let policy = load_policy(file.as_deref(), preset.as_deref())?;
            print!("{}", warden_policy::explain(&policy));
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
    let checks = probe::run_all();
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
