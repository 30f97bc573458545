//! The subcommands that involve the daemon: the CLI as its client (`create`, the control and
//! answers of its cells, policy replacement), and by module: `relay` (`run` through the daemon,
//! `exec`, terminals, announcements), `files` (`cp`, `logs`), `serve` (`serve`, `keep`),
//! `journal` (`audit`, `replay`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use hyper::Method;
use serde_json::{Value, json};
use warden_cell::{Registry, Store};

use crate::cli::CreateArgs;
use warden_client::Client;

mod agent;
mod files;
mod journal;
mod relay;
mod serve;

pub use agent::{agent, rerun};
pub use files::{copy, logs};
pub use journal::{audit, replay};
pub use relay::{exec, run_through};
pub use serve::{ServeArgs, keep, keepers, mcp, serve};

fn runtime() -> PathBuf {
    Registry::default_root()
}

fn journal_dir(given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(|| Store::default_root().join("journal"))
}

fn current_thread() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The running daemon, or an error that says how to start one.
pub fn client() -> Result<Client> {
    let runtime = runtime();
    Client::detect(&runtime).with_context(|| {
        format!(
            "no warden daemon answers on {} — start one with `warden serve` (in another terminal or as a service)",
            runtime.join(warden_server::SOCKET).display()
        )
    })
}

/// `warden dashboard`: the link to the daemon's page on its TCP listener, with the token in
/// the fragment (the page trades it for a session cookie and wipes it from the address bar).
pub fn dashboard() -> Result<i32> {
    let runtime = runtime();
    client()?;
    let addr_file = runtime.join(warden_server::ADDR_FILE);
    let addr = std::fs::read_to_string(&addr_file).map_err(|_| {
        anyhow::anyhow!(
            "the daemon does not listen on TCP, where the dashboard is served: restart it with `warden serve --listen 127.0.0.1:8787` (browsers cannot reach its unix socket)"
        )
    })?;
    let addr = addr.trim();
    if std::net::TcpStream::connect(addr).is_err() {
        bail!(
            "{} says the daemon listens on {addr}, but nothing answers there: it is left from an earlier daemon; restart `warden serve --listen ...`",
            addr_file.display()
        );
    }
    let token_file = runtime.join(warden_server::TOKEN_FILE);
    let token = std::fs::read_to_string(&token_file)
        .with_context(|| {
            format!(
                "reading the daemon's token from {} (a daemon started with --token-file keeps it in that file: open http://{addr}/ui/ and paste it)",
                token_file.display()
            )
        })?;
    println!("http://{addr}/ui/#token={}", token.trim());
    Ok(0)
}

/// The daemon, when one runs.
pub fn client_if_running() -> Option<Client> {
    Client::detect(&runtime())
}

/// The running daemon's pools of cells made ahead; `None` when no daemon runs.
pub fn pools_through_daemon() -> Result<Option<Vec<warden_protocol::PoolInfo>>> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(None);
    };
    current_thread()?
        .block_on(client.call::<(), _>(Method::GET, "/v1/pools", None))
        .map(Some)
        .map_err(Into::into)
}

/// Every open question the running daemon knows of; `None` when no daemon runs.
pub fn approvals_through_daemon() -> Result<Option<Vec<warden_protocol::Approval>>> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(None);
    };
    current_thread()?
        .block_on(client.call::<(), _>(Method::GET, "/v1/approvals", None))
        .map(Some)
        .map_err(Into::into)
}

/// Removes a cell the running daemon keeps; `false` when no daemon keeps it. One that still runs
/// is refused unless `force` (it is then killed, and its unapplied changes dropped, which is
/// said).
/// `warden rm CELL@SNAP` with a daemon running: removed (and journaled) by it. `false`: no
/// daemon runs.
pub fn remove_snapshot_through_daemon(id: &str) -> Result<bool> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(false);
    };
    let rt = current_thread()?;
    rt.block_on(client.json(Method::DELETE, &format!("/v1/snapshots/{id}"), None))?;
    Ok(true)
}

pub fn remove_through_daemon(name: &str, force: bool) -> Result<bool> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(false);
    };
    let rt = current_thread()?;
    let info: warden_protocol::CellInfo =
        match rt.block_on(client.call::<(), _>(Method::GET, &format!("/v1/cells/{name}"), None)) {
            Ok(info) => info,
            Err(err) => {
                return match err.api() {
                    Some(api) if api.status == hyper::StatusCode::NOT_FOUND => Ok(false),
                    _ => Err(err.into()),
                };
            }
        };
    let running = info.state != warden_protocol::CellState::Ended;
    if running && !force {
        bail!(
            "cell `{name}` is {}; `warden kill {name}` first (its workspace changes stay for review), or `warden rm --force {name}` to kill it and drop them",
            info.state.name()
        );
    }
    rt.block_on(client.json(Method::DELETE, &format!("/v1/cells/{name}"), None))?;
    if running {
        eprintln!(
            "warden: cell {name} was running: killed, and its unapplied workspace changes dropped"
        );
    }
    Ok(true)
}

/// Replaces the policy of a cell the running daemon keeps (its `network` and `commands`, journaled
/// and in force for the daemon's own decisions); `None` when no daemon keeps the cell and the
/// caller should act directly. Returns how many connections were closed.
pub fn set_policy_through_daemon(name: &str, file: &Path) -> Result<Option<u64>> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the policy {}", file.display()))?;
    let body = json!({ "policy": text });
    let path = format!("/v1/cells/{name}/policy");
    match current_thread()?.block_on(client.json(Method::PUT, &path, Some(&body))) {
        Ok(answer) => Ok(Some(answer["closed_connections"].as_u64().unwrap_or(0))),
        Err(err) => match err.api() {
            Some(api) if api.status == hyper::StatusCode::NOT_FOUND => Ok(None),
            _ => Err(err.into()),
        },
    }
}

fn pairs(list: &[String], what: &str) -> Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for pair in list {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--{what} {pair}: write it as KEY=VALUE");
        };
        out.insert(key.to_owned(), value.to_owned());
    }
    Ok(out)
}

/// A policy file's text and a workspace's absolute path, as the API takes them.
/// The values of the policy's `from_env` credentials, from this caller's environment: the
/// daemon's is not the caller's.
/// The API's error inside a failure of a call to the daemon.
pub(crate) fn api_error(err: &anyhow::Error) -> Option<&warden_client::ApiError> {
    err.downcast_ref::<warden_client::ClientError>()
        .and_then(warden_client::ClientError::api)
}

fn callers_secrets(
    policy: &warden_policy::Policy,
) -> Result<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for (name, credential) in &policy.credentials {
        let Some(var) = &credential.from_env else {
            continue;
        };
        match std::env::var(var) {
            Ok(value) => {
                out.insert(var.clone(), value);
            }
            Err(_) => bail!("credential `{name}`: the caller's environment has no {var}"),
        }
    }
    Ok(out)
}

fn workspace_dir(workspace: Option<&std::path::Path>) -> Result<Option<String>> {
    Ok(match workspace {
        Some(dir) => Some(
            std::fs::canonicalize(dir)
                .with_context(|| format!("workspace {}", dir.display()))?
                .display()
                .to_string(),
        ),
        None => None,
    })
}

pub fn create(args: CreateArgs) -> Result<i32> {
    let client = client()?;
    let policy = crate::policy::effective(&args.policy)?;
    let workspace = workspace_dir(args.workspace.as_deref())?;
    let body = warden_protocol::CreateCell {
        name: args.name,
        policy: Some(warden_policy::to_yaml(&policy)),
        workspace,
        env: pairs(&args.env, "env")?,
        labels: pairs(&args.labels, "label")?,
        secrets: callers_secrets(&policy)?,
        ..Default::default()
    };
    let cell: warden_protocol::CellInfo =
        current_thread()?.block_on(client.call(Method::POST, "/v1/cells", Some(&body)))?;
    println!("{}", cell.name);
    Ok(0)
}

pub fn checkpoint(name: &str, as_name: Option<String>) -> Result<i32> {
    let client = client()?;
    let saved: warden_protocol::Checkpoint = current_thread()?.block_on(client.call(
        Method::POST,
        &format!("/v1/cells/{name}/checkpoint"),
        Some(&warden_protocol::CheckpointRequest { as_name }),
    ))?;
    println!(
        "{} (memory {} bytes, workspace {} bytes); the cell stopped there: `warden restore {}` brings it back",
        saved.id, saved.memory_bytes, saved.workspace_bytes, saved.id
    );
    Ok(0)
}

pub fn restore(checkpoint: &str, name: Option<String>) -> Result<i32> {
    let client = client()?;
    let body = warden_protocol::CreateCell {
        name,
        restore: Some(checkpoint.to_owned()),
        ..Default::default()
    };
    let cell: warden_protocol::CellInfo =
        current_thread()?.block_on(client.call(Method::POST, "/v1/cells", Some(&body)))?;
    println!("{}", cell.name);
    Ok(0)
}

/// The bytes of an output event: `{"text": ...}` or `{"base64": ...}`.
fn chunk_bytes(value: &Value) -> Vec<u8> {
    match value["text"].as_str() {
        Some(text) => text.as_bytes().to_vec(),
        None => value["base64"]
            .as_str()
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .unwrap_or_default(),
    }
}

/// Percent-encodes a query value.
fn query(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
