//! `warden serve` and `warden keep` (the keeper of one daemon cell).

use crate::cli::KeepArgs;
use anyhow::{Context, Result};
use std::path::PathBuf;
use warden_cell::{Registry, RunRequest, Store};

use super::*;

pub fn serve(
    listen: Option<std::net::SocketAddr>,
    token_file: Option<PathBuf>,
    journal_segment_mib: u64,
    journal_keep_segments: Option<usize>,
) -> Result<i32> {
    let keeper_open_files = raise_open_files_limit();
    let config = warden_server::ServeConfig {
        harness: warden_harness::Config {
            runtime: runtime(),
            state: Store::default_root(),
            warden_exe: std::env::current_exe().context("finding the warden binary")?,
            journal_segments: warden_journal::Segments {
                bytes: journal_segment_mib.saturating_mul(1024 * 1024),
                keep: journal_keep_segments,
            },
            keeper_open_files,
        },
        listen,
        token_file,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(warden_server::serve(config, |socket, tcp| {
        eprintln!("warden: serving the API on {}", socket.display());
        if let Some(addr) = tcp {
            eprintln!(
                "warden: and on http://{addr} (token in {})",
                runtime().join(warden_server::TOKEN_FILE).display()
            );
        }
    }))?;
    Ok(0)
}

/// The daemon holds a few descriptors for every cell and every stream, so it takes the hard
/// limit of open files as its own (many hosts start services at a soft limit of 1,024, which
/// a few hundred cells would reach). Returns the soft limit it had, for its keepers to take
/// back, so that cells see the limit they would have seen anyway.
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    let soft = current?;
    if maximum.is_some_and(|hard| hard <= soft) {
        return None;
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: maximum,
            maximum,
        },
    )
    .ok()?;
    Some(soft)
}

/// Takes back the soft limit of open files the daemon had before it raised its own.
fn restore_open_files_limit(soft: u64) -> Result<()> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(maximum.map_or(soft, |hard| soft.min(hard))),
            maximum,
        },
    )
    .context("setting the soft limit of open files")
}

/// `warden keep`: the keeper of one daemon cell, an exec-serving cell without a command.
pub fn keep(args: KeepArgs) -> Result<i32> {
    if let Some(soft) = args.open_files {
        restore_open_files_limit(soft)?;
    }
    let mut policy = match (&args.policy, &args.preset) {
        (Some(file), _) => warden_policy::from_file(file)?,
        (None, Some(preset)) => warden_policy::preset(preset)?,
        (None, None) => warden_policy::preset("default")?,
    };
    if args.no_wall {
        policy.limits.wall = None;
    }
    let env = pairs(&args.env, "env")?.into_iter().collect();
    let store = Store::open(Store::default_root())?;
    let from = match &args.from {
        Some(id) => Some(warden_cell::snapshot::get(&store, id)?),
        None => None,
    };
    let request = RunRequest {
        policy,
        name: Some(args.name),
        workspace: if from.is_some() { None } else { args.workspace },
        argv: Vec::new(),
        env,
        discard_changes: false,
        from,
        serve_exec: true,
        report: args.report,
    };
    let outcome = warden_cell::run(&Registry::open(Registry::default_root())?, &store, request)?;
    for notice in &outcome.notices {
        eprintln!("warden: note: {notice}");
    }
    Ok(match outcome.ending {
        warden_cell::Ending::Exited(code) => code,
        warden_cell::Ending::Signaled(signal) => 128 + signal,
        _ => warden_protocol::exit::KILLED,
    })
}
