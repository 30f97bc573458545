//! The one interface the CLI speaks to a warden about a cell, with its two implementations:
//! the daemon's API (`warden-client`), for a cell a daemon keeps, so that its journal, its
//! approvals (`approvals.apply: ask`) and its events see what the CLI did; and the tiers in this
//! process (`warden-cell`'s boundary), for a cell no daemon keeps (one of `warden run`'s, or
//! the layer it left). Each command turns its arguments into the same typed request and asks
//! [`for_cell`] which answers.

use anyhow::{Context, Result, bail};
use hyper::Method;
use warden_cell::{Registry, Store};
use warden_client::Client;
use warden_protocol::{Answer, ApplyRequest, ControlAction, Decision, Snapshot};
use warden_workspace::{ApplyOptions, ApplyReport, Diff};

/// What the CLI asks about one cell.
pub trait Warden {
    /// Who answers, for messages.
    fn who(&self) -> &'static str;
    fn diff(&self, name: &str) -> Result<Diff>;
    fn apply(&self, name: &str, request: &ApplyRequest) -> Result<ApplyReport>;
    fn snapshot(&self, name: &str, as_name: Option<&str>) -> Result<Snapshot>;
    fn reset(&self, name: &str, to: Option<&str>) -> Result<()>;
    fn control(&self, name: &str, action: ControlAction) -> Result<()>;
    fn answer(&self, name: &str, id: u64, answer: &Answer) -> Result<()>;
}

/// The warden that keeps cell `name`: the daemon when one runs and knows it, else this process.
pub fn for_cell(name: &str) -> Result<Box<dyn Warden>> {
    if let Some(client) = crate::daemon::client_if_running() {
        let rt = current_thread()?;
        let known = rt.block_on(client.call::<(), warden_protocol::CellInfo>(
            Method::GET,
            &format!("/v1/cells/{name}"),
            None,
        ));
        match known {
            Ok(_) => return Ok(Box::new(Daemon { client, rt })),
            Err(err)
                if err
                    .api()
                    .is_some_and(|a| a.status == hyper::StatusCode::NOT_FOUND) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(Box::new(InProcess::open()?))
}

fn current_thread() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The daemon's API.
struct Daemon {
    client: Client,
    rt: tokio::runtime::Runtime,
}

impl Daemon {
    fn call<B: serde::Serialize, T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T> {
        Ok(self.rt.block_on(self.client.call(method, path, body))?)
    }
}

impl Warden for Daemon {
    fn who(&self) -> &'static str {
        "the daemon"
    }

    fn diff(&self, name: &str) -> Result<Diff> {
        self.call::<(), _>(Method::GET, &format!("/v1/cells/{name}/diff"), None)
    }

    fn apply(&self, name: &str, request: &ApplyRequest) -> Result<ApplyReport> {
        self.call(
            Method::POST,
            &format!("/v1/cells/{name}/apply"),
            Some(request),
        )
    }

    fn snapshot(&self, name: &str, as_name: Option<&str>) -> Result<Snapshot> {
        let body = serde_json::json!({ "as": as_name });
        self.call(
            Method::POST,
            &format!("/v1/cells/{name}/snapshot"),
            Some(&body),
        )
    }

    fn reset(&self, name: &str, to: Option<&str>) -> Result<()> {
        let body = serde_json::json!({ "to": to });
        self.call::<_, serde_json::Value>(
            Method::POST,
            &format!("/v1/cells/{name}/reset"),
            Some(&body),
        )
        .map(drop)
    }

    fn control(&self, name: &str, action: ControlAction) -> Result<()> {
        self.call::<(), warden_protocol::CellInfo>(
            Method::POST,
            &format!("/v1/cells/{name}/{}", action.name()),
            None,
        )
        .map(drop)
    }

    fn answer(&self, name: &str, id: u64, answer: &Answer) -> Result<()> {
        self.call::<_, serde_json::Value>(
            Method::POST,
            &format!("/v1/approvals/{name}/{id}"),
            Some(answer),
        )
        .map(drop)
    }
}

/// The tiers, in this process.
struct InProcess {
    tiers: warden_cell::Tiers,
}

impl InProcess {
    fn open() -> Result<Self> {
        Ok(Self {
            tiers: warden_cell::Tiers::built_in(warden_cell::ProcessConfig {
                runtime: Registry::default_root(),
                state: Store::default_root(),
                warden_exe: std::env::current_exe().context("finding the warden binary")?,
                keeper_open_files: None,
                keeper_env: Vec::new(),
                keepers_ahead: 0,
            }),
        })
    }

    /// Any tier answers for a name: every tier's cells are in the one registry and store.
    fn tier(&self) -> Result<std::sync::Arc<dyn warden_cell::Backend>> {
        Ok(self.tiers.default_tier()?)
    }

    /// The running cell `name`.
    fn cell(&self, name: &str) -> Result<std::sync::Arc<dyn warden_cell::Cell>> {
        match self.tier()?.adopt(name)? {
            Some(cell) => Ok(cell),
            None => bail!("no running cell named `{name}` (`warden ps` lists them)"),
        }
    }
}

impl Warden for InProcess {
    fn who(&self) -> &'static str {
        "this process"
    }

    fn diff(&self, name: &str) -> Result<Diff> {
        Ok(self.tier()?.diff(name)?.0)
    }

    fn apply(&self, name: &str, request: &ApplyRequest) -> Result<ApplyReport> {
        let options = ApplyOptions {
            paths: request.paths.clone(),
            dry_run: request.dry_run,
            force: request.force,
            include_sensitive: request.include_sensitive,
            digest: request.digest.clone(),
            ..ApplyOptions::default()
        };
        Ok(self.tier()?.apply(name, options)?)
    }

    fn snapshot(&self, name: &str, as_name: Option<&str>) -> Result<Snapshot> {
        let info = self.tier()?.snapshot(name, as_name)?;
        Ok(Snapshot {
            id: info.id,
            size: info.size,
        })
    }

    fn reset(&self, name: &str, to: Option<&str>) -> Result<()> {
        Ok(self.tier()?.reset(name, to)?)
    }

    fn control(&self, name: &str, action: ControlAction) -> Result<()> {
        let cell = self.cell(name)?;
        match action {
            ControlAction::Pause => cell.freeze()?,
            ControlAction::Resume => cell.thaw()?,
            ControlAction::Kill => {
                cell.kill()?;
                // Killed means gone: its keeper too, so that what comes next (`warden rm`)
                // finds the cell ended.
                if !cell.wait_ended() {
                    bail!("cell `{name}` was killed but has not ended after 10 s; see `warden ps`");
                }
            }
        }
        Ok(())
    }

    fn answer(&self, name: &str, id: u64, answer: &Answer) -> Result<()> {
        if answer.scope != warden_protocol::Scope::Once {
            bail!(
                "--scope {} needs the daemon (`warden serve`): it remembers grants",
                match answer.scope {
                    warden_protocol::Scope::Cell => "cell",
                    _ => "always",
                }
            );
        }
        let cell = self.cell(name)?;
        cell.answer(id, answer.decision == Decision::Approve)?;
        Ok(())
    }
}
