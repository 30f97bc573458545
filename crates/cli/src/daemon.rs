//! The subcommands that involve the daemon: `serve`, `keep`, `create`, `exec`, and the journal's
//! `audit` and `replay`.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use hyper::Method;
use serde_json::{Value, json};
use warden_cell::{Registry, RunRequest, Store};
use warden_journal::{Entry, Format};

use crate::cli::{AuditCommand, CreateArgs, ExecArgs, ExportFormat, KeepArgs};
use crate::client::Client;

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

/// The daemon, when one runs.
pub fn client_if_running() -> Option<Client> {
    Client::detect(&runtime())
}

/// `warden run` through the daemon: a cell made for the command, the command exec'd into it
/// with stdin, signals and output relayed, the same exit statuses as an in-process run, and the
/// cell ended afterwards (its workspace changes kept for review unless `--rm`).
pub fn run_through(
    client: &Client,
    args: &crate::cli::RunArgs,
    policy: &warden_policy::Policy,
    env: &[(String, String)],
    from: Option<String>,
) -> Result<i32> {
    use warden_protocol::exit;
    let argv: Vec<String> = args
        .command
        .iter()
        .map(|a| {
            a.to_str().map(str::to_owned).with_context(|| {
                format!(
                    "argument {a:?} is not UTF-8, which the daemon's API cannot carry; stop the daemon to run it in-process"
                )
            })
        })
        .collect::<Result<_>>()?;
    let workspace = workspace_dir(args.workspace.as_deref())?;
    let rt = current_thread()?;
    // The policy as this command made it (file or preset, `~`, flags): the daemon gets it whole.
    let body = warden_protocol::CreateCell {
        name: args.name.clone(),
        policy: Some(warden_policy::to_yaml(policy)),
        workspace,
        from,
        labels: [("made-by".to_owned(), "warden run".to_owned())].into(),
        secrets: callers_secrets(policy)?,
        ..Default::default()
    };
    let cell: warden_protocol::CellInfo =
        rt.block_on(client.call(Method::POST, "/v1/cells", Some(&body)))?;
    let name = cell.name;
    let spec = warden_protocol::ExecSpec {
        argv,
        env: env.iter().cloned().collect(),
        background: true,
        timeout_ms: policy.limits.wall.map(|w| w.0.as_millis() as u64),
        output_limit: policy.limits.output.map(|o| o.0),
        ..Default::default()
    };
    let outcome = rt.block_on(relay_process(client, &name, &spec, false));
    // The cell ends with its command; what it changed waits for review unless --rm.
    let end = if args.rm {
        rt.block_on(client.json(Method::DELETE, &format!("/v1/cells/{name}"), None))
    } else {
        rt.block_on(client.json(Method::POST, &format!("/v1/cells/{name}/kill"), None))
    };
    if let Err(err) = end {
        // A cell that its own limits ended already needs no kill.
        let ended = err
            .downcast_ref::<crate::client::ApiError>()
            .is_some_and(|api| api.status == hyper::StatusCode::CONFLICT);
        if !ended {
            return Err(err);
        }
    }
    let store = Store::open(Store::default_root())?;
    let changed = !args.rm
        && std::fs::read_dir(store.layer(&name).upper())
            .is_ok_and(|mut entries| entries.next().is_some());
    if !args.rm && !changed {
        // Nothing to review: the daemon forgets the cell, as an in-process run leaves nothing.
        let _ = rt.block_on(client.json(Method::DELETE, &format!("/v1/cells/{name}"), None));
    }
    if changed {
        eprintln!(
            "warden: cell {name} changed its workspace; the host directory is untouched. Review with \
             `warden diff {name}`, then `warden apply {name}` or `warden rm {name}`."
        );
    }
    let exit = match outcome {
        Ok(exit) => exit,
        Err(err) => return refused(&err).ok_or(err),
    };
    // The same words as an in-process run.
    let limit_hit = |what: &str, limit: Option<String>, code: i32| {
        let limit = limit.unwrap_or_default();
        eprintln!("warden: cell {name}: {what} limit {limit} exceeded: killed");
        code
    };
    use warden_protocol::ExitReason;
    Ok(match exit.reason {
        ExitReason::Exited | ExitReason::Signaled => exit.status(),
        ExitReason::Timeout => limit_hit(
            "wall-clock",
            policy.limits.wall.map(|w| w.to_string()),
            exit::WALL_LIMIT,
        ),
        ExitReason::MemoryLimit => limit_hit(
            "memory",
            policy.limits.memory.map(|m| m.to_string()),
            exit::MEMORY_LIMIT,
        ),
        ExitReason::DiskLimit => limit_hit(
            "disk",
            policy.limits.disk.map(|d| d.to_string()),
            exit::DISK_LIMIT,
        ),
        ExitReason::OutputLimit => limit_hit(
            "output",
            policy.limits.output.map(|o| o.to_string()),
            exit::OUTPUT_LIMIT,
        ),
        ExitReason::Failed => {
            if let Some(message) = &exit.message {
                eprintln!("warden: {message} (in cell {name})");
            }
            exit.status()
        }
        ExitReason::Killed | ExitReason::CellEnded => {
            eprintln!("warden: cell {name} was killed by `warden kill`");
            exit::KILLED
        }
    })
}

/// Runs `work` while announcing on stderr each question the cell's `ask` rules raise meanwhile
/// (about this command or about a connection it makes), with its id and how to answer, and each
/// answer. The daemon subscribes before `work` starts, so no question is missed. `tty`: the
/// terminal is raw, lines end in CR LF.
async fn announcing<T>(
    client: &Client,
    cell: &str,
    tty: bool,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let path = format!("/v1/events?cell={}", query(cell));
    let stream = client.open_events(Method::GET, &path, None).await;
    let announce = async {
        if let Ok(stream) = stream {
            let _ = stream
                .each(|event, data| {
                    if event != "entry" {
                        return;
                    }
                    if let Some(line) = serde_json::from_str::<Value>(data)
                        .ok()
                        .and_then(|entry| announcement(cell, &entry))
                    {
                        let end = if tty { "\r\n" } else { "\n" };
                        let _ = write!(std::io::stderr(), "{line}{end}");
                    }
                })
                .await;
        }
        // Without the stream (an older daemon, one that stopped) the work goes on unannounced.
        std::future::pending::<()>().await
    };
    tokio::select! {
        done = work => done,
        () = announce => unreachable!("the announcer never ends by itself"),
    }
}

/// The line that tells a person at the terminal about a question or its answer.
fn announcement(cell: &str, entry: &Value) -> Option<String> {
    use crate::render::safe;
    let data = &entry["data"];
    let text = |key: &str| safe(data[key].as_str().unwrap_or_default());
    match entry["kind"].as_str()? {
        "approval.ask" => {
            let id = entry["seq"].as_u64()?;
            Some(format!(
                "warden: cell {cell} asks for {} (rule {}): answer within {}s with `warden approve {cell} {id}` \
                 (--scope cell or always to keep the answer) or `warden deny {cell} {id}`",
                text("request"),
                text("rule"),
                data["timeout_s"].as_u64().unwrap_or(0),
            ))
        }
        "approval.answer" => Some(format!(
            "warden: {} {} for cell {cell} (by {}, scope {})",
            if data["decision"] == "approve" {
                "approved"
            } else {
                "denied"
            },
            text("request"),
            text("by"),
            text("scope"),
        )),
        "approval.timeout" => Some(format!(
            "warden: nobody answered about {} for cell {cell} in time: {}",
            text("request"),
            if data["outcome"] == "allow" {
                "allowed"
            } else {
                "denied"
            },
        )),
        _ => None,
    }
}

/// A command its cell's rules, or a person, refused: said, with its own exit status.
fn refused(err: &anyhow::Error) -> Option<i32> {
    let api = err.downcast_ref::<crate::client::ApiError>()?;
    (api.status == hyper::StatusCode::FORBIDDEN).then(|| {
        eprintln!("warden: refused: {}", api.message);
        warden_protocol::exit::REFUSED
    })
}

/// Starts the process, pumps stdin to it, forwards signals, writes its output; returns its
/// exit information.
/// Questions the cell's `ask` rules raise meanwhile are announced on stderr.
async fn relay_process(
    client: &Client,
    cell: &str,
    spec: &warden_protocol::ExecSpec,
    tty: bool,
) -> Result<warden_protocol::ExitInfo> {
    announcing(client, cell, tty, relay(client, cell, spec, tty)).await
}

async fn relay(
    client: &Client,
    cell: &str,
    spec: &warden_protocol::ExecSpec,
    tty: bool,
) -> Result<warden_protocol::ExitInfo> {
    use tokio::signal::unix::{SignalKind, signal};
    let started: warden_protocol::Started = client
        .call(Method::POST, &format!("/v1/cells/{cell}/exec"), Some(spec))
        .await?;
    let id = started.id;
    // Even a process that has ended already (a quick one, or one that could not start) is read
    // through its output: what it wrote is kept, and the stream ends with its exit.
    // stdin, from a thread of its own (reads block).
    let pump_client = client.clone();
    let stdin_path = format!("/v1/cells/{cell}/processes/{id}/stdin");
    std::thread::spawn(move || {
        let Ok(rt) = current_thread() else {
            return;
        };
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = stdin.read(&mut buf).unwrap_or(0);
            let body = if n == 0 {
                json!({ "close": true })
            } else {
                json!({ "data_base64": base64::engine::general_purpose::STANDARD.encode(&buf[..n]) })
            };
            if rt
                .block_on(pump_client.json(Method::POST, &stdin_path, Some(&body)))
                .is_err()
                || n == 0
            {
                return;
            }
        }
    });
    let listen = |kind| signal(kind).context("handling signals");
    let mut interrupt = listen(SignalKind::interrupt())?;
    let mut terminate = listen(SignalKind::terminate())?;
    let mut hangup = listen(SignalKind::hangup())?;
    let mut quit = listen(SignalKind::quit())?;
    let mut winch = listen(SignalKind::window_change())?;
    let resize_path = format!("/v1/cells/{cell}/processes/{id}/resize");
    let output_path = format!("/v1/cells/{cell}/processes/{id}/output");
    let mut exit: Option<warden_protocol::ExitInfo> = None;
    let mut output = Box::pin(
        client.events(Method::GET, &output_path, None, |event, data| {
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                return;
            };
            let bytes = || chunk_bytes(&value);
            match event {
                "stdout" => {
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&bytes());
                    let _ = out.flush();
                }
                "stderr" => {
                    let _ = std::io::stderr().write_all(&bytes());
                }
                "exit" => exit = serde_json::from_value(value.clone()).ok(),
                _ => {}
            }
        }),
    );
    let signal_path = format!("/v1/cells/{cell}/processes/{id}/signal");
    loop {
        // Signals that would end this client go to the process instead.
        let number = tokio::select! {
            done = &mut output => {
                done?;
                break;
            }
            _ = interrupt.recv() => libc::SIGINT,
            _ = terminate.recv() => libc::SIGTERM,
            _ = hangup.recv() => libc::SIGHUP,
            _ = quit.recv() => libc::SIGQUIT,
            _ = winch.recv() => {
                if let (true, Some((rows, cols))) = (tty, terminal_size()) {
                    let size = warden_protocol::TtySize { rows, cols };
                    let _ = client.call::<_, Value>(Method::POST, &resize_path, Some(&size)).await;
                }
                continue;
            }
        };
        let signal = warden_protocol::SignalBody {
            signal: warden_protocol::Signal::Number(number),
        };
        let _ = client
            .call::<_, Value>(Method::POST, &signal_path, Some(&signal))
            .await;
    }
    drop(output);
    exit.context("the process's output ended without its exit (did the daemon stop?)")
}

/// Pauses, resumes or kills a cell through the daemon when one runs and the cell is one of its
/// own (so that the journal records it); `false` when the caller should act directly.
pub fn control_through_daemon(name: &str, action: warden_protocol::ControlAction) -> Result<bool> {
    let path = format!("/v1/cells/{name}/{}", action.name());
    daemon_owns(|client, rt| {
        rt.block_on(client.call::<(), warden_protocol::CellInfo>(Method::POST, &path, None))
            .map(drop)
    })
}

/// Answers a question of a cell the daemon keeps; `false` when the caller should answer
/// through the cell's own folder.
pub fn answer_through_daemon(
    name: &str,
    id: u64,
    answer: &warden_protocol::Answer,
) -> Result<bool> {
    let path = format!("/v1/approvals/{name}/{id}");
    daemon_owns(|client, rt| {
        rt.block_on(client.call::<_, Value>(Method::POST, &path, Some(answer)))
            .map(drop)
    })
}

/// Runs `act` against the daemon: `true` when it did it, `false` when no daemon runs or it
/// does not know the cell (a 404).
fn daemon_owns(act: impl FnOnce(&Client, &tokio::runtime::Runtime) -> Result<()>) -> Result<bool> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(false);
    };
    match act(&client, &current_thread()?) {
        Ok(()) => Ok(true),
        Err(err) => match err.downcast_ref::<crate::client::ApiError>() {
            Some(api) if api.status == hyper::StatusCode::NOT_FOUND => Ok(false),
            _ => Err(err),
        },
    }
}

/// Every open question the running daemon knows of; `None` when no daemon runs.
pub fn approvals_through_daemon() -> Result<Option<Vec<warden_protocol::Approval>>> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(None);
    };
    current_thread()?
        .block_on(client.call::<(), _>(Method::GET, "/v1/approvals", None))
        .map(Some)
}

/// Removes a cell the running daemon keeps; `false` when no daemon keeps it. One that still runs
/// is refused unless `force` (it is then killed, and its unapplied changes dropped, which is
/// said).
pub fn remove_through_daemon(name: &str, force: bool) -> Result<bool> {
    let Some(client) = Client::detect(&runtime()) else {
        return Ok(false);
    };
    let rt = current_thread()?;
    let info: warden_protocol::CellInfo =
        match rt.block_on(client.call::<(), _>(Method::GET, &format!("/v1/cells/{name}"), None)) {
            Ok(info) => info,
            Err(err) => {
                return match err.downcast_ref::<crate::client::ApiError>() {
                    Some(api) if api.status == hyper::StatusCode::NOT_FOUND => Ok(false),
                    _ => Err(err),
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
        Err(err) => match err.downcast_ref::<crate::client::ApiError>() {
            Some(api) if api.status == hyper::StatusCode::NOT_FOUND => Ok(None),
            _ => Err(err),
        },
    }
}

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
    let policy = crate::commands::effective_policy(&args.policy)?;
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

pub fn exec(args: ExecArgs) -> Result<i32> {
    let client = client()?;
    let timeout_ms = match &args.timeout {
        Some(text) => Some(
            humantime::parse_duration(text)
                .with_context(|| format!("--timeout {text}: write it as 30s, 5m, 1h"))?
                .as_millis() as u64,
        ),
        None => None,
    };
    if args.interactive || args.tty {
        return exec_interactive(&client, &args, timeout_ms);
    }
    let body = serde_json::to_value(warden_protocol::ExecSpec {
        argv: args.command.clone(),
        env: pairs(&args.env, "env")?,
        cwd: args.cwd.clone(),
        timeout_ms,
        ..Default::default()
    })?;
    let path = format!("/v1/cells/{}/exec", args.name);
    let mut code = warden_protocol::exit::WARDEN_ERROR;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let rt = current_thread()?;
    let run = client.events(Method::POST, &path, Some(&body), |event, data| {
        let Ok(value) = serde_json::from_str::<Value>(data) else {
            return;
        };
        let bytes = || chunk_bytes(&value);
        match event {
            "stdout" => {
                let _ = stdout.write_all(&bytes());
                let _ = stdout.flush();
            }
            "stderr" => {
                let _ = stderr.write_all(&bytes());
            }
            "exit" => {
                code = match serde_json::from_value::<warden_protocol::ExitInfo>(value) {
                    Ok(exit) => process_exit(&exit),
                    Err(err) => {
                        eprintln!("warden: an exit this warden does not understand: {err}");
                        warden_protocol::exit::WARDEN_ERROR
                    }
                }
            }
            _ => {}
        }
    });
    match rt.block_on(announcing(&client, &args.name, false, run)) {
        Ok(()) => Ok(code),
        Err(err) => refused(&err).ok_or(err),
    }
}

/// The exit status of an exec'd process, from its `exit` event (said on stderr where it was
/// not the process's own doing).
fn process_exit(exit: &warden_protocol::ExitInfo) -> i32 {
    use warden_protocol::ExitReason;
    match (&exit.message, exit.reason) {
        (_, ExitReason::Exited | ExitReason::Signaled) => {}
        (Some(message), _) => eprintln!("warden: {message}"),
        (None, ExitReason::Timeout) => {
            eprintln!("warden: the process ran past --timeout and was killed")
        }
        (None, ExitReason::CellEnded) => {
            eprintln!("warden: the cell ended before the process did")
        }
        (None, _) => {}
    }
    match exit.reason {
        // Not the process's own status: the cell ended under it.
        ExitReason::CellEnded | ExitReason::Killed => warden_protocol::exit::WARDEN_ERROR,
        _ => exit.status(),
    }
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

/// `CELL:PATH`, when the text names a cell side.
fn cell_side(text: &str) -> Option<(&str, &str)> {
    let (cell, path) = text.split_once(':')?;
    warden_cell::linux::plan::check_name(cell).ok()?;
    Some((cell, path))
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

pub fn copy(source: &str, dest: &str) -> Result<i32> {
    let client = client()?;
    let rt = current_thread()?;
    match (cell_side(source), cell_side(dest)) {
        (None, Some((cell, path))) => {
            let host = std::path::Path::new(source);
            let meta = std::fs::metadata(host)
                .with_context(|| format!("{source} (on the host) cannot be copied"))?;
            if meta.is_dir() {
                let mut builder = tar::Builder::new(Vec::new());
                builder.follow_symlinks(false);
                builder
                    .append_dir_all(".", host)
                    .with_context(|| format!("packing {source}"))?;
                let archive = builder.into_inner().context("packing")?;
                let url = format!("/v1/cells/{cell}/files/archive?path={}", query(path));
                rt.block_on(client.bytes(Method::PUT, &url, archive))?;
            } else {
                let data = std::fs::read(host).with_context(|| format!("reading {source}"))?;
                // Into a directory of the cell (`cell:dir/`, or one that exists), as cp does.
                let into_dir = path.is_empty()
                    || path.ends_with('/')
                    || rt
                        .block_on(client.json(
                            Method::GET,
                            &format!("/v1/cells/{cell}/files/stat?path={}", query(path)),
                            None,
                        ))
                        .is_ok_and(|info| info["kind"] == "dir");
                let path = if into_dir {
                    let name = host
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    format!("{}/{name}", path.trim_end_matches('/'))
                        .trim_start_matches('/')
                        .to_owned()
                } else {
                    path.to_owned()
                };
                let url = format!("/v1/cells/{cell}/files/content?path={}", query(&path));
                rt.block_on(client.bytes(Method::PUT, &url, data))?;
            }
        }
        (Some((cell, path)), None) => {
            let stat = format!("/v1/cells/{cell}/files/stat?path={}", query(path));
            let info = rt.block_on(client.json(Method::GET, &stat, None))?;
            if info["kind"] == "dir" {
                let url = format!("/v1/cells/{cell}/files/archive?path={}", query(path));
                let archive = rt.block_on(client.bytes(Method::GET, &url, Vec::new()))?;
                std::fs::create_dir_all(dest).with_context(|| format!("making {dest}"))?;
                // `unpack` keeps every member inside `dest` (no `..`, no absolute paths).
                tar::Archive::new(archive.as_slice())
                    .unpack(dest)
                    .with_context(|| format!("unpacking into {dest}"))?;
            } else {
                let url = format!("/v1/cells/{cell}/files/content?path={}", query(path));
                let data = rt.block_on(client.bytes(Method::GET, &url, Vec::new()))?;
                let target = std::path::Path::new(dest);
                let target = if target.is_dir() {
                    target.join(path.rsplit('/').next().unwrap_or(path))
                } else {
                    target.to_path_buf()
                };
                std::fs::write(&target, data)
                    .with_context(|| format!("writing {}", target.display()))?;
            }
        }
        _ => bail!("one side of `warden cp` must be CELL:PATH and the other a host path"),
    }
    Ok(0)
}

pub fn logs(name: &str, follow: bool, only: Option<u64>) -> Result<i32> {
    let client = client()?;
    let rt = current_thread()?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut shown = std::collections::HashSet::new();
    loop {
        let processes: Vec<warden_protocol::ProcessInfo> = rt.block_on(client.call::<(), _>(
            Method::GET,
            &format!("/v1/cells/{name}/processes"),
            None,
        ))?;
        for process in processes {
            let id = process.id;
            if only.is_some_and(|o| o != id) || !shown.insert(id) {
                continue;
            }
            eprintln!(
                "==> process {id}: {} <==",
                crate::render::safe(&process.argv.join(" "))
            );
            let path = format!("/v1/cells/{name}/processes/{id}/output?follow={follow}");
            rt.block_on(client.events(Method::GET, &path, None, |event, data| {
                let Ok(value) = serde_json::from_str::<Value>(data) else {
                    return;
                };
                let bytes = chunk_bytes(&value);
                match event {
                    "stdout" => {
                        let _ = stdout.write_all(&bytes);
                        let _ = stdout.flush();
                    }
                    "stderr" => {
                        let _ = stderr.write_all(&bytes);
                    }
                    "dropped" => {
                        eprintln!("warden: ({} earlier bytes were dropped)", value["bytes"]);
                    }
                    _ => {}
                }
            }))?;
        }
        if !follow {
            return Ok(0);
        }
        // Following: processes started later are shown as they come, until the cell ends.
        let cell: warden_protocol::CellInfo =
            rt.block_on(client.call::<(), _>(Method::GET, &format!("/v1/cells/{name}"), None))?;
        if cell.state == warden_protocol::CellState::Ended {
            return Ok(0);
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// Puts a terminal in raw mode until dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> Result<Self> {
        let stdin = std::io::stdin();
        let saved = rustix::termios::tcgetattr(&stdin).context("reading the terminal's mode")?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw)
            .context("putting the terminal in raw mode")?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}

fn terminal_size() -> Option<(u16, u16)> {
    let size = rustix::termios::tcgetwinsize(std::io::stdout()).ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then_some((size.ws_row, size.ws_col))
}

/// `warden exec -i` / `-t`: stdin passed as it comes, on a terminal with `-t`.
fn exec_interactive(client: &Client, args: &ExecArgs, timeout_ms: Option<u64>) -> Result<i32> {
    use std::io::IsTerminal as _;
    let mut spec = warden_protocol::ExecSpec {
        argv: args.command.clone(),
        env: pairs(&args.env, "env")?,
        cwd: args.cwd.clone(),
        timeout_ms,
        background: true,
        ..Default::default()
    };
    let _raw = if args.tty {
        if !std::io::stdin().is_terminal() {
            bail!("-t needs a terminal on stdin (use -i to pass a pipe or a file)");
        }
        let (rows, cols) = terminal_size().unwrap_or((24, 80));
        spec.tty = Some(warden_protocol::TtySize { rows, cols });
        Some(RawMode::enter()?)
    } else {
        None
    };
    let exit = current_thread()?.block_on(relay_process(client, &args.name, &spec, args.tty));
    drop(_raw);
    let exit = match exit {
        Ok(exit) => exit,
        Err(err) => return refused(&err).ok_or(err),
    };
    Ok(process_exit(&exit))
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

pub fn audit(command: AuditCommand) -> Result<i32> {
    match command {
        AuditCommand::Verify { journal, key } => {
            let dir = journal_dir(journal);
            match warden_journal::verify(&dir, key.as_deref()) {
                Ok(report) => {
                    println!(
                        "ok: {} entries (last {}) in {} segment(s), {} signed checkpoints, {} entries after the last one; key {}",
                        report.entries,
                        report.last_seq,
                        report.segments,
                        report.checkpoints,
                        report.unsigned_tail,
                        report.key
                    );
                    if report.first_seq > 1 {
                        println!(
                            "note: the chain is proven from entry {}: the segments before it are not in {}",
                            report.first_seq,
                            dir.display()
                        );
                    }
                    if report.torn_bytes > 0 {
                        println!(
                            "note: a torn last line of {} bytes (a write cut by a crash, never acknowledged) follows; the daemon removes it when it next starts",
                            report.torn_bytes
                        );
                    }
                    Ok(0)
                }
                Err(err @ warden_journal::VerifyError::Bad { .. }) => {
                    println!("FAILED: {err}");
                    Ok(1)
                }
                Err(err) => Err(err.into()),
            }
        }
        AuditCommand::Export {
            format,
            cell,
            since,
            journal,
        } => {
            let since_ms = match since {
                Some(text) => Some(parse_since(&text)?),
                None => None,
            };
            let dir = journal_dir(journal);
            let format = match format {
                ExportFormat::Jsonl => Format::Jsonl,
                ExportFormat::Ocsf => Format::Ocsf,
            };
            let mut out = std::io::stdout().lock();
            warden_journal::export(&dir, format, cell.as_deref(), since_ms, &mut out)
                .with_context(|| format!("reading the journal in {}", dir.display()))?;
            Ok(0)
        }
    }
}

fn parse_since(text: &str) -> Result<u64> {
    if let Ok(time) = humantime::parse_rfc3339_weak(text) {
        return Ok(time
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64));
    }
    let age = humantime::parse_duration(text).with_context(|| {
        format!("--since {text}: give a time (2026-01-02T03:04:05Z) or an age (90m, 2h)")
    })?;
    Ok(warden_harness::now_ms().saturating_sub(age.as_millis() as u64))
}

pub fn replay(name: &str, json_out: bool) -> Result<i32> {
    let dir = journal_dir(None);
    let mut text = Vec::new();
    warden_journal::export(&dir, Format::Jsonl, Some(name), None, &mut text)
        .with_context(|| format!("reading the journal in {}", dir.display()))?;
    let entries: Vec<Entry> = String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if entries.is_empty() {
        bail!("the journal has nothing about cell `{name}`");
    }
    if json_out {
        for entry in &entries {
            println!("{}", serde_json::to_string(entry)?);
        }
        return Ok(0);
    }
    for entry in &entries {
        println!(
            "{}  #{:<6} {:<14} {}",
            entry.time_text(),
            entry.seq,
            crate::render::safe(&entry.kind),
            crate::render::safe(&summary(entry))
        );
    }
    Ok(0)
}

/// One line about an entry, for people.
fn summary(entry: &Entry) -> String {
    let d = &entry.data;
    let argv = || {
        d["argv"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    };
    match entry.kind.as_str() {
        "exec.start" => format!("process {}: {}", d["process"], argv()),
        "exec.exit" => {
            let how = match (d["code"].as_i64(), d["signal"].as_i64()) {
                (Some(code), _) => format!("code {code}"),
                (None, Some(signal)) => format!("signal {signal}"),
                _ => String::new(),
            };
            format!(
                "process {} {} {how} after {} ms, {} bytes out, {} bytes err",
                d["process"],
                d["reason"].as_str().unwrap_or_default(),
                d["duration_ms"].as_u64().unwrap_or(0),
                d["stdout_bytes"].as_u64().unwrap_or(0),
                d["stderr_bytes"].as_u64().unwrap_or(0)
            )
        }
        "policy.replaced" => format!(
            "network and command rules replaced, {} open connection(s) closed",
            d["closed_connections"].as_u64().unwrap_or(0)
        ),
        "policy.refused" => d["reason"].as_str().unwrap_or_default().to_owned(),
        _ if d.as_object().is_some_and(|o| o.is_empty()) => String::new(),
        _ => d.to_string(),
    }
}
