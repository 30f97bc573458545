//! The brains outside the cell: the warden runs an agent's loop itself, so it can pause it,
//! step it, give it an operator's words, rewind it to a turn or fork it there, and journal
//! every model exchange and tool call from its own view.
//!
//! A session is a model (`client`), a cell (made through the harness like any other), and the
//! loop (`session`): the model's tool calls (`tools`) are carried out in the cell through the
//! same harness calls the API and the MCP server make, so the cell's policy, its command rules,
//! approvals and the journal apply to each. The workspace is snapshotted at the end of every
//! turn (its changed files only), which is what rewind and fork go back to.

pub mod client;
mod session;
pub mod tools;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde_json::json;
use warden_harness::{Harness, HarnessError, PolicySource};
use warden_model::Item;
use warden_protocol::{
    AgentAction, AgentInfo, AgentState, CreateCell, ForkAgent, Rerun, RerunCall, StartAgent,
    TokenUsage, Transcript, TurnInfo,
};

pub use client::Model;
use session::Saved;
pub use session::{DEFAULT_STEPS, DEFAULT_TOOL_OUTPUT, INSTRUCTIONS, Session};

/// The label that marks a cell made for a session (its value: the session's id).
pub const SESSION_LABEL: &str = "agent.session";

/// The sessions of one harness.
#[derive(Debug)]
pub struct Agents {
    harness: Arc<Harness>,
    /// Where sessions are kept across restarts (none: for one command's life).
    dir: Option<PathBuf>,
    sessions: Mutex<BTreeMap<String, Arc<Session>>>,
}

warden_harness::failures! {
    /// Agent sessions: starting one, and what an operator does to it.
    AgentError {
        /// A request a session cannot take (its task, tools, budgets, model, cell).
        Invalid => BadRequest "invalid-request",
        /// No session has the id, or the session no turn of the number.
        NoSession => NotFound "no-such-session",
        /// The session cannot do this in its state (it ended; it has no snapshots to go back to).
        State => Conflict "wrong-state",
        /// The session's own state failed.
        Failed => Internal "agent-failed",
    }
}

fn not_found(id: &str) -> HarnessError {
    AgentError::NoSession(format!(
        "no agent session `{id}` (list them with `warden agent ls` or GET /v1/agents)"
    ))
    .into()
}

fn bad_model(message: String) -> HarnessError {
    AgentError::Invalid(message).into()
}

/// This process's user id.
fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// The key for a model: the caller's, else the warden's environment's.
fn key_for(model: &str, given: Option<String>) -> Option<String> {
    given.filter(|k| !k.is_empty()).or_else(|| {
        let provider = model.split(':').next()?;
        let format = warden_model::Format::from_provider(provider)?;
        std::env::var(format.key_variable())
            .ok()
            .filter(|k| !k.is_empty())
    })
}

impl Agents {
    /// Opens the sessions a daemon kept in `dir` (they come back paused: their loops ended
    /// with the daemon that ran them; one an operator had stopped comes back to end), or none.
    pub fn open(harness: Arc<Harness>, dir: Option<PathBuf>) -> Arc<Self> {
        let agents = Arc::new(Self {
            harness,
            dir: dir.clone(),
            sessions: Mutex::new(BTreeMap::new()),
        });
        let Some(dir) = dir else { return agents };
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700));
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return agents;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let Some(mut saved) = Saved::read(&path) else {
                continue;
            };
            let was_running = !saved.info.state.is_over();
            // A stop acknowledged before the crash is carried out: the loop, started again in
            // its stop mode, ends the session at once (journaled, its cell thawed), as the last
            // daemon's would have.
            if was_running && !saved.stopping {
                saved.info.state = AgentState::Paused;
            }
            let key = key_for(&saved.info.model, None);
            let Ok(model) = Model::new(&saved.info.model, Some(&saved.info.base_url), key) else {
                continue;
            };
            let session = Session::new(Arc::clone(&agents.harness), model, saved, true, Some(path));
            // A cell the session left paused is still frozen: resume thaws it.
            if agents
                .harness
                .get(&session.cell)
                .is_ok_and(|c| c.state == warden_protocol::CellState::Paused)
            {
                session.adopt_freeze();
            }
            if was_running {
                session.spawn();
            }
            if let Ok(mut sessions) = agents.sessions.lock() {
                sessions.insert(session.id.clone(), session);
            }
        }
        agents
    }

    pub fn harness(&self) -> &Arc<Harness> {
        &self.harness
    }

    fn session(&self, id: &str) -> Result<Arc<Session>, HarnessError> {
        self.sessions
            .lock()
            .ok()
            .and_then(|s| s.get(id).cloned())
            .ok_or_else(|| not_found(id))
    }

    pub fn list(&self) -> Vec<AgentInfo> {
        self.sessions
            .lock()
            .map(|s| s.values().map(|s| s.info()).collect())
            .unwrap_or_default()
    }

    pub fn get(&self, id: &str) -> Result<AgentInfo, HarnessError> {
        Ok(self.session(id)?.info())
    }

    pub fn transcript(&self, id: &str) -> Result<Transcript, HarnessError> {
        Ok(self.session(id)?.transcript())
    }

    /// Waits until the session is paused or over.
    pub async fn settled(&self, id: &str) -> Result<AgentInfo, HarnessError> {
        Ok(self.session(id)?.settled().await)
    }

    /// A new id, `agent-` and 8 random hex digits (also its cell's name: cells' names are
    /// the host's, shared with other daemons).
    fn next_id(&self) -> String {
        loop {
            let mut bytes = [0u8; 4];
            let _ = std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
            let id = format!(
                "agent-{}",
                bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
            );
            let taken = self
                .sessions
                .lock()
                .map(|s| s.contains_key(&id))
                .unwrap_or(true);
            if !taken && self.harness.get(&id).is_err() {
                return id;
            }
        }
    }

    /// A session without a host directory works in an empty one of its own (so that its
    /// turns can be snapshotted, diffed and rewound like any other), owner-only under the
    /// temporary directory: not under Warden's state, which no cell may see.
    fn scratch(&self, id: &str) -> Result<String, HarnessError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let base = std::env::temp_dir().join(format!("warden-agents-{}", uid()));
        let made = |dir: &std::path::Path| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| {
                    HarnessError::from(AgentError::Failed(format!("making {}: {e}", dir.display())))
                })
        };
        made(&base)?;
        let dir = base.join(id);
        made(&dir)?;
        Ok(dir.display().to_string())
    }

    /// Starts a session: its cell (a new one, or the one named), the snapshot of turn 0, the
    /// loop.
    pub async fn start(
        self: &Arc<Self>,
        request: StartAgent,
        by: &str,
    ) -> Result<AgentInfo, HarnessError> {
        if request.task.trim().is_empty() {
            return Err(HarnessError::from(AgentError::Invalid(
                "the task is empty: say what the agent is to do".into(),
            )));
        }
        let key = key_for(&request.model, request.api_key.clone());
        let model =
            Model::new(&request.model, request.base_url.as_deref(), key).map_err(bad_model)?;
        for tool in request.tools.keys() {
            if !tools::names().contains(tool) {
                return Err(HarnessError::from(AgentError::Invalid(format!(
                    "tools: there is no tool `{tool}`; the tools are {}",
                    tools::names().join(", ")
                ))));
            }
        }
        if request.budgets.steps == Some(0) {
            return Err(HarnessError::from(AgentError::Invalid(
                "budgets.steps must be at least 1".into(),
            )));
        }
        let id = self.next_id();
        let cell = match &request.cell {
            Some(cell) => {
                if request.policy.is_some()
                    || request.preset.is_some()
                    || request.workspace.is_some()
                {
                    return Err(HarnessError::from(AgentError::Invalid("give `cell` (an existing cell) or what makes a new one (policy, preset, workspace), not both".into())));
                }
                self.harness.get(cell)?.name
            }
            None => {
                let made = self
                    .harness
                    .create(CreateCell {
                        name: Some(id.clone()),
                        policy: request.policy.clone(),
                        preset: request.preset.clone(),
                        workspace: match &request.workspace {
                            Some(dir) => Some(dir.clone()),
                            None => Some(self.scratch(&id)?),
                        },
                        labels: [(SESSION_LABEL.to_owned(), id.clone())].into(),
                        ..Default::default()
                    })
                    .await?;
                made.name
            }
        };
        let mut instructions = INSTRUCTIONS.to_owned();
        if let Some(extra) = request
            .instructions
            .as_deref()
            .filter(|s| !s.trim().is_empty())
        {
            instructions.push_str("\n\n");
            instructions.push_str(extra);
        }
        let items = vec![Item::User {
            text: request.task.clone(),
        }];
        self.launch(
            id,
            cell,
            model,
            instructions,
            items,
            0,
            Vec::new(),
            request.budgets,
            request.tools,
            request.paused,
            None,
            json!({ "task": request.task, "by": by }),
            None,
        )
        .await
    }

    /// Makes a session and starts its loop, after the journal has its start and turn 0.
    #[allow(clippy::too_many_arguments)]
    async fn launch(
        self: &Arc<Self>,
        id: String,
        cell: String,
        model: Model,
        instructions: String,
        items: Vec<Item>,
        turn: u32,
        mut turns: Vec<TurnInfo>,
        budgets: warden_protocol::Budgets,
        modes: BTreeMap<String, warden_protocol::ToolMode>,
        paused: bool,
        forked_from: Option<String>,
        mut start: serde_json::Value,
        say: Option<(&str, &str)>,
    ) -> Result<AgentInfo, HarnessError> {
        if let Some(key) = model.key() {
            self.harness.journal().add_redactions([key.to_owned()]);
        }
        start["id"] = id.clone().into();
        start["model"] = model.spec().into();
        start["base_url"] = model.base_url.clone().into();
        start["budgets"] = json!(budgets);
        start["tools"] = json!(modes);
        start["forked_from"] = json!(forked_from);
        self.harness
            .record(Some(&cell), "agent.start", start)
            .await?;
        let snapshot = session::snapshot(&self.harness, &cell).await?;
        turns.push(TurnInfo {
            turn,
            snapshot,
            items: items.len(),
        });
        let info = AgentInfo {
            id: id.clone(),
            cell,
            state: if paused {
                AgentState::Paused
            } else {
                AgentState::Running
            },
            model: model.spec(),
            base_url: model.base_url.clone(),
            turn,
            usage: TokenUsage::default(),
            started_ms: warden_harness::now_ms(),
            ended: None,
            summary: None,
            forked_from,
            turns,
        };
        let saved = Saved {
            info,
            instructions,
            items,
            conversation: None,
            pending: Vec::new(),
            budgets,
            modes,
            stopping: false,
        };
        let path = self.dir.as_ref().map(|d| d.join(format!("{id}.json")));
        let session = Session::new(Arc::clone(&self.harness), model, saved, paused, path);
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.insert(id, Arc::clone(&session));
        }
        session.save();
        // Words for its first turn are there before the loop starts.
        if let Some((text, by)) = say {
            return session.say(text, by).await;
        }
        session.spawn();
        Ok(session.info())
    }

    pub async fn control(
        &self,
        id: &str,
        action: AgentAction,
        by: &str,
    ) -> Result<AgentInfo, HarnessError> {
        self.session(id)?.control(action, by).await
    }

    pub async fn say(&self, id: &str, text: &str, by: &str) -> Result<AgentInfo, HarnessError> {
        self.session(id)?.say(text, by).await
    }

    pub async fn rewind(&self, id: &str, turn: u32, by: &str) -> Result<AgentInfo, HarnessError> {
        self.session(id)?.rewind(turn, by).await
    }

    /// A new cell from `snapshot` with the policy `cell` was made with, labelled for `session`.
    async fn cell_like(
        &self,
        cell: &str,
        snapshot: String,
        name: String,
        session: String,
    ) -> Result<String, HarnessError> {
        let (policy, preset) = match self.harness.policy(cell)?.0 {
            PolicySource::Preset(p) => (None, Some(p)),
            PolicySource::Yaml(y) => (Some(y), None),
        };
        Ok(self
            .harness
            .create(CreateCell {
                name: Some(name),
                policy,
                preset,
                from: Some(snapshot),
                labels: [(SESSION_LABEL.to_owned(), session)].into(),
                ..Default::default()
            })
            .await?
            .name)
    }

    /// Carries out a session's recorded tool calls again, in order, in a new cell made from
    /// its first snapshot (the same policy), and says where the results diverge. Nothing asks
    /// the model; the session is left as it is.
    pub async fn rerun(self: &Arc<Self>, id: &str, by: &str) -> Result<Rerun, HarnessError> {
        let original = self.session(id)?;
        original.settle().await?;
        let info = original.info();
        let from = session::snapshot_of(&session::turn_info(&info, 0)?, id)?;
        let cell = self
            .cell_like(
                &info.cell,
                from,
                format!("{}-rerun", self.next_id()),
                format!("{id} (rerun)"),
            )
            .await?;
        let (budgets, modes) = original.limits();
        let limit = budgets.tool_output_bytes.unwrap_or(DEFAULT_TOOL_OUTPUT) as usize;
        let items = original.transcript().items;
        let mut calls = Vec::new();
        let mut turn = 0;
        for item in &items {
            let Item::Assistant { calls: asked, .. } = item else {
                continue;
            };
            turn += 1;
            for call in asked {
                let Some((recorded, error)) = items.iter().find_map(|i| match i {
                    Item::Result {
                        call_id,
                        output,
                        error,
                    } if *call_id == call.id => Some((output.clone(), *error)),
                    _ => None,
                }) else {
                    continue;
                };
                let mode = modes.get(&call.name).copied().unwrap_or_default();
                // Only what ran is carried out again: a call answered "not run" (past the most
                // a reply may make, or cut by a stop) never ran, and one of an `ask` tool that
                // was refused (a person said no, or nobody answered and the policy refused) is
                // not carried out unasked (a rerun ran both).
                let never_ran = error
                    && (recorded.starts_with("not run: ")
                        || (mode == warden_protocol::ToolMode::Ask
                            && recorded.starts_with("refused (")));
                if never_ran {
                    calls.push(RerunCall {
                        turn,
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                        same: true,
                        now: "not run again: it did not run in the session".to_owned(),
                        recorded,
                    });
                    continue;
                }
                let now = match tools::arguments(&call.name, &call.arguments) {
                    Err(outcome) => outcome,
                    Ok(_) if mode == warden_protocol::ToolMode::Deny => {
                        tools::Outcome::error(format!(
                            "refused: the operator does not allow the tool `{}` in this session",
                            call.name
                        ))
                    }
                    Ok(args) => {
                        tools::run(
                            &self.harness,
                            &cell,
                            &call.name,
                            &args,
                            limit,
                            std::future::pending(),
                        )
                        .await
                    }
                };
                calls.push(RerunCall {
                    turn,
                    name: call.name.clone(),
                    arguments: call.arguments.clone(),
                    same: now.output == recorded && now.error == error,
                    recorded,
                    now: now.output,
                });
            }
        }
        let diverged = calls.iter().filter(|c| !c.same).count();
        self.harness
            .record(Some(&info.cell), "agent.rerun", json!({ "id": id, "cell": cell, "calls": calls.len(), "diverged": diverged, "by": by }))
            .await?;
        Ok(Rerun {
            id: id.to_owned(),
            cell,
            calls,
            diverged,
        })
    }

    /// A new session in a new cell, from the end of a turn of another: its workspace the
    /// turn's snapshot, its conversation the turns up to it. The original is left as it is.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        request: ForkAgent,
        by: &str,
    ) -> Result<AgentInfo, HarnessError> {
        let original = self.session(id)?;
        if request.say.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(HarnessError::from(AgentError::Invalid(
                "say something: the instruction for the fork is empty (leave `say` out for none)"
                    .into(),
            )));
        }
        original.settle().await?;
        let info = original.info();
        let target = session::turn_info(&info, request.turn)?;
        let spec = request.model.clone().unwrap_or_else(|| info.model.clone());
        let base_url = request
            .base_url
            .clone()
            .or_else(|| request.model.is_none().then(|| info.base_url.clone()));
        let key = key_for(
            &spec,
            request.api_key.clone().or_else(|| original.model_key()),
        );
        let model = Model::new(&spec, base_url.as_deref(), key).map_err(bad_model)?;
        let new_id = self.next_id();
        let from = session::snapshot_of(&target, id)?;
        let cell = self
            .cell_like(&info.cell, from, new_id.clone(), new_id.clone())
            .await?;
        let transcript = original.transcript();
        let mut items = transcript.items;
        items.truncate(target.items);
        let turns: Vec<TurnInfo> = info
            .turns
            .iter()
            .filter(|t| t.turn < request.turn)
            .cloned()
            .collect();
        let (budgets, modes) = original.limits();
        let from = format!("{id}@{}", request.turn);
        let agent = self
            .launch(
                new_id,
                cell,
                model,
                transcript.instructions,
                items,
                request.turn,
                turns,
                budgets,
                modes,
                request.paused,
                Some(from.clone()),
                json!({ "fork_of": id, "at_turn": request.turn, "by": by }),
                request.say.as_deref().map(|text| (text, by)),
            )
            .await?;
        self.harness
            .record(Some(&info.cell), "agent.fork", json!({ "id": id, "turn": request.turn, "into": agent.id, "cell": agent.cell, "by": by }))
            .await?;
        Ok(agent)
    }
}
