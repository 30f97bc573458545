//! Cells made ahead (`warden serve --pool POLICY=N`): per policy, a number of cells started
//! with everything but a command (namespaces, cgroup and its limits, root, gateway), so that a
//! create asking for that policy takes one that is ready. A pool serves only a create that asks
//! for nothing a cell must be started with: no name (the pooled cell's own is its name), no
//! workspace, no snapshot or checkpoint to start from, no environment of its own, no secrets;
//! and whose policy, resolved, is the pool's. A cell made ahead runs nothing before it is
//! handed out (no exec reaches a cell the harness has not handed out), and is never handed out
//! twice: a deleted cell is gone, and the pool starts a new one.
//!
//! Each cell made ahead has a marker in the daemon's `pool/` folder until it is handed out; a
//! daemon that starts ends the cells its predecessor left made ahead and never handed out.

use std::collections::VecDeque;

use crate::cells::generate_name;

use super::*;

/// One pool the daemon keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// How it is shown: the preset's name or the policy file's path.
    pub label: String,
    /// The policy of its cells.
    pub policy: PolicySource,
    /// How many cells it keeps made ahead.
    pub size: usize,
}

#[derive(Debug)]
pub(crate) struct Pool {
    spec: PoolSpec,
    /// Its policy, resolved (what a create's must equal).
    policy: warden_policy::Policy,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    ready: VecDeque<(String, Arc<dyn Cell>)>,
    /// Cells being made now.
    making: usize,
    taken: u64,
    error: Option<String>,
    /// The daemon stops: cells made from now on are ended at once.
    closed: bool,
}

/// What a marker holds after its tier's name once its cell is being handed out.
const HANDING_OUT: &str = "\nhanding out";

/// Where the markers of cells made ahead are.
fn markers(daemon_dir: &Path) -> PathBuf {
    daemon_dir.join("pool")
}

/// The names of the cells a daemon whose state directory is `state` holds made ahead, not
/// handed out (`warden ps` lists them as its pools, not as cells; a run's cell keeps its
/// marker, marked as handed out, for its run's life, and is a cell).
pub fn made_ahead(state: &Path) -> std::collections::HashSet<String> {
    std::fs::read_dir(markers(&state.join("daemon")))
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    !std::fs::read_to_string(e.path()).is_ok_and(|m| m.ends_with(HANDING_OUT))
                })
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Pool {
    /// Resolves a pool's policy; refuses one whose cells would need a caller's secrets.
    pub(crate) fn new(spec: PoolSpec) -> Result<Self, HarnessError> {
        let invalid = |why: String| {
            HarnessError::from(CreateError::Invalid(format!(
                "pool `{}`: {why}",
                spec.label
            )))
        };
        let policy = match &spec.policy {
            PolicySource::Preset(name) => warden_policy::preset(name),
            PolicySource::Yaml(yaml) => warden_policy::from_yaml(&spec.label, yaml),
        }
        .map_err(|e| invalid(e.to_string()))?;
        if let Some(var) = policy
            .credentials
            .values()
            .find_map(|c| c.from_env.as_deref())
        {
            return Err(invalid(format!(
                "its credentials read `{var}` from the caller's environment, and a cell made ahead has no caller; pool a policy without `from_env` credentials"
            )));
        }
        Ok(Self {
            spec,
            policy,
            state: Mutex::new(PoolState::default()),
        })
    }
}

/// Refuses two pools of one policy (once resolved): a create takes from the first that
/// matches, so the second would make cells nobody takes.
pub(crate) fn distinct(pools: Vec<Pool>) -> Result<Vec<Pool>, HarnessError> {
    for (i, pool) in pools.iter().enumerate() {
        if let Some(first) = pools[..i].iter().find(|p| p.policy == pool.policy) {
            return Err(HarnessError::from(CreateError::Invalid(format!(
                "pools `{}` and `{}` have the same policy (once resolved), and a create takes from the first only; give one pool the size of both (`--pool {}={}`)",
                first.spec.label,
                pool.spec.label,
                first.spec.label,
                (first.spec.size + pool.spec.size).min(64)
            ))));
        }
    }
    Ok(pools)
}

/// How long the daemon journals nothing (but its pools' entries) before a pool makes a cell:
/// making one takes locks of the kernel's that a create, an exec or a delete under way wait
/// for (a cgroup v1 attach holds the cgroup lock through an RCU grace period), so cells are
/// made between requests, not during them.
const QUIET: Duration = Duration::from_millis(5);

/// The longest a pool waits for quiet before it makes a cell anyway.
const QUIET_AT_MOST: Duration = Duration::from_millis(250);

impl Harness {
    /// Notes that the daemon did something now (a pool waits for quiet).
    pub(crate) fn pools_wait_for_quiet_since_now(&self) {
        let now = self.opened.elapsed().as_micros() as u64;
        self.last_entry_us.store(now, Ordering::Relaxed);
    }

    /// Waits until the daemon journaled nothing for `QUIET`, or `QUIET_AT_MOST` passed.
    async fn quiet(&self) {
        let until = Instant::now() + QUIET_AT_MOST;
        loop {
            let last = Duration::from_micros(self.last_entry_us.load(Ordering::Relaxed));
            let since = self.opened.elapsed().saturating_sub(last);
            if since >= QUIET || Instant::now() >= until {
                return;
            }
            tokio::time::sleep((QUIET - since).max(Duration::from_millis(1))).await;
        }
    }

    /// The pools, as the API shows them.
    pub fn pools(&self) -> Vec<warden_protocol::PoolInfo> {
        self.pools
            .iter()
            .map(|pool| {
                let (ready, taken, error, memory) = match pool.state.lock() {
                    Ok(state) => (
                        state.ready.len(),
                        state.taken,
                        state.error.clone(),
                        state
                            .ready
                            .iter()
                            .filter_map(|(_, cell)| cell.usage()?.memory_bytes)
                            .sum(),
                    ),
                    Err(_) => (0, 0, None, 0),
                };
                warden_protocol::PoolInfo {
                    policy: pool.spec.label.clone(),
                    tier: pool.policy.tier.name().to_owned(),
                    size: pool.spec.size,
                    ready,
                    memory_bytes: memory,
                    taken,
                    error,
                }
            })
            .collect()
    }

    /// A cell made ahead for a create whose policy, resolved, is `policy`, if a pool has one
    /// ready: its name and handle. The pool makes another in its place.
    pub(crate) fn take_pooled(
        self: &Arc<Self>,
        policy: &warden_policy::Policy,
    ) -> Option<(String, Arc<dyn Cell>)> {
        let index = self.pools.iter().position(|p| p.policy == *policy)?;
        let pool = &self.pools[index];
        let mut dead = Vec::new();
        let taken = {
            let mut state = pool.state.lock().ok()?;
            let mut taken = None;
            while let Some((name, cell)) = state.ready.pop_front() {
                if matches!(cell.status(), Ok(Status::Running)) {
                    state.taken += 1;
                    taken = Some((name, cell));
                    break;
                }
                dead.push((name, cell));
            }
            taken
        };
        for (name, cell) in dead {
            self.discard_pooled(pool, name, cell, "it ended while it waited");
        }
        // The hand-out is the daemon at work: the refill waits for its quiet like after any
        // entry (the create's own are journaled later, after the exec's start for a run).
        self.pools_wait_for_quiet_since_now();
        self.fill_pool(index);
        taken
    }

    /// Puts back a cell taken for a create that failed before it was handed out.
    pub(crate) fn give_back_pooled(
        &self,
        policy: &warden_policy::Policy,
        name: String,
        cell: Arc<dyn Cell>,
    ) {
        let _ = std::fs::write(markers(&self.daemon_dir).join(&name), policy.tier.name());
        if let Some(pool) = self.pools.iter().find(|p| p.policy == *policy)
            && let Ok(mut state) = pool.state.lock()
        {
            state.taken = state.taken.saturating_sub(1);
            state.ready.push_front((name, cell));
        }
    }

    /// Marks a cell made ahead as being handed out, before its create goes into the journal:
    /// a daemon that stops before the cell is in its database leaves a marker that says so,
    /// and the next one journals the cell's end (see `start_pools`).
    pub(crate) fn handing_out(&self, name: &str) {
        let marker = markers(&self.daemon_dir).join(name);
        let _ = std::fs::OpenOptions::new()
            .append(true)
            .open(marker)
            .and_then(|mut file| std::io::Write::write_all(&mut file, HANDING_OUT.as_bytes()));
    }

    /// The marker of a cell made ahead goes once the cell is a cell of the daemon's like any.
    pub(crate) fn handed_out(&self, name: &str) {
        let _ = std::fs::remove_file(markers(&self.daemon_dir).join(name));
    }

    /// `handed_out`, on the remover's thread, off a create's way to its answer (a removal on
    /// this host's file system took 30-50 us there). A daemon that stops first leaves the
    /// marker of a cell in its database, which the next one removes (`start_pools`).
    pub(crate) fn handed_out_later(&self, name: &str) {
        self.remove_later(markers(&self.daemon_dir).join(name));
    }

    /// Makes cells for pool `index` on a task of its own until it has as many as it keeps.
    pub(crate) fn fill_pool(self: &Arc<Self>, index: usize) {
        let Some(pool) = self.pools.get(index) else {
            return;
        };
        {
            let Ok(mut state) = pool.state.lock() else {
                return;
            };
            if state.closed || state.ready.len() + state.making >= pool.spec.size {
                return;
            }
            state.making += 1;
        }
        let harness = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                let pool = &harness.pools[index];
                harness.quiet().await;
                // The daemon stops: nothing more is made.
                if pool.state.lock().is_ok_and(|s| s.closed) {
                    if let Ok(mut state) = pool.state.lock() {
                        state.making -= 1;
                    }
                    return;
                }
                let made = harness.make_pooled(pool).await;
                let Ok(mut state) = pool.state.lock() else {
                    return;
                };
                state.making -= 1;
                match made {
                    // Made while the daemon stops: its drain, which waits for what is being
                    // made, ends it with the rest.
                    Ok(cell) => {
                        state.error = None;
                        state.ready.push_back(cell);
                    }
                    // Tried again when the pool next serves a create (no busy retries).
                    Err(why) => {
                        state.error = Some(why);
                        return;
                    }
                }
                if state.closed || state.ready.len() + state.making >= pool.spec.size {
                    return;
                }
                state.making += 1;
            }
        });
    }

    /// Starts one cell for `pool`, with a name of its own and a marker that says it is the
    /// pool's; journaled as `pool.made` (or `pool.fail`).
    async fn make_pooled(self: &Arc<Self>, pool: &Pool) -> Result<(String, Arc<dyn Cell>), String> {
        let name = generate_name();
        let names = self.names().map_err(|e| e.to_string())?;
        if names.exists(&name) || matches!(self.state.get(&name), Ok(Some(_))) {
            return Err(format!("the name `{name}` it drew is taken"));
        }
        let cell_dir = self.daemon_dir.join("cells").join(&name);
        let marker = markers(&self.daemon_dir).join(&name);
        let made = std::fs::create_dir_all(&cell_dir)
            .and_then(|()| std::fs::create_dir_all(markers(&self.daemon_dir)))
            .and_then(|()| std::fs::write(&marker, pool.policy.tier.name()));
        if let Err(e) = made {
            return Err(format!(
                "making {} or {}: {e}",
                cell_dir.display(),
                marker.display()
            ));
        }
        let mut policy = pool.policy.clone();
        // The daemon applies the wall-clock limit itself, from the hand-out on.
        policy.limits.wall = None;
        let spec = CellSpec {
            name: name.clone(),
            policy,
            workspace: None,
            from: None,
            env: Vec::new(),
            report: Some(cell_dir.join(ENDING_FILE)),
            log: Some(cell_dir.join("keeper.log")),
            restore: None,
            secrets: Vec::new(),
        };
        let started = match self.backend(pool.policy.tier) {
            Ok(backend) => tokio::task::spawn_blocking(move || backend.start(spec))
                .await
                .map_err(|e| format!("starting the cell: {e}"))
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        match started {
            Ok(cell) => {
                let _ = self
                    .record(
                        None,
                        "pool.made",
                        json!({ "name": name, "pool": pool.spec.label, "pid": cell.pid() }),
                    )
                    .await;
                Ok((name, cell))
            }
            Err(why) => {
                let _ = std::fs::remove_file(&marker);
                let _ = std::fs::remove_dir_all(&cell_dir);
                if let Ok(backend) = self.backend(pool.policy.tier) {
                    let _ = backend.remove_layer(&name);
                }
                let _ = self
                    .record(
                        None,
                        "pool.fail",
                        json!({ "pool": pool.spec.label, "error": why }),
                    )
                    .await;
                Err(why)
            }
        }
    }

    /// Ends a cell made ahead that will not be handed out, and removes what it left.
    fn discard_pooled(self: &Arc<Self>, pool: &Pool, name: String, cell: Arc<dyn Cell>, why: &str) {
        let harness = Arc::clone(self);
        let tier = pool.policy.tier;
        let why = why.to_owned();
        tokio::spawn(async move {
            let gone = name.clone();
            let ended = on_own_thread(move || end_cell(&*cell)).await;
            harness.forget_pooled(&gone, tier);
            let _ = harness
                .record(
                    None,
                    "pool.drop",
                    json!({ "name": gone, "reason": why, "ended": ended.unwrap_or(false) }),
                )
                .await;
        });
    }

    /// Removes the layer, the daemon's folder and the marker of a cell made ahead.
    fn forget_pooled(&self, name: &str, tier: warden_policy::Tier) {
        if let Ok(backend) = self.backend(tier) {
            let _ = backend.remove_layer(name);
        }
        let _ = std::fs::remove_file(self.store.net_log_path(name));
        self.discard_folder(self.daemon_dir.join("cells").join(name));
        self.handed_out(name);
    }

    /// Ends the cells an earlier daemon made ahead and never handed out (their markers say
    /// which), then starts filling this daemon's pools.
    pub(crate) async fn start_pools(self: &Arc<Self>) -> Result<(), HarnessError> {
        let dir = markers(&self.daemon_dir);
        let left: Vec<(String, String)> = match std::fs::read_dir(&dir) {
            Ok(entries) => entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let marker = std::fs::read_to_string(e.path()).unwrap_or_default();
                    Some((name, marker))
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        for (name, marker) in left {
            // Handed out, and the daemon stopped before the marker went: a cell like any.
            if matches!(self.state.get(&name), Ok(Some(_))) {
                self.handed_out(&name);
                continue;
            }
            let handing = marker.ends_with(HANDING_OUT);
            let tier = marker.lines().next().unwrap_or_default();
            let tier = warden_policy::Tier::from_name(tier.trim()).unwrap_or_default();
            let adopted = self.backend(tier)?.adopt(&name).ok().flatten();
            let ended = match adopted {
                Some(cell) => on_own_thread(move || end_cell(&*cell))
                    .await
                    .unwrap_or(false),
                None => true,
            };
            self.forget_pooled(&name, tier);
            if handing {
                // What the database holds of it (its record's offset, questions, grants) goes
                // either way.
                let _ = self.state.forget(&name);
                // A run's cell whose delete is durable already: the daemon stopped before its
                // marker went, and the journal has said all there is.
                if self.journaled.deleted.contains(&name) {
                    continue;
                }
                // Its create (and maybe a command's start) may be in the journal, which then
                // has its end and delete too: the cell is gone. (A run's cell is never in the
                // database; a create's is once it was handed out.)
                let reason = "the daemon stopped while the cell was handed out or ran its run";
                self.record_ended_by_warden(&name, reason, ended).await?;
                continue;
            }
            self.record(
                None,
                "pool.drop",
                json!({ "name": name, "reason": "made ahead by an earlier daemon and never handed out", "ended": ended }),
            )
            .await?;
        }
        for index in 0..self.pools.len() {
            self.fill_pool(index);
        }
        Ok(())
    }

    /// Ends every cell the pools hold (the daemon stops; cells handed out stay).
    pub(crate) async fn drain_pools(self: &Arc<Self>) {
        // No more are made; those being made are waited for (bounded), then all are ended.
        for pool in &self.pools {
            if let Ok(mut state) = pool.state.lock() {
                state.closed = true;
            }
        }
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until
            && self
                .pools
                .iter()
                .any(|p| p.state.lock().is_ok_and(|s| s.making > 0))
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for pool in &self.pools {
            let ready: Vec<_> = match pool.state.lock() {
                Ok(mut state) => state.ready.drain(..).collect(),
                Err(_) => continue,
            };
            for (name, cell) in ready {
                let ended = on_own_thread(move || end_cell(&*cell))
                    .await
                    .unwrap_or(false);
                self.forget_pooled(&name, pool.policy.tier);
                let _ = self
                    .record(
                        None,
                        "pool.drop",
                        json!({ "name": name, "reason": "the daemon stopped", "ended": ended }),
                    )
                    .await;
            }
        }
    }
}

/// Kills a cell and waits (bounded) until its tier has let go of it; whether it did.
fn end_cell(cell: &dyn Cell) -> bool {
    let _ = cell.kill();
    cell.wait_ended()
}
