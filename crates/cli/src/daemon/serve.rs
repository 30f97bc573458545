//! `warden serve` and `warden keep` (the keeper of one daemon cell).

use anyhow::{Context, Result};
use std::os::fd::AsFd as _;
use std::path::PathBuf;
use warden_cell::Store;

use super::*;

/// The core a daemon runs (and `warden mcp` when no daemon does): every built-in tier, whose
/// keepers get back the open-files limit this process had.
pub(super) fn daemon_harness(
    segments: warden_journal::Segments,
    keepers_ahead: usize,
    pools: Vec<warden_harness::PoolSpec>,
) -> Result<warden_harness::Config> {
    let keeper_open_files = raise_open_files_limit();
    let tiers = warden_cell::Tiers::built_in(warden_cell::ProcessConfig {
        runtime: runtime(),
        state: Store::default_root(),
        warden_exe: std::env::current_exe().context("finding the warden binary")?,
        keeper_open_files,
        keeper_env: Vec::new(),
        keepers_ahead,
    });
    // The process tier opens its directories (and sweeps what dead keepers left) now.
    tiers.default_tier()?;
    Ok(warden_harness::Config {
        runtime: runtime(),
        state: Store::default_root(),
        journal_segments: segments,
        tiers: std::sync::Arc::new(tiers),
        ephemeral: false,
        pools,
    })
}

/// What `warden serve` was asked.
pub struct ServeArgs {
    pub listen: Option<std::net::SocketAddr>,
    pub token_file: Option<PathBuf>,
    pub e2b: Option<std::net::SocketAddr>,
    pub journal_segment_mib: u64,
    pub journal_keep_segments: Option<usize>,
    pub keepers_ahead: usize,
    /// `POLICY=N` each.
    pub pools: Vec<String>,
    /// The API's threads (`None`: [`api_threads`]).
    pub api_threads: Option<usize>,
}

/// A `--pool POLICY=N`: `e2b:TEMPLATE` (the policy of an E2B template's sandboxes), a
/// preset's name, else a policy file.
fn pool_spec(arg: &str) -> Result<warden_harness::PoolSpec> {
    let (policy, size) = arg
        .rsplit_once('=')
        .with_context(|| format!("--pool {arg}: expected POLICY=N, e.g. --pool default=2"))?;
    let size: usize = size
        .parse()
        .ok()
        .filter(|n| (1..=64).contains(n))
        .with_context(|| format!("--pool {arg}: `{size}` is not a number of cells from 1 to 64"))?;
    let source = if let Some(template) = policy.strip_prefix("e2b:") {
        warden_harness::PolicySource::Yaml(
            warden_e2b::template_policy(template)
                .map_err(|why| anyhow::anyhow!("--pool {arg}: {why}"))?,
        )
    } else if warden_policy::preset(policy).is_ok() {
        warden_harness::PolicySource::Preset(policy.to_owned())
    } else {
        let yaml = std::fs::read_to_string(policy).with_context(|| {
            format!(
                "--pool {arg}: `{policy}` is neither a preset ({}), `e2b:TEMPLATE`, nor a policy file that can be read",
                warden_policy::PRESETS
                    .iter()
                    .map(|(name, _, _)| *name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        warden_harness::PolicySource::Yaml(yaml)
    };
    Ok(warden_harness::PoolSpec {
        label: policy.to_owned(),
        policy: source,
        size,
    })
}

/// The API's threads by default: one fewer than the CPUs this process may run on, at least
/// one. The daemon's requests share the CPUs with the cells' processes, the journal's thread
/// and the blocking work's threads; an API thread per CPU had, on two cores, the second one
/// woken for each task that became ready while the first ran (it then found nothing to take,
/// or took the task to the CPU it shared with the request's process), eight context switches
/// in a run's first 0.3 ms (traced).
pub fn api_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .max(1)
}

pub fn serve(args: ServeArgs) -> Result<i32> {
    let ServeArgs {
        listen,
        token_file,
        e2b,
        journal_segment_mib,
        journal_keep_segments,
        keepers_ahead,
        pools,
        api_threads: threads,
    } = args;
    let pools = pools
        .iter()
        .map(|arg| pool_spec(arg))
        .collect::<Result<Vec<_>>>()?;
    // Work a request leaves behind (a discarded layer's removal) runs on a thread of the
    // daemon's, not in a fork of it.
    warden_cell::outlive_requests();
    let config = warden_server::ServeConfig {
        harness: daemon_harness(
            warden_journal::Segments {
                bytes: journal_segment_mib.saturating_mul(1024 * 1024),
                keep: journal_keep_segments,
                ..Default::default()
            },
            keepers_ahead,
            pools,
        )?,
        listen,
        token_file,
        e2b,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.unwrap_or_else(api_threads))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Where the token is: the file given, or the one the daemon makes.
    let token_at = config
        .token_file
        .clone()
        .unwrap_or_else(|| runtime().join(warden_server::TOKEN_FILE));
    let served = rt.block_on(warden_server::serve(config, |socket, tcp| {
        eprintln!("warden: serving the API on {}", socket.display());
        if let Some(addr) = tcp {
            eprintln!(
                "warden: and on http://{addr} (token in {})",
                token_at.display()
            );
        }
        if let Ok(addr) = std::fs::read_to_string(runtime().join(warden_server::E2B_ADDR_FILE))
            && e2b.is_some()
        {
            eprintln!(
                "warden: and the E2B-compatible API on http://{addr} (E2B_API_URL and E2B_SANDBOX_URL; E2B_API_KEY in {})",
                runtime().join(warden_server::E2B_KEY_FILE).display()
            );
        }
    }));
    // What the last requests left to the background (a removed cell's layer) is done before
    // the daemon goes, whether it served to the end or failed.
    if !warden_cell::finish_background(std::time::Duration::from_secs(30)) {
        eprintln!(
            "warden: the removal of discarded layers did not finish within 30 s; what is left goes with its cell, or at the next daemon's start"
        );
    }
    served?;
    Ok(0)
}

/// `warden mcp`: an MCP session over stdio, carried to the daemon when one runs, else served
/// by the daemon's core opened in this process.
pub fn mcp() -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if let Some(client) = client_if_running() {
        let relayed = rt.block_on(relay_mcp(client));
        // The read of stdin that may still wait is a blocking thread of the runtime's, which
        // a drop of the runtime would wait for.
        rt.shutdown_background();
        return relayed;
    }
    // One keeper ahead: an MCP client makes its cells one at a time.
    let config = daemon_harness(Default::default(), 1, Vec::new())?;
    rt.block_on(async move {
        let harness = warden_harness::Harness::open(config).await?;
        let by = format!(
            "warden mcp (uid {}, pid {})",
            rustix::process::getuid().as_raw(),
            std::process::id()
        );
        let served =
            warden_mcp::serve_stdio(warden_mcp::Tools::new(std::sync::Arc::clone(&harness), by))
                .await;
        harness.shutdown().await;
        served.map_err(anyhow::Error::msg)?;
        Ok(0)
    })
}

/// Relays an MCP session between stdio and the daemon: until the client closes stdin and the
/// daemon has answered all it was asked (or the client went away without reading the rest).
/// A daemon that ends the session first (it stopped, or was killed) ends the relay with an
/// error: the client's stdin stays open, and waiting on it left the client waiting for answers
/// that could never come.
async fn relay_mcp(client: warden_client::Client) -> Result<i32> {
    use tokio::io::AsyncWriteExt as _;
    let daemon = client
        .upgrade("/v1/mcp", warden_protocol::MCP_UPGRADE)
        .await
        .context("opening an MCP session with the warden daemon")?;
    let (mut from_daemon, mut to_daemon) = tokio::io::split(daemon);
    let (mut stdin, mut stdout) = (tokio::io::stdin(), tokio::io::stdout());
    let asked = async {
        tokio::io::copy(&mut stdin, &mut to_daemon).await?;
        to_daemon.shutdown().await
    };
    let answered = async {
        tokio::io::copy(&mut from_daemon, &mut stdout).await?;
        stdout.flush().await
    };
    tokio::pin!(asked, answered);
    let gone = |err: &std::io::Error| err.kind() == std::io::ErrorKind::BrokenPipe;
    tokio::select! {
        done = &mut answered => match done {
            Ok(()) => anyhow::bail!(
                "the warden daemon ended the MCP session while the client still had it open (the daemon stopped or was restarted); start the session again"
            ),
            Err(err) if gone(&err) => Ok(0),
            Err(err) => Err(anyhow::Error::new(err).context("relaying the MCP session from the warden daemon")),
        },
        done = &mut asked => {
            match done {
                Ok(()) => {}
                Err(err) if gone(&err) => {}
                Err(err) => return Err(anyhow::Error::new(err).context("relaying the MCP session to the warden daemon")),
            }
            match answered.await {
                Err(err) if !gone(&err) => Err(anyhow::Error::new(err).context("relaying the MCP session from the warden daemon")),
                _ => Ok(0),
            }
        }
    }
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

/// `warden keep`: the keeper of one daemon cell, an exec-serving cell without a command. It
/// takes its request (a serialized cell spec) as JSON on stdin.
pub fn keep() -> Result<i32> {
    // The request comes on stdin, or (a keeper that runs a command with the caller's stdin)
    // from the file `WARDEN_KEEP_REQUEST` names, which is removed once read.
    let (status, notices) = match std::env::var_os(warden_cell::KEEP_REQUEST) {
        Some(path) => {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening the keeper's request {}", path.display()))?;
            let _ = std::fs::remove_file(&path);
            warden_cell::keep(file, None)?
        }
        None => {
            // The line the request came on (a socket) is where the keeper says `ready`.
            let stdin = std::io::stdin();
            let ready = is_socket(stdin.as_fd())
                .then(|| stdin.as_fd().try_clone_to_owned().ok())
                .flatten();
            warden_cell::keep(std::io::stdin().lock(), ready)?
        }
    };
    for notice in &notices {
        eprintln!("warden: note: {notice}");
    }
    Ok(status)
}

/// `warden keepers`: the keepers' fork server of one daemon. Each keeper it forks runs
/// [`keep`], as `warden keep` would, and exits with its status.
pub fn keepers() -> Result<i32> {
    warden_cell::serve_forks(forked_keeper).context("serving the daemon's keeper forks")?;
    Ok(0)
}

/// A keeper forked by `warden keepers`: what `warden keep` does, its error said as `main` says
/// it.
fn forked_keeper() -> i32 {
    match keep() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("warden: {}", crate::render::error_text(&err));
            warden_protocol::exit::WARDEN_ERROR
        }
    }
}

/// Whether `fd` is a socket.
fn is_socket(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    rustix::fs::fstat(fd).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Socket
    })
}
