//! Cells of the harness: checks shared by create and `run_attached`, create through the tier,
//! the handle of each live cell, control (pause, resume, kill), delete, and taking back the
//! cells of an earlier daemon.

use super::*;

impl Harness {
    /// Takes back the cells of an earlier daemon: live ones are watched again, dead ones are
    /// marked ended (their keepers already removed what they held).
    pub(crate) async fn reconcile(
        self: &Arc<Self>,
        cut: Vec<(u64, Value)>,
    ) -> Result<(), HarnessError> {
        // Processes the old daemon was relaying: their output pipes went with it, so the
        // keeper killed them when the daemon's end of their exec connection closed.
        for (id, note) in cut {
            let cell = note["cell"].as_str().map(str::to_owned);
            self.record(
                cell.as_deref(),
                "exec.lost",
                json!({
                    "process": id,
                    "argv": note["argv"],
                    "start_seq": note["start_seq"],
                    "reason": "the daemon stopped while it ran; it was ended with the daemon's connection",
                }),
            )
            .await?;
        }
        let mut runs = Vec::new();
        for mut entry in self.state.all()? {
            if self.journaled.deleted.contains(&entry.name) {
                // Deleted, and answered, by a daemon that died before its database forgot the
                // cell: forgotten now, and what the cell left removed once its keeper is gone.
                self.finish_delete(&entry)?;
                continue;
            }
            if entry.run {
                // A run's cell: deleted below, as its run would have, once taken back.
                runs.push(entry.name.clone());
            }
            if entry.ended.is_some() {
                continue;
            }
            let tier = entry
                .tier
                .as_deref()
                .and_then(warden_policy::Tier::from_name)
                .unwrap_or_default();
            let adopted = self.backend(tier)?.adopt(&entry.name).map_err(|e| {
                HarnessError::from(CellFailure::Unavailable(format!(
                        "cannot tell whether cell `{}` still runs ({e}); start the daemon again once the host has descriptors and memory to spare",
                        entry.name,
                    )))
            })?;
            if let Some(cell) = adopted {
                if let Ok(mut cells) = self.cells.lock() {
                    cells.insert(entry.name.clone(), cell);
                }
                self.record(Some(&entry.name), "cell.reattach", json!({}))
                    .await?;
                let frozen = matches!(cell_status(self, &entry.name), Some(Status::Paused));
                if frozen
                    && !entry.paused
                    && let Some(cell) = self.cell(&entry.name)
                    && on_own_thread(move || cell.thaw()).await.is_ok()
                {
                    self.record(
                        Some(&entry.name),
                        "cell.resume",
                        json!({ "by": "the warden: a hold of its own (a diff or a snapshot under way) when the last daemon stopped" }),
                    )
                    .await?;
                }
                self.adopt(&entry);
                if let Ok(mut live) = self.live.lock()
                    && let Some(l) = live.get_mut(&entry.name)
                {
                    l.paused = entry.paused;
                }
                self.watch(entry.name.clone());
            } else {
                let reason = "ended while no daemon was running".to_owned();
                entry.ended = Some(reason.clone());
                self.state.put(&entry)?;
                self.record(Some(&entry.name), "cell.lost", json!({ "reason": reason }))
                    .await?;
            }
        }
        for name in runs {
            // One that cannot be deleted now stays a cell like any (listed, deletable): the
            // daemon starts all the same.
            let by = "the warden: the daemon of the cell's run stopped before the run ended";
            if let Err(err) = self.delete(&name, by).await {
                eprintln!("warden: note: cell `{name}` of a cut run is left: {err}");
            }
        }
        Ok(())
    }

    /// Ends the cells whose create a daemon journaled and started, and then stopped (killed)
    /// before it kept them: its folder of the cell is made after the create's entry is on
    /// disk and before the tier starts the cell, and the database takes the cell's entry once
    /// it runs; a folder with no entry (and no pool's marker, whose cells `start_pools` ends)
    /// is such a create's. Its keeper outlives the daemon, as every keeper does: a daemon
    /// killed during a create left the cell running, listed by no daemon, outside its limits
    /// the daemon applies (wall-clock, idle) and its name taken, for good. Called before
    /// `reconcile`, while every cell the database holds is still there to tell apart.
    pub(crate) async fn end_cut_creates(self: &Arc<Self>) -> Result<(), HarnessError> {
        let pooled: std::collections::HashSet<String> = names_in(&self.daemon_dir.join("pool"))
            .into_iter()
            .collect();
        // A keeper told its request before the kill may not have reserved or published its
        // cell yet, and goes on to start it: waited for first (every tier's keepers note
        // their starts in the registry they share, so one tier's look is every tier's).
        if let Ok(backend) = self.backend(warden_policy::Tier::Process) {
            let _ = on_own_thread(move || backend.settle_starts()).await;
        }
        for name in names_in(&self.daemon_dir.join("cells")) {
            if pooled.contains(&name) || !matches!(self.state.get(&name), Ok(None)) {
                continue;
            }
            // Whichever tier made it (every tier's cells share one registry).
            let mut found = None;
            for tier in warden_policy::Tier::ALL {
                let Ok(backend) = self.backend(tier) else {
                    continue;
                };
                if let Ok(Some(cell)) = backend.adopt(&name) {
                    found = Some((backend, cell));
                    break;
                }
            }
            let Some((backend, cell)) = found else {
                // Nothing of it runs (its start failed, or never began): what it left goes.
                self.remove_remains(&name, self.backend(warden_policy::Tier::Process).ok());
                continue;
            };
            let ended = on_own_thread(move || {
                let _ = cell.kill();
                cell.wait_ended()
            })
            .await
            .unwrap_or(false);
            self.remove_remains(&name, Some(backend));
            self.record_ended_by_warden(&name, "the daemon stopped while it made the cell", ended)
                .await?;
        }
        Ok(())
    }

    /// Journals the end and the delete of a cell the warden ended itself, for `reason`.
    pub(crate) async fn record_ended_by_warden(
        &self,
        name: &str,
        reason: &str,
        ended: bool,
    ) -> Result<(), HarnessError> {
        self.record(
            Some(name),
            "cell.end",
            json!({ "reason": reason, "ended": ended }),
        )
        .await?;
        self.record(
            Some(name),
            "cell.delete",
            json!({ "by": format!("the warden: {reason}") }),
        )
        .await?;
        Ok(())
    }

    /// The rest of a delete that a daemon answered and then died: the database forgets the
    /// cell, and its layer, egress record and folder go once its keeper (if it still takes
    /// the killed cell down) is gone.
    fn finish_delete(self: &Arc<Self>, entry: &CellEntry) -> Result<(), HarnessError> {
        let name = entry.name.clone();
        let tier = entry
            .tier
            .as_deref()
            .and_then(warden_policy::Tier::from_name)
            .unwrap_or_default();
        self.state.forget(&name)?;
        // A create of its name waits until its remains are gone, as after any delete.
        if let Ok(mut killing) = self.killing.lock() {
            killing.insert(name.clone());
        }
        let backend = self.backend(tier).ok();
        let cell = backend.as_ref().and_then(|b| b.adopt(&name).ok().flatten());
        let harness = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            if let Some(cell) = cell {
                // Its processes were killed before the delete was answered.
                let _ = cell.kill();
                cell.wait_ended();
            }
            harness.remove_remains(&name, backend);
            harness.done_killing(&name);
        });
        Ok(())
    }

    /// Starts supervising a live cell: its policy (for limits and approvals), and the secrets
    /// of its credentials, which must never reach the journal.
    pub(crate) fn adopt(&self, entry: &CellEntry) {
        if let Some(policy) = entry.policy_in_force() {
            self.adopt_with(entry, policy);
        }
    }

    /// Supervises a live cell whose policy in force is `policy`.
    pub(crate) fn adopt_with(&self, entry: &CellEntry, policy: warden_policy::Policy) {
        if let Ok(secrets) = warden_egress::Secrets::load(&policy.credentials) {
            self.journal
                .add_redactions(secrets.all.iter().map(|s| s.value.clone()));
        }
        if let Ok(mut live) = self.live.lock() {
            live.insert(entry.name.clone(), Live::new(policy));
        }
    }

    /// How the cell ended, as its keeper wrote it before letting go of the cell (`None` while
    /// it runs, or when the keeper died first).
    pub(crate) fn ending_of(&self, name: &str) -> Option<Value> {
        let path = self.daemon_dir.join("cells").join(name).join(ENDING_FILE);
        std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
    }

    /// Whether the daemon noted a kill of the cell.
    pub(crate) fn kill_requested(&self, name: &str) -> bool {
        self.daemon_dir
            .join("cells")
            .join(name)
            .join("killed")
            .exists()
    }

    pub(crate) fn entry(&self, name: &str) -> Result<CellEntry, HarnessError> {
        // A run's cell from a pool (kept in memory only, for its run's life).
        let handing = self
            .handing
            .lock()
            .ok()
            .and_then(|handing| handing.get(name).cloned());
        match handing {
            Some(entry) => Ok(entry),
            None => self
                .state
                .get(name)?
                .ok_or_else(|| HarnessError::not_found(name)),
        }
    }

    /// Changes cell `name`'s entry where it is kept (a run's cell from a pool: in memory;
    /// any other: in the database) if it has one and `change` says it changed it: whether it
    /// did.
    pub(crate) fn update_entry(
        &self,
        name: &str,
        change: impl FnOnce(&mut CellEntry) -> bool,
    ) -> Result<bool, HarnessError> {
        if let Ok(mut runs) = self.handing.lock()
            && let Some(entry) = runs.get_mut(name)
        {
            return Ok(change(entry));
        }
        let Some(mut entry) = self.state.get(name)? else {
            return Ok(false);
        };
        if !change(&mut entry) {
            return Ok(false);
        }
        self.state.put(&entry).map(|()| true)
    }

    /// The handle of a live cell of this daemon's.
    pub(crate) fn cell(&self, name: &str) -> Option<Arc<dyn Cell>> {
        self.cells.lock().ok()?.get(name).cloned()
    }

    pub(crate) fn info(&self, entry: &CellEntry) -> CellInfo {
        let cell = if entry.ended.is_none() {
            self.cell(&entry.name)
        } else {
            None
        };
        let state = match cell.as_ref().map(|c| c.status()) {
            Some(Ok(Status::Paused)) => CellState::Paused,
            Some(Ok(Status::Running) | Err(_)) => CellState::Running,
            Some(Ok(Status::Ended)) | None => CellState::Ended,
        };
        let processes = self
            .processes
            .lock()
            .map(|p| p.get(&entry.name).map_or(0, Vec::len))
            .unwrap_or(0);
        CellInfo {
            name: entry.name.clone(),
            state,
            pid: cell
                .as_ref()
                .filter(|_| state != CellState::Ended)
                .and_then(|c| c.pid()),
            created_ms: entry.created_ms,
            workspace: entry.workspace.clone(),
            labels: entry.labels.clone(),
            ended: entry
                .ended
                .clone()
                .or_else(|| (state == CellState::Ended).then(|| "its processes ended".to_owned())),
            processes,
            tier: entry
                .tier
                .clone()
                .unwrap_or_else(|| warden_policy::Tier::Process.name().to_owned()),
            preset: entry.preset.clone().or_else(|| match &entry.policy {
                PolicySource::Preset(p) => Some(p.clone()),
                PolicySource::Yaml(_) => None,
            }),
        }
    }

    pub fn list(&self) -> Result<Vec<CellInfo>, HarnessError> {
        let mut all = self.state.all()?;
        if let Ok(runs) = self.handing.lock() {
            let kept: std::collections::HashSet<String> =
                all.iter().map(|e| e.name.clone()).collect();
            all.extend(runs.values().filter(|e| !kept.contains(&e.name)).cloned());
        }
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all.iter().map(|e| self.info(e)).collect())
    }

    pub fn get(&self, name: &str) -> Result<CellInfo, HarnessError> {
        Ok(self.info(&self.entry(name)?))
    }

    /// Makes a cell and waits until it takes execs.
    pub async fn create(self: &Arc<Self>, request: CreateCell) -> Result<CellInfo, HarnessError> {
        self.create_with(request, false).await.map(|(info, _)| info)
    }

    /// A create; `run`: for a run (`run_once`), whose cell is marked so in its entry, and
    /// which, for a cell taken from a pool (its entry kept in memory only, see `keep_behind`),
    /// is answered once the cell's entries are in the journal's file, with the round that
    /// makes them durable handed back to be waited for (the run's exec, whose start is
    /// journaled after them, waits for that round or a later one before anything of its
    /// command is told); otherwise `None`, as for any other cell,
    /// whose entries are durable when this returns.
    pub(crate) async fn create_with(
        self: &Arc<Self>,
        request: CreateCell,
        run: bool,
    ) -> Result<(CellInfo, Option<crate::once::Handing>), HarnessError> {
        let (request, restore) = self.restoring(request)?;
        // Held to the answer: two creates of one name at once both passed the name's checks,
        // and the second wiped the first's folder and failed in its keeper (a 400).
        let _creating = match &request.name {
            Some(name) => Some(Creating::hold(&self.creating, name)?),
            None => None,
        };
        let Prepared {
            mut name,
            parsed,
            from,
            mut entry,
        } = self.prepare(&request, None).await?;
        entry.run = run;
        // A cell made ahead, where the request asks for nothing a cell is started with.
        let poolable = request.name.is_none()
            && request.workspace.is_none()
            && from.is_none()
            && restore.is_none()
            && request.env.is_empty()
            && request.secrets.is_empty();
        let pooled = match poolable {
            true => self.take_pooled(&parsed),
            false => None,
        };
        if let Some((pooled_name, _)) = &pooled {
            name.clone_from(pooled_name);
            entry.name.clone_from(pooled_name);
        }
        let mut created = create_entry(&entry, &request, &from);
        created["pooled"] = json!(pooled.is_some());
        if let Some((pooled_name, cell)) = pooled {
            // It runs already: its create and its start go into the journal's file, and to
            // the disk (one round) while the database takes its entry. A run's take no round
            // of their own: they go with its command's start, and its entry stays in memory
            // (see `keep_behind` and `once::Handing`).
            self.handing_out(&name);
            let started = json!({ "pid": cell.pid() });
            let entries = [("cell.create", created), ("cell.start", started)];
            let urgency = match run {
                true => warden_journal::Urgency::Soon,
                false => warden_journal::Urgency::Waited,
            };
            let written = match self.record_all_ahead(&name, entries.into(), urgency) {
                Ok(written) => written,
                // Not handed out: the pool keeps it for the next create.
                Err(err) => {
                    self.give_back_pooled(&parsed, pooled_name, cell);
                    return Err(err);
                }
            };
            if run {
                let info = self.keep_behind(entry, parsed, cell);
                return Ok((info, Some(crate::once::Handing::new(written))));
            }
            let kept = self.keep(entry, parsed, cell);
            written.wait(self).await?;
            return kept.map(|info| (info, None));
        }
        self.record(Some(&name), "cell.create", created).await?;
        let cell_dir = self.daemon_dir.join("cells").join(&name);
        let _ = std::fs::remove_dir_all(&cell_dir);
        std::fs::create_dir_all(&cell_dir).map_err(|e| {
            HarnessError::from(CellFailure::Core(format!(
                "creating {}: {e}",
                cell_dir.display()
            )))
        })?;
        let mut spec_policy = parsed.clone();
        // The daemon applies the wall-clock limit itself (with the policy's `on_wall`).
        spec_policy.limits.wall = None;
        let spec = CellSpec {
            name: name.clone(),
            policy: spec_policy,
            workspace: if from.is_some() {
                None
            } else {
                request.workspace.as_ref().map(PathBuf::from)
            },
            from: from.clone(),
            env: request.env.clone().into_iter().collect(),
            report: Some(cell_dir.join(ENDING_FILE)),
            log: Some(cell_dir.join("keeper.log")),
            restore,
            secrets: request.secrets.clone().into_iter().collect(),
        };
        let backend = self.backend(parsed.tier)?;
        let started = tokio::task::spawn_blocking(move || backend.start(spec))
            .await
            .map_err(|e| {
                HarnessError::from(CreateError::Failed(format!("starting the cell: {e}")))
            })?;
        // A fork whose snapshot a removal took meanwhile (after the check above, before its
        // layer was made on it): told as the snapshot gone, a 404, not as the tier's refusal of
        // a bad request.
        let gone = |message: &str| {
            let id = from.as_deref()?;
            warden_cell::snapshot::get(&self.store, id).is_err().then(|| {
                HarnessError::from(CreateError::NoSource(format!(
                    "snapshot `{id}` was removed while cell `{name}` was being made from it ({message}); nothing was made: fork from a snapshot `warden snapshots` lists"
                )))
            })
        };
        let cell = match started {
            Ok(cell) => cell,
            Err(StartError::Refused(message)) => {
                self.record(Some(&name), "cell.fail", json!({ "error": message }))
                    .await?;
                if let Some(gone) = gone(&message) {
                    return Err(gone);
                }
                return Err(HarnessError::from(CreateError::Refused(format!(
                    "cell `{name}` could not start: {message}"
                ))));
            }
            Err(err @ StartError::TimedOut(_)) => {
                return Err(HarnessError::from(CreateError::Failed(err.to_string())));
            }
            Err(StartError::Host(message)) => {
                self.record(Some(&name), "cell.fail", json!({ "error": message }))
                    .await?;
                if let Some(gone) = gone(&message) {
                    return Err(gone);
                }
                return Err(HarnessError::from(CreateError::Unavailable(format!(
                    "cell `{name}` could not start: {message}"
                ))));
            }
        };
        self.started(entry, parsed, cell)
            .await
            .map(|info| (info, None))
    }

    /// A cell that takes execs becomes one of the daemon's: kept, supervised, watched; its
    /// start journaled.
    async fn started(
        self: &Arc<Self>,
        entry: CellEntry,
        parsed: warden_policy::Policy,
        cell: Arc<dyn Cell>,
    ) -> Result<CellInfo, HarnessError> {
        let name = entry.name.clone();
        let pid = cell.pid();
        let info = self.keep(entry, parsed, cell)?;
        self.record(Some(&name), "cell.start", json!({ "pid": pid }))
            .await?;
        Ok(info)
    }

    /// Keeps a running cell as one of the daemon's: its handle, its entry (a record of an
    /// earlier cell of its name is gone with that one: copying starts over), supervision and a
    /// watch.
    fn keep(
        self: &Arc<Self>,
        entry: CellEntry,
        parsed: warden_policy::Policy,
        cell: Arc<dyn Cell>,
    ) -> Result<CellInfo, HarnessError> {
        let name = entry.name.clone();
        self.forget_earlier(&name)?;
        if let Ok(mut cells) = self.cells.lock() {
            cells.insert(name.clone(), cell);
        }
        self.state.put_new(&entry)?;
        self.handed_out_later(&name);
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.insert(name.clone(), Arc::new(tokio::sync::Mutex::new(0)));
        }
        self.adopt_with(&entry, parsed);
        self.watch(name);
        Ok(self.info(&entry))
    }

    /// What the daemon still holds of an earlier cell of this name (one that ended and was
    /// not deleted, or one deleted whose questions outlived it) goes before a new cell takes
    /// the name: a new cell is not the old one, and starts with none of its processes, its
    /// commands held for approval (approved later, one ran in the new cell: the cell's handle
    /// asks its keeper by name) or its standing grants of scope `cell` (they answered the new
    /// cell's questions).
    fn forget_earlier(&self, name: &str) -> Result<(), HarnessError> {
        if let Ok(mut processes) = self.processes.lock() {
            processes.remove(name);
        }
        if let Ok(mut walled) = self.walled.lock() {
            walled.remove(name);
        }
        self.drop_exec_questions(name);
        let granted = self.grants.lock().is_ok_and(|mut grants| {
            let before = grants.len();
            grants.retain(|g| g.cell.as_deref() != Some(name));
            grants.len() != before
        });
        if granted {
            self.state.forget_grants_of(name)?;
        }
        Ok(())
    }

    /// Drops the commands of cell `name` held for a person's approval: each waiting exec is
    /// refused (its cell ended or was deleted), and the question is no longer listed.
    pub(crate) fn drop_exec_questions(&self, name: &str) {
        let dropped: Vec<_> = match self.exec_questions.lock() {
            Ok(mut questions) => {
                let keys: Vec<_> = questions
                    .keys()
                    .filter(|(cell, _)| cell == name)
                    .cloned()
                    .collect();
                keys.into_iter()
                    .filter_map(|key| questions.remove(&key))
                    .collect()
            }
            Err(_) => Vec::new(),
        };
        drop(dropped);
    }

    /// `keep` for a run's cell from a pool: its entry is kept in memory only, for the run's
    /// life (a run's cell lives for one call), with no commit of the database and no flush of
    /// the disk beside the command's start. Its pool marker says it is being handed out until
    /// its delete is durable: a daemon that stops meanwhile leaves the marker, and the next one
    /// ends the cell and journals its end and delete (`start_pools`).
    fn keep_behind(
        self: &Arc<Self>,
        entry: CellEntry,
        parsed: warden_policy::Policy,
        cell: Arc<dyn Cell>,
    ) -> CellInfo {
        let name = entry.name.clone();
        let _ = self.forget_earlier(&name);
        if let Ok(mut cells) = self.cells.lock() {
            cells.insert(name.clone(), cell);
        }
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.insert(name.clone(), Arc::new(tokio::sync::Mutex::new(0)));
        }
        self.adopt_with(&entry, parsed);
        let info = self.info(&entry);
        if let Ok(mut handing) = self.handing.lock() {
            handing.insert(name.clone(), entry);
        }
        self.watch(name);
        info
    }

    /// Checks a request for a cell (name, policy, environment, secrets, workspace, that no cell
    /// has its name), and takes the snapshot it forks from: everything before the journal's
    /// `cell.create`, the same for a cell of the daemon and for `warden run` without one.
    /// Checks a create request and makes its entry. `parsed`: the request's policy text, parsed
    /// already by an in-process caller (not parsed twice).
    pub(crate) async fn prepare(
        self: &Arc<Self>,
        request: &CreateCell,
        mut parsed: Option<warden_policy::Policy>,
    ) -> Result<Prepared, HarnessError> {
        let name = match &request.name {
            Some(name) => name.clone(),
            None => generate_name(),
        };
        self.names()?
            .check_name(&name)
            .map_err(|e| HarnessError::from(CreateError::Invalid(e.to_string())))?;
        // A cell of this name was just deleted: what it left goes within moments.
        let until = Instant::now() + Duration::from_secs(10);
        while self.killing.lock().is_ok_and(|k| k.contains(&name)) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let handed = parsed.is_some();
        let (policy, parsed) = match (&request.policy, &request.preset) {
            (Some(_), Some(_)) => {
                return Err(HarnessError::from(CreateError::Invalid(
                    "give either `policy` (YAML text) or `preset`, not both".into(),
                )));
            }
            (Some(yaml), None) => (
                PolicySource::Yaml(yaml.clone()),
                match parsed.take() {
                    Some(parsed) => parsed,
                    None => warden_policy::from_yaml("policy", yaml)
                        .map_err(|e| HarnessError::from(CreateError::Invalid(e.to_string())))?,
                },
            ),
            (None, preset) => {
                let preset = preset.clone().unwrap_or_else(|| "default".to_owned());
                let parsed = match parsed.take() {
                    Some(parsed) => parsed,
                    None => warden_policy::preset(&preset)
                        .map_err(|e| HarnessError::from(CreateError::Invalid(e.to_string())))?,
                };
                (PolicySource::Preset(preset), parsed)
            }
        };
        // A NUL in a value cannot reach a process's environment: the cell would be made, and
        // every command in it would then fail to start.
        for (key, value) in &request.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(HarnessError::from(CreateError::Invalid(format!(
                    "environment variable `{}`: the name must be non-empty without `=`, and \
                     neither the name nor the value may contain NUL; nothing was made",
                    key.escape_debug()
                ))));
            }
        }
        for (key, value) in &request.labels {
            if key.is_empty() || key.contains(char::is_control) || value.contains('\0') {
                return Err(HarnessError::from(CreateError::Invalid(format!(
                    "label `{}`: a label's key must be non-empty without control characters \
                     (NUL, newline, tab), and its value may not contain NUL; nothing was made",
                    key.escape_debug()
                ))));
            }
        }
        // Secrets only for the variables the policy's credentials read.
        let wanted: Vec<&str> = parsed
            .credentials
            .values()
            .filter_map(|c| c.from_env.as_deref())
            .collect();
        if let Some(extra) = request
            .secrets
            .keys()
            .find(|k| !wanted.contains(&k.as_str()))
        {
            return Err(HarnessError::from(CreateError::Invalid(format!(
                "secrets: `{extra}` is not read by any credential of the policy (their from_env: {})",
                if wanted.is_empty() {
                    "none".to_owned()
                } else {
                    wanted.join(", ")
                }
            ))));
        }
        self.journal
            .add_redactions(request.secrets.values().cloned());
        if let Some(dir) = &request.workspace
            && !Path::new(dir).is_dir()
        {
            return Err(HarnessError::from(CreateError::Invalid(format!(
                "workspace {dir} does not exist or is not a directory on the host; create it or pass another"
            ))));
        }
        let exists = self.names()?.exists(&name);
        if let Some(old) = self.state.get(&name)?
            && (old.ended.is_none() || exists)
        {
            return Err(HarnessError::from(CreateError::NameTaken(format!(
                "a cell named `{name}` exists; delete it first or pick another name"
            ))));
        }
        if exists {
            return Err(HarnessError::from(CreateError::NameTaken(format!(
                "a cell named `{name}` is already running; pick another name or stop it with `warden kill {name}`"
            ))));
        }
        // A fork starts from a snapshot; of a cell, one is taken now.
        let from = match &request.from {
            Some(source) if source.contains('@') => Some(source.clone()),
            Some(source) => Some(self.snapshot(source, None).await?.id),
            None => None,
        };
        let workspace = match &from {
            Some(id) => Some(
                warden_cell::snapshot::get(&self.store, id)
                    .map_err(|e| HarnessError::from(CreateError::NoSource(e.to_string())))?
                    .lower
                    .display()
                    .to_string(),
            ),
            None => request.workspace.clone(),
        };
        let entry = CellEntry {
            run: false,
            paused: false,
            name: name.clone(),
            created_ms: now_ms(),
            policy: policy.clone(),
            workspace,
            labels: request.labels.clone(),
            env: request.env.clone(),
            ended: None,
            replaced: None,
            tier: Some(parsed.tier.name().to_owned()),
            preset: match &policy {
                PolicySource::Preset(p) => Some(p.clone()),
                // The text is the caller's policy written out: it extends what the policy
                // says it extends, without a second reading.
                PolicySource::Yaml(_) if handed => parsed.extends.clone(),
                PolicySource::Yaml(y) => warden_policy::extended_preset(y),
            },
        };
        Ok(Prepared {
            name,
            parsed,
            from,
            entry,
        })
    }

    pub(crate) fn live(&self, name: &str) -> Result<Arc<dyn Cell>, HarnessError> {
        self.live_with_status(name).map(|(cell, _)| cell)
    }

    /// The handle of a live cell, with its status as its tier says it now (running or paused;
    /// running when that cannot be told).
    pub(crate) fn live_with_status(
        &self,
        name: &str,
    ) -> Result<(Arc<dyn Cell>, Status), HarnessError> {
        let entry = self.entry(name)?;
        if entry.ended.is_some() {
            return Err(HarnessError::from(CellFailure::Ended(format!(
                "cell `{name}` has ended ({}); delete it and create a new one",
                entry.ended.unwrap_or_default()
            ))));
        }
        let ended = || HarnessError::from(CellFailure::Ended(format!("cell `{name}` has ended")));
        let cell = self.cell(name).ok_or_else(ended)?;
        match cell.status() {
            Ok(Status::Ended) => Err(ended()),
            Ok(status) => Ok((cell, status)),
            Err(_) => Ok((cell, Status::Running)),
        }
    }

    /// Freezes, thaws or kills a cell, from outside.
    pub async fn control(
        &self,
        name: &str,
        action: ControlAction,
        by: &str,
    ) -> Result<CellInfo, HarnessError> {
        self.control_with(name, action, by, false, None).await?;
        self.get(name)
    }

    /// `control`; with `deleting`, the end of a kill is neither noted in the entry nor
    /// journaled here: the caller, which removes the entry next, journals it with its own
    /// entries (`true`: the cell ended by this kill). With `follow` (a delete's kill, its
    /// harness), those are the cell's end and delete, written to the journal's file as soon as
    /// the signal is out, on the kill's own thread, and they come back with the kill's entry,
    /// which then takes no round of its own (theirs makes it durable), for the delete to wait
    /// on.
    async fn control_with(
        &self,
        name: &str,
        action: ControlAction,
        by: &str,
        deleting: bool,
        follow: Option<Arc<Harness>>,
    ) -> Result<Killed, HarnessError> {
        let cell = self.live(name)?;
        let follow = follow.filter(|_| deleting && action == ControlAction::Kill);
        // In the journal's file before the action (a crash of the warden cannot lose it), on
        // the disk before it is acknowledged: the sync overlaps the action.
        // (A delete's: its kill's thread leads the round, below.)
        let urgency = match follow {
            Some(_) => warden_journal::Urgency::Led,
            None => warden_journal::Urgency::Waited,
        };
        let kind = format!("cell.{}", action.name());
        let submitted = {
            // A control that comes once a delete of the cell is under way (which kills it and
            // journals its end and delete) is refused, its entry never written: looked at and
            // submitted under the lock the delete takes to say so, its entry is either before
            // the delete's or not at all. (A kill's entry came after the cell's delete in the
            // journal now and then.)
            let killing = self
                .killing
                .lock()
                .map_err(|_| HarnessError::internal("a thread panicked"))?;
            if !deleting && killing.contains(name) {
                return Err(HarnessError::from(CellFailure::Ended(format!(
                    "cell `{name}` is being deleted"
                ))));
            }
            self.submit_written(Some(name), &kind, json!({ "by": by }), urgency)
        };
        let asked = submitted.written().await?;
        if let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.paused = action == ControlAction::Pause;
            if action == ControlAction::Resume {
                l.idle_paused = false;
                l.last_activity = Instant::now();
            }
        }
        // The daemon's own note of a kill (for a later daemon that finds the end), written once
        // the signal is out: the watch that sees the end also reads the keeper's word for it.
        let marker = (action == ControlAction::Kill)
            .then(|| self.daemon_dir.join("cells").join(name).join("killed"));
        let handle = Arc::clone(&cell);
        let follow = follow.map(|harness| (harness, name.to_owned(), by.to_owned()));
        let (result, written) = on_own_thread(move || match action {
            ControlAction::Pause => (handle.freeze(), None),
            ControlAction::Resume => (handle.thaw(), None),
            ControlAction::Kill => {
                let killed = handle.kill();
                let mut written = match (&killed, &follow) {
                    (Ok(()) | Err(CellError::Ended(_)), Some((harness, name, by))) => {
                        Some(harness.write_end_and_delete(
                            name,
                            by,
                            "killed",
                            warden_journal::Urgency::Led,
                        ))
                    }
                    _ => None,
                };
                if let Some(marker) = marker {
                    // A second name for the keeper's log beside it: no new inode.
                    let _ = warden_workspace::note(&marker, &marker.with_file_name("keeper.log"));
                }
                // A delete's entries (the kill's, the end's and the delete's, all submitted
                // led) go to the disk in a round run here where none is under way: the
                // journal's syncer is not woken for them, nor is the delete by it.
                if let Some((harness, ..)) = &follow {
                    match &mut written {
                        Some(Ok((_, durable))) => durable.lead(harness),
                        _ => harness.journal.lead(),
                    }
                }
                (killed, written)
            }
        })
        .await?;
        let written = written.transpose()?;
        // A delete's kill is acknowledged with the delete, whose own entries are on the disk
        // after this one (one file, synced in order; a failed sync stops the journal): the
        // delete waits for both at once, rather than for this one before it goes on.
        let asked = match (deleting, &result) {
            (true, Ok(()) | Err(CellError::Ended(_))) => Some(asked),
            _ => {
                asked.wait(self).await?;
                None
            }
        };
        match result {
            Ok(()) => {}
            // A cell that ended on its own between the check and the kill is what a kill wants.
            Err(CellError::Ended(_)) if action == ControlAction::Kill => {}
            Err(err) => {
                return Err(HarnessError::from(ControlError::Refused(err.to_string())));
            }
        }
        if action != ControlAction::Kill {
            self.update_entry(name, |entry| {
                entry.paused = action == ControlAction::Pause;
                true
            })?;
        }
        if action == ControlAction::Kill && deleting {
            // Its processes are killed; the delete waits for the tier to let go of it where it
            // must (see `delete_now`).
            let (killed, written) = match written {
                Some((killed, written)) => (killed, Some(written)),
                None => (self.unended(name), None),
            };
            return Ok(Killed {
                killed,
                asked,
                written,
            });
        }
        if action == ControlAction::Kill {
            on_own_thread(move || cell.wait_ended()).await?;
            if self.mark_ended(name, "killed")? {
                self.record(Some(name), "cell.end", json!({ "reason": "killed" }))
                    .await?;
            }
        }
        Ok(Killed {
            killed: false,
            asked,
            written: None,
        })
    }

    /// A deleted cell's end, for `reason` (where it had not ended yet: then `true`), and
    /// delete, written to the journal's file (its round started): from the thread that sent
    /// the kill, or for a cell that ends by itself.
    fn write_end_and_delete(
        &self,
        name: &str,
        by: &str,
        reason: &str,
        urgency: warden_journal::Urgency,
    ) -> Result<(bool, crate::record::DurableAll), HarnessError> {
        let killed = self.unended(name);
        let mut entries = Vec::new();
        if killed {
            entries.push(("cell.end", json!({ "reason": reason })));
        }
        entries.push(("cell.delete", json!({ "by": by })));
        Ok((killed, self.record_all_ahead(name, entries, urgency)?))
    }

    /// Marks cell `name` ended for `reason` unless it is already, or a delete of it is under
    /// way (the delete journals its end): whether this call did (and so journals the end). The
    /// look and the mark are one step, and a delete's look at whether the cell ended is taken
    /// under the same lock (`write_end_and_delete`, `control_with`), so that a cell whose end
    /// two see at once (a kill, the watch, a delete) is ended, and journaled, once.
    pub(crate) fn mark_ended(&self, name: &str, reason: &str) -> Result<bool, HarnessError> {
        self.mark_ended_of(name, reason, None)
    }

    /// `mark_ended`, where the entry is the one made at `created` (ms), if given: a later cell
    /// of the name is not marked.
    pub(crate) fn mark_ended_of(
        &self,
        name: &str,
        reason: &str,
        created: Option<u64>,
    ) -> Result<bool, HarnessError> {
        let _one = self
            .ends
            .lock()
            .map_err(|_| HarnessError::internal("a thread panicked"))?;
        if self.killing.lock().is_ok_and(|k| k.contains(name)) {
            return Ok(false);
        }
        self.update_entry(name, |entry| {
            let unended = entry.ended.is_none() && created.is_none_or(|c| c == entry.created_ms);
            if unended {
                entry.ended = Some(reason.to_owned());
            }
            unended
        })
    }

    /// Whether cell `name` has an entry not marked ended, looked at under the lock `mark_ended`
    /// takes (a delete's look: a kill or watch that marks the end first journals it).
    fn unended(&self, name: &str) -> bool {
        let _one = self.ends.lock();
        self.entry(name).is_ok_and(|e| e.ended.is_none())
    }

    /// Kills the cell if it runs and forgets it: its workspace layer and egress record go too.
    /// It answers once no process of the cell can run any more and its end and delete are in
    /// the journal on disk; a keeper that still takes down the cell's cgroups and files then
    /// ends behind the answer, and a create of the same name waits for it.
    pub async fn delete(self: &Arc<Self>, name: &str, by: &str) -> Result<(), HarnessError> {
        self.delete_with(name, by, None).await
    }

    /// `delete`; `ending`: the cell ends by itself (a run's, whose last process has ended), for
    /// that reason: it is not killed, its end is journaled with that reason, and the answer
    /// waits for its end as for a kill's.
    pub(crate) async fn delete_with(
        self: &Arc<Self>,
        name: &str,
        by: &str,
        ending: Option<&str>,
    ) -> Result<(), HarnessError> {
        // The watch of the cell leaves its end to this delete, which journals it; a create of
        // the same name waits until the delete is done.
        if let Ok(mut killing) = self.killing.lock() {
            killing.insert(name.to_owned());
        }
        match self.delete_now(name, by, ending).await {
            Ok(Some((gone, tier))) => {
                let harness = Arc::clone(self);
                let name = name.to_owned();
                tokio::spawn(async move {
                    let _ = gone.await;
                    // A run's cell's pool marker, its delete durable and answered (a daemon
                    // that stops first finds the delete in the journal's tail: see
                    // `start_pools`).
                    harness.handed_out(&name);
                    // The database's commit of the forgetting, off the answer's path.
                    let _ = harness.state.forget_pending(&name);
                    harness.remove_layer_and_record(&name, tier);
                    harness.done_killing(&name);
                });
                Ok(())
            }
            deleted => {
                if deleted.is_ok() {
                    self.handed_out(name);
                }
                self.done_killing(name);
                deleted.map(drop)
            }
        }
    }

    /// The delete's work; where its tier still lets go of the cell once it answers, the wait
    /// for that and the tier, whose leftovers of the cell (its layer, record and folder) go
    /// after it.
    async fn delete_now(
        self: &Arc<Self>,
        name: &str,
        by: &str,
        ending: Option<&str>,
    ) -> Result<Option<(tokio::task::JoinHandle<()>, Option<Arc<dyn Backend>>)>, HarnessError> {
        let entry = self.entry(name)?;
        let live = self.cell(name);
        let tier = self.backend_of(name).ok();
        // A cell that ends by itself (a run's, `ending`: never one with a workspace), or that
        // ended by itself before its watch's next look (which would journal its end): not
        // killed, its end journaled with why (one with a workspace: before its changes,
        // below), and waited for as a killed cell is.
        let unended = entry.ended.is_none() && live.is_some();
        // (Looked at only where it decides.)
        let is_live =
            !(unended && ending.is_some()) && entry.ended.is_none() && self.live(name).is_ok();
        let mut own_end = match (ending, is_live) {
            _ if !unended => None,
            (Some(reason), _) => Some(reason.to_owned()),
            (None, false) => Some(self.end_reason(name).0),
            (None, true) => None,
        };
        let mut kill_outcome = None;
        // A cell without a workspace is deleted once no process of it runs, before its tier
        // has let go of it: its tier's teardown is held until this delete has answered (let
        // go of as this returns), so that it does not share the CPUs with the answer.
        let _teardown = (is_live && own_end.is_none() && entry.workspace.is_none())
            .then(|| live.as_ref().and_then(|cell| cell.hold_teardown()))
            .flatten();
        if is_live && own_end.is_none() {
            // A cell without a workspace has its end and delete written as soon as the signal
            // is out; one with a workspace lists its changes first.
            let follow = entry.workspace.is_none().then(|| Arc::clone(self));
            match self
                .control_with(name, ControlAction::Kill, by, true, follow)
                .await
            {
                Ok(killed) => kill_outcome = Some(killed),
                // It ended between the look above and the kill's own (its last process, or a
                // kill of another's): deleted as a cell that had ended, its end journaled once.
                Err(err) if err.reason == "cell-ended" && unended => {
                    own_end = Some(self.end_reason(name).0);
                }
                Err(err) => return Err(err),
            }
        }
        let Killed {
            killed,
            asked,
            written,
        } = match (&own_end, kill_outcome) {
            (_, Some(killed)) => killed,
            (Some(reason), None) if entry.workspace.is_none() => {
                let (killed, written) =
                    self.write_end_and_delete(name, by, reason, warden_journal::Urgency::Waited)?;
                Killed {
                    killed,
                    asked: None,
                    written: Some(written),
                }
            }
            _ => Killed {
                killed: false,
                asked: None,
                written: None,
            },
        };
        // (A run's: one whose tier said it would end by itself.)
        let ends_itself = ending.is_some() && own_end.is_some();
        // Until no process of it runs, then until its tier has let go of it (its keeper ends
        // once its cgroups and files are gone).
        let (stopped, gone) = match (killed, live) {
            (true, Some(cell)) => {
                let (tx, stopped) = tokio::sync::oneshot::channel();
                let harness = Arc::clone(self);
                let cell_name = name.to_owned();
                let gone = tokio::task::spawn_blocking(move || {
                    let mut stopped = cell.wait_stopped();
                    if !stopped && ends_itself {
                        // It did not end with its last process, as its tier said it would:
                        // killed now (and journaled so), before the delete answers.
                        let _ = harness.record_all_ahead(
                            &cell_name,
                            vec![(
                                "cell.kill",
                                json!({ "by": "the warden: the cell did not end with its run's command" }),
                            )],
                            warden_journal::Urgency::Waited,
                        );
                        let _ = cell.kill();
                        stopped = cell.wait_stopped();
                    }
                    let _ = tx.send(stopped);
                    cell.wait_ended();
                });
                (Some(stopped), Some(gone))
            }
            _ => (None, None),
        };
        let end = ("cell.end", json!({ "reason": "killed" }));
        let delete = ("cell.delete", json!({ "by": by }));
        if entry.workspace.is_some() {
            // Its changes are listed from its layer once its tier has let go of it.
            if let Some(gone) = gone {
                let _ = gone.await;
            }
            if let Some(asked) = asked {
                asked.wait(self).await?;
            }
            if killed {
                self.record(Some(name), end.0, end.1).await?;
            } else if let Some(reason) = &own_end
                && self.unended(name)
            {
                self.record(Some(name), "cell.end", json!({ "reason": reason }))
                    .await?;
            }
            self.journal_changes(name, "deleted, changes discarded")
                .await;
            self.record(Some(name), delete.0, delete.1).await?;
            self.forget_cell(name, true)?;
            self.remove_remains(name, tier);
            return Ok(None);
        }
        // No changes to list: the end and the delete go into the journal's file, and to the
        // disk while its processes end. The daemon forgets the cell now for all who ask; its
        // database commits that after the answer, behind the journal's delete (a daemon killed
        // in between leaves the cell in the database, and the next one forgets it when it
        // finds the delete in the journal: see `reconcile`), so the answer waits for one
        // disk's flush, not two.
        let written = match written {
            Some(written) => written,
            None => {
                let mut entries = Vec::new();
                if killed {
                    entries.push(end);
                }
                entries.push(delete);
                self.record_all_ahead(name, entries, warden_journal::Urgency::Waited)?
            }
        };
        if let Some(asked) = asked {
            asked.wait(self).await?;
        }
        written.wait(self).await?;
        self.forget_cell(name, gone.is_none())?;
        // A run's cell that ended with its command has had every other process of it ended
        // and reaped before the command's end was told (`Cell::ends_with_last_process`): the
        // teardown of its init, which runs nothing of the cell's, is not waited for (its watch
        // above still kills it should it not end).
        if let Some(stopped) = stopped.filter(|_| !ends_itself) {
            let _ = stopped.await;
        }
        // Its folder leaves its place now (a keeper that writes its ending there after this
        // finds no folder: a create of the same name waits for the keeper's end); its layer
        // and record go once its keeper has let go of it, behind the answer.
        match gone {
            Some(gone) => {
                self.discard_folder(self.daemon_dir.join("cells").join(name));
                Ok(Some((gone, tier)))
            }
            None => {
                self.remove_remains(name, tier);
                Ok(None)
            }
        }
    }

    fn done_killing(&self, name: &str) {
        if let Ok(mut killing) = self.killing.lock() {
            killing.remove(name);
        }
    }

    /// What the daemon holds of a deleted cell: its handles and its entry in the database,
    /// committed there now (`commit`) or once `State::forget_pending` is called for it.
    fn forget_cell(&self, name: &str, commit: bool) -> Result<(), HarnessError> {
        if let Ok(mut live) = self.live.lock() {
            live.remove(name);
        }
        if let Ok(mut processes) = self.processes.lock() {
            processes.remove(name);
        }
        if let Ok(mut walled) = self.walled.lock() {
            walled.remove(name);
        }
        if let Ok(mut cells) = self.cells.lock() {
            cells.remove(name);
        }
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.remove(name);
        }
        if let Ok(mut grants) = self.grants.lock() {
            grants.retain(|g| g.cell.as_deref() != Some(name));
        }
        self.drop_exec_questions(name);
        // (A run's cell from a pool, never in the database: its pool marker goes once the
        // delete has answered, see `delete_with`.)
        if let Ok(mut handing) = self.handing.lock() {
            handing.remove(name);
        }
        match commit {
            true => self.state.forget(name),
            false => self.state.forget_later(name),
        }
    }

    /// What a deleted cell left on disk: its layer, its egress record, its folder.
    fn remove_remains(&self, name: &str, tier: Option<Arc<dyn Backend>>) {
        self.remove_layer_and_record(name, tier);
        self.discard_folder(self.daemon_dir.join("cells").join(name));
    }

    /// A deleted cell's layer (once its tier has let go of it) and egress record.
    fn remove_layer_and_record(&self, name: &str, tier: Option<Arc<dyn Backend>>) {
        if let Some(tier) = tier {
            let _ = tier.remove_layer(name);
        }
        let _ = std::fs::remove_file(self.store.net_log_path(name));
    }

    /// Takes a folder the daemon is done with out of the way at once, renamed into `gone/` (its
    /// name is free for a new cell), and removes it on a thread of its own: on a disk mounted
    /// with `discard`, a directory's removal waits for the device, and a delete need not. What
    /// a killed daemon left in `gone/` goes at the next start (`sweep_gone`).
    pub(crate) fn discard_folder(&self, dir: PathBuf) {
        let Some(file_name) = dir.file_name() else {
            return;
        };
        let gone = self.daemon_dir.join(GONE_DIR);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let aside = gone.join(format!("{}-{stamp}", file_name.to_string_lossy()));
        match std::fs::rename(&dir, &aside) {
            Ok(()) => self.remove_later(aside),
            // Not renamed (no `gone/`, another file system): removed here and now.
            Err(_) if dir.exists() => {
                let _ = std::fs::remove_dir_all(&dir);
            }
            Err(_) => {}
        }
    }

    /// Makes `gone/`, and removes what an earlier daemon left in it on the remover's thread.
    pub(crate) fn sweep_gone(&self) {
        let gone = self.daemon_dir.join(GONE_DIR);
        let _ = std::fs::create_dir_all(&gone);
        for entry in std::fs::read_dir(gone).into_iter().flatten().flatten() {
            self.remove_later(entry.path());
        }
    }

    /// Hands a folder (or a file) to the remover's thread (started at the first one); removed
    /// here when no thread can be started.
    pub(crate) fn remove_later(&self, dir: PathBuf) {
        let remover = self.remover.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
            let started = std::thread::Builder::new()
                .name("folder-remover".to_owned())
                .spawn(move || rx.into_iter().for_each(remove));
            started.ok().map(|_| tx)
        });
        match remover {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(dir)) = tx.send(dir) {
                    remove(dir);
                }
            }
            None => remove(dir),
        }
    }
}

/// Removes a folder with all it holds, or a file.
fn remove(path: PathBuf) {
    let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(path));
}

/// Where the folders of deleted cells wait for their removal, in the daemon's folder.
const GONE_DIR: &str = "gone";

pub(crate) fn generate_name() -> String {
    let mut bytes = [0u8; 4];
    let _ = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    format!(
        "cell-{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// A checked request for a cell.
pub(crate) struct Prepared {
    pub(crate) name: String,
    /// Its policy, resolved.
    pub(crate) parsed: warden_policy::Policy,
    /// The snapshot it starts from.
    pub(crate) from: Option<String>,
    pub(crate) entry: CellEntry,
}

/// What the journal's `cell.create` says.
pub(crate) fn create_entry(
    entry: &CellEntry,
    request: &CreateCell,
    from: &Option<String>,
) -> Value {
    json!({
        "policy": match &entry.policy {
            PolicySource::Preset(p) => json!({ "preset": p }),
            PolicySource::Yaml(y) => json!({ "yaml": y }),
        },
        "workspace": request.workspace,
        "from": from,
        "restore": request.restore,
        "labels": request.labels,
        "env": request.env.keys().collect::<Vec<_>>(),
    })
}

/// A cell's status as its tier tells it, if it can.
fn cell_status(harness: &Harness, name: &str) -> Option<Status> {
    harness.cell(name)?.status().ok()
}

/// What a control's kill leaves a delete: whether the cell ended by it, the kill's entry (for a
/// delete, still on its way to the disk), and the end and delete written after it.
pub(crate) struct Killed {
    killed: bool,
    asked: Option<crate::record::Durable>,
    written: Option<crate::record::DurableAll>,
}

/// The names of the entries of `dir` (none where it cannot be read).
fn names_in(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A name held by a create under way; let go of when the create ends, however it ends.
pub(crate) struct Creating {
    names: Arc<Mutex<std::collections::HashSet<String>>>,
    name: String,
}

impl Creating {
    fn hold(
        names: &Arc<Mutex<std::collections::HashSet<String>>>,
        name: &str,
    ) -> Result<Self, HarnessError> {
        let mut held = names.lock().map_err(|_| {
            HarnessError::from(CellFailure::Core("the creates' lock is poisoned".into()))
        })?;
        if !held.insert(name.to_owned()) {
            return Err(HarnessError::from(CreateError::NameTaken(format!(
                "a cell named `{name}` is being created by another request; wait for it, then delete it or pick another name"
            ))));
        }
        Ok(Self {
            names: Arc::clone(names),
            name: name.to_owned(),
        })
    }
}

impl Drop for Creating {
    fn drop(&mut self) {
        if let Ok(mut held) = self.names.lock() {
            held.remove(&self.name);
        }
    }
}
