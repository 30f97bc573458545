//! What the daemon does for each live cell, from outside and on its own clock: notice its end,
//! copy its gateway's decisions into the journal, turn its `ask` questions into approvals, and
//! apply its idle and wall-clock limits.

use crate::{Approval, Scope};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead as _, Seek as _};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use warden_cell::Status;
use warden_policy::{CommandRules, CommandVerdict, LifecycleAction, Policy};

use crate::{ApprovalError, CellFailure, ExecError, Harness, HarnessError};

const TICK: Duration = Duration::from_millis(100);
/// Decisions copied into the journal in one go (one group commit).
const DECISION_BATCH: usize = 256;

/// Up to `max` whole lines of the file at `path` from byte `from`, each with the offset where it
/// ends, and the offset after the last; `None` when the file cannot be read.
fn read_lines(path: &std::path::Path, from: u64, max: usize) -> Option<(Vec<(String, u64)>, u64)> {
    let mut file = std::fs::File::open(path).ok()?;
    file.seek(std::io::SeekFrom::Start(from)).ok()?;
    let mut reader = std::io::BufReader::new(file);
    let mut lines = Vec::new();
    let mut end = from;
    while lines.len() < max {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            // A line still being written: taken next time.
            Ok(_) if !line.ends_with('\n') => break,
            Ok(n) => {
                end += n as u64;
                lines.push((line, end));
            }
        }
    }
    Some((lines, end))
}

/// The daemon's running view of one live cell.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) policy: Policy,
    /// The policy's command rules, compiled.
    pub(crate) commands: Option<CommandRules>,
    pub(crate) started: Instant,
    pub(crate) last_activity: Instant,
    /// Paused by the idle limit: the next exec resumes it.
    pub(crate) idle_paused: bool,
    /// Paused through `control` (a person, an agent session) and not resumed since: a frozen
    /// cell that is not is only held for a moment by the warden's own look at its layer (a
    /// diff, a snapshot).
    pub(crate) paused: bool,
    wall_done: bool,
    /// Questions seen (by id) and whether the daemon answered them.
    asked: HashMap<u64, Question>,
    /// Bytes of the journal's entries about questions a standing grant answered (see
    /// `Harness::journals_granted`), and how many such were answered past `limits.records`
    /// without entries of their own.
    granted_bytes: u64,
    granted_unrecorded: u64,
    /// Places for the cell's file operations under way (see [`crate::files::FILE_SLOTS`]).
    pub(crate) file_slots: Arc<tokio::sync::Semaphore>,
}

impl Live {
    /// Takes the rules of a replaced policy: the network rules (which the gateway enforces, for
    /// the record) and the command rules, which decide the next exec.
    pub(crate) fn replace_rules(
        &mut self,
        network: warden_policy::Network,
        commands: warden_policy::Commands,
    ) {
        self.commands = CommandRules::compile(&commands).ok();
        self.policy.network = network;
        self.policy.commands = commands;
    }

    pub(crate) fn new(policy: Policy) -> Self {
        Self {
            commands: CommandRules::compile(&policy.commands).ok(),
            policy,
            started: Instant::now(),
            last_activity: Instant::now(),
            idle_paused: false,
            paused: false,
            wall_done: false,
            asked: HashMap::new(),
            granted_bytes: 0,
            granted_unrecorded: 0,
            file_slots: Arc::new(tokio::sync::Semaphore::new(crate::files::FILE_SLOTS)),
        }
    }
}

/// A question of a cell's gateway, as the daemon knows it.
#[derive(Debug, Clone)]
struct Question {
    request: String,
    /// The id the daemon shows: the sequence number of its `approval.ask` entry.
    seq: u64,
    /// What a standing grant of it covers.
    grant: String,
    answered: bool,
    /// When the gateway asked it (with the gateway's id, the key of its public id).
    asked_at: u64,
}

/// What a standing grant of a network question covers: its rule and destination (`host:port`),
/// whatever the method or path; a person who lets a cell reach a host means the host.
fn network_grant(rule: &str, destination: &str, request: &str) -> String {
    if destination.is_empty() {
        format!("network {rule} {request}")
    } else {
        format!("network {rule} {destination}")
    }
}

/// A command line as a question shows it: each argument as it is, or in single quotes where it
/// is empty or holds a blank, a quote or anything else a shell reads specially, so that a person
/// sees where each argument ends (`["rm", "-rf /"]` and `["rm", "-rf", "/"]` read alike joined
/// by blanks).
fn shown_command(argv: &[String]) -> String {
    let plain = |c: char| c.is_alphanumeric() || "-_./:=@%+,^~".contains(c);
    argv.iter()
        .map(|arg| match !arg.is_empty() && arg.chars().all(plain) {
            true => arg.clone(),
            false => format!("'{}'", arg.replace('\'', "'\\''")),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `text` with every character that could steer a terminal, or hide or reorder text where a
/// person reads it (a line break, a bidirectional override, a zero-width character), written
/// as `\u{..}`. A question's text comes from the cell or its agent: `echo \u{202e}...` shows in
/// a browser with what follows the override reversed, and a run of line breaks pushes the rest
/// of a command out of sight.
fn shown(text: &str) -> String {
    warden_protocol::text::escaped(text, warden_protocol::text::hides).into_owned()
}

/// What a standing grant of a command covers: that command, argument by argument (as the
/// person was shown it). Its arguments joined by blanks were ambiguous: a grant of
/// `sh -c 'make test'` also covered `sh -c make test`, and of `git push origin` a program the
/// cell named `git push` given `origin`.
fn command_grant(argv: &[String]) -> String {
    format!("exec {}", shown_command(argv))
}

/// A command held for a person's answer; the exec request waits on `answer`.
#[derive(Debug)]
pub(crate) struct ExecQuestion {
    approval: Approval,
    /// What a standing grant of it covers.
    grant: String,
    answer: tokio::sync::oneshot::Sender<bool>,
}

impl Harness {
    /// Watches a live cell until its processes are gone: on one task its end, its questions
    /// and its limits, on another the copy of its gateway's decisions into the journal, so that
    /// however many decisions wait, the limits and questions are handled on time.
    pub(crate) fn watch(self: &Arc<Self>, name: String) {
        let harness = Arc::clone(self);
        let cell = name.clone();
        // The cell this watch is for: once its handle is gone (deleted, and maybe another
        // cell made under its name since), its end is the delete's to journal, not this watch's.
        // Its entry, by when it was made: a later cell of the name has another.
        let watched = self.cell(&name);
        let created = self.entry(&name).ok().map(|e| e.created_ms);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(TICK).await;
                let current = harness.cell(&cell);
                let same = match (&current, &watched) {
                    (Some(now), Some(then)) => Arc::ptr_eq(now, then),
                    _ => false,
                };
                if watched.is_some() && !same {
                    return;
                }
                match harness.alive(&cell) {
                    // Gone: the rest of its record, then its end.
                    Some(false) => {
                        while harness.copy_decisions(&cell).await {}
                        harness.ended(&cell, watched.as_ref(), created).await;
                        return;
                    }
                    Some(true) => {}
                    // Not known this time (the host is short of something): the next tick.
                    None => continue,
                }
                harness.questions(&cell).await;
                harness.lifecycle(&cell).await;
            }
        });
        let harness = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                // A full batch is followed at once by the next.
                if !harness.copy_decisions(&name).await {
                    tokio::time::sleep(TICK).await;
                }
                let watched = harness.live.lock().is_ok_and(|l| l.contains_key(&name));
                if !watched {
                    return;
                }
            }
        });
    }

    /// Whether the cell still runs, as its tier says; `None` when that cannot be told now. A
    /// cell's end is never concluded from a failure to look.
    pub(crate) fn alive(&self, name: &str) -> Option<bool> {
        let Some(cell) = self.cell(name) else {
            return Some(false);
        };
        match cell.status() {
            Ok(Status::Ended) => Some(false),
            Ok(_) => Some(true),
            Err(_) => None,
        }
    }

    /// The end of the cell a watch is for (`watched`, its handle; `created`, when its entry was
    /// made). A kill or delete ends a cell before its watch sees it gone, and a create may then
    /// take its name at once: a watch that looked just before (the look takes time on a busy
    /// host) must leave the new cell be. So the look at whose handle is there and the removal of
    /// it and of its supervision are one step under the handles' lock (a create puts its
    /// handle in before its supervision), and the end is marked only on the watched cell's own
    /// entry. (It ended a new cell of an ended cell's name: its handle and supervision gone,
    /// `cell.end` journaled for it, its commands refused as of an ended cell.)
    async fn ended(
        &self,
        name: &str,
        watched: Option<&Arc<dyn warden_cell::Cell>>,
        created: Option<u64>,
    ) {
        {
            let Ok(mut cells) = self.cells.lock() else {
                return;
            };
            if let (Some(then), Some(now)) = (watched, cells.get(name))
                && !Arc::ptr_eq(now, then)
            {
                return;
            }
            cells.remove(name);
            if let Ok(mut live) = self.live.lock() {
                live.remove(name);
            }
        }
        // A delete under way journals the end itself.
        if self.killing.lock().is_ok_and(|k| k.contains(name)) {
            return;
        }
        let ours = |entry: &crate::state::CellEntry| created.is_none_or(|c| c == entry.created_ms);
        if self.entry(name).map_or(true, |entry| ours(&entry)) {
            let _ = self.state.forget_questions(name);
        }
        if let Ok(entry) = self.entry(name)
            && entry.ended.is_none()
            && ours(&entry)
        {
            let (reason, ending) = self.end_reason(name);
            // A kill that saw the end at the same moment journals it instead.
            if !self.mark_ended_of(name, &reason, created).unwrap_or(false) {
                return;
            }
            let _ = self
                .record(
                    Some(name),
                    "cell.end",
                    json!({ "reason": reason, "ending": ending }),
                )
                .await;
            self.journal_changes(name, "ended, changes kept for review")
                .await;
        }
    }

    /// Why a cell that ended by itself ended, from what its keeper and the daemon left in its
    /// folder; with the keeper's own word for it.
    pub(crate) fn end_reason(&self, name: &str) -> (String, Option<serde_json::Value>) {
        let ending = self.ending_of(name);
        let checkpointed = std::fs::read_to_string(
            self.daemon_dir
                .join("cells")
                .join(name)
                .join(crate::checkpoint::CHECKPOINTED),
        );
        let reason = if let Ok(id) = checkpointed {
            format!("checkpointed as {id}")
        } else if self.kill_requested(name)
            || ending.as_ref().is_some_and(|e| e["reason"] == "killed")
        {
            "killed".to_owned()
        } else if let Some(message) = ending
            .as_ref()
            .filter(|e| e["reason"] == "memory-limit" || e["reason"] == "disk-limit")
            .and_then(|e| e["message"].as_str())
        {
            message.to_owned()
        } else {
            "its processes ended".to_owned()
        };
        (reason, ending)
    }

    /// Copies up to [`DECISION_BATCH`] new lines of the cell's egress record into the journal
    /// (`net.decision`, each with where its line ends in the record), and then notes how far it
    /// got; whether the batch was full. One copy per cell at a time, and each line once: where
    /// a crash fell between the journal and that note, the journal's own entries say how far.
    pub(crate) async fn copy_decisions(&self, name: &str) -> bool {
        let copier = {
            let Ok(mut copiers) = self.copiers.lock() else {
                return false;
            };
            Arc::clone(copiers.entry(name.to_owned()).or_insert_with(|| {
                let offset = self
                    .state
                    .record_offset(name)
                    .unwrap_or(0)
                    .max(self.journaled.record_ends.get(name).copied().unwrap_or(0));
                Arc::new(tokio::sync::Mutex::new(offset))
            }))
        };
        let mut offset = copier.lock().await;
        let path = self.store.net_log_path(name);
        let from = *offset;
        let read = tokio::task::spawn_blocking(move || read_lines(&path, from, DECISION_BATCH))
            .await
            .unwrap_or_default();
        let Some((lines, end)) = read else {
            return false;
        };
        if lines.is_empty() {
            return false;
        }
        let full = lines.len() == DECISION_BATCH;
        let entries = lines
            .into_iter()
            .filter_map(|(line, line_end)| {
                let mut decision = serde_json::from_str::<serde_json::Value>(&line).ok()?;
                decision["record_end"] = json!(line_end);
                Some(decision)
            })
            .collect();
        if self
            .record_many(name, "net.decision", entries)
            .await
            .is_err()
        {
            // Not journaled: taken again next time.
            return false;
        }
        *offset = end;
        let _ = self.state.set_record_offset(name, Some(end));
        full
    }
    /// Journals new questions (the entry's sequence number becomes the question's id), answers
    /// those covered by a grant, and notes those that timed out.
    async fn questions(&self, name: &str) {
        let pending = self.cell(name).map(|c| c.questions()).unwrap_or_default();
        let open: HashSet<u64> = pending.iter().map(|q| q.id).collect();
        let mut gone = Vec::new();
        let known: HashSet<u64> = self
            .live
            .lock()
            .ok()
            .and_then(|mut live| {
                let l = live.get_mut(name)?;
                l.asked.retain(|id, q| {
                    if open.contains(id) {
                        return true;
                    }
                    if !q.answered {
                        gone.push((q.seq, q.request.clone()));
                    }
                    // One answered with no entry of its own (seq 0) was never given an id.
                    if q.seq != 0 {
                        let _ = self.state.set_question_id(name, *id, q.asked_at, None);
                    }
                    false
                });
                Some(l.asked.keys().copied().collect())
            })
            .unwrap_or_default();
        let on_timeout = self.policy_of(name).map(|p| p.approvals.on_timeout);
        for (id, request) in gone {
            let outcome = match on_timeout {
                Some(warden_policy::ApprovalOutcome::Allow) => "allow",
                _ => "deny",
            };
            let _ = self
                .record(
                    Some(name),
                    "approval.timeout",
                    json!({ "id": id, "request": request, "outcome": outcome }),
                )
                .await;
        }
        for q in pending.into_iter().filter(|q| !known.contains(&q.id)) {
            let _ = self.take_question(name, &q).await;
        }
    }

    /// Journals a question of the cell's gateway the daemon had not seen, and answers it at
    /// once where a standing grant covers it; returns its id (the entry's sequence number).
    async fn take_question(
        &self,
        name: &str,
        q: &warden_egress::Question,
    ) -> Result<u64, HarnessError> {
        let grant = network_grant(&q.rule, &q.destination, &q.request);
        // A question asked before the daemon restarted keeps the id it was shown with.
        let known = self.state.question_id(name, q.id, q.asked_at)?;
        if known.is_none()
            && let Some(by) = self.grant_for(name, &grant)
            && let Some(count) = self.granted_past_records(name, q)
        {
            return self.answer_unrecorded(name, q, grant, &by, count).await;
        }
        let seq = match known {
            Some(seq) => seq,
            None => {
                let receipt = self
                    .record(
                        Some(name),
                        "approval.ask",
                        json!({ "id": null, "gateway_id": q.id, "request": q.request,
                                "rule": q.rule, "destination": q.destination,
                                "timeout_s": q.timeout_s }),
                    )
                    .await?;
                self.state
                    .set_question_id(name, q.id, q.asked_at, Some(receipt.seq))?;
                receipt.seq
            }
        };
        self.note_asked(name, q, seq, grant.clone(), false);
        if let Some(by) = self.grant_for(name, &grant) {
            let _ = self
                .answer_inner(name, seq, true, Scope::Once, &format!("grant: {by}"))
                .await;
        }
        Ok(seq)
    }

    /// Notes a question of the cell's gateway as seen (`seq`: the id it is shown with; 0: none).
    fn note_asked(
        &self,
        name: &str,
        q: &warden_egress::Question,
        seq: u64,
        grant: String,
        answered: bool,
    ) {
        if let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.asked.insert(
                q.id,
                Question {
                    request: q.request.clone(),
                    seq,
                    grant,
                    answered,
                    asked_at: q.asked_at,
                },
            );
        }
    }

    /// Counts a question that a standing grant answers against the cell's `limits.records`,
    /// which bounds what the warden writes of its network decisions: a cell asks as often as it
    /// likes, and each such question took two entries of up to 2 KiB of its request, and a
    /// flush of the disk (1,600 requests in 15 s, 10.6 MB of journal). `None` while its
    /// entries fit; past the bound, how many have been answered without entries.
    fn granted_past_records(&self, name: &str, q: &warden_egress::Question) -> Option<u64> {
        let mut live = self.live.lock().ok()?;
        let l = live.get_mut(name)?;
        // Both entries carry the request; the rest of each is under 300 bytes.
        let cost = 2 * (q.request.len() + q.rule.len() + q.destination.len()) as u64 + 600;
        if l.granted_bytes.saturating_add(cost) <= l.policy.limits.records.0 {
            l.granted_bytes += cost;
            return None;
        }
        l.granted_unrecorded += 1;
        Some(l.granted_unrecorded)
    }

    /// Answers a question a standing grant covers with no entry of its own (the `count`-th past
    /// `limits.records`); the journal says so at the first and at every power of two after it,
    /// with the count. The gateway's record of the request itself is bounded as any other.
    async fn answer_unrecorded(
        &self,
        name: &str,
        q: &warden_egress::Question,
        grant: String,
        by: &str,
        count: u64,
    ) -> Result<u64, HarnessError> {
        self.note_asked(name, q, 0, grant, true);
        if count.is_power_of_two() {
            self.record(
                Some(name),
                "approval.unrecorded",
                json!({ "count": count, "grant": by,
                        "note": "questions a standing grant answered past the cell's limits.records: each answered, counted here, not journaled one by one" }),
            )
            .await?;
        }
        self.cell(name)
            .ok_or_else(|| CellFailure::Ended(format!("cell `{name}` has ended")))?
            .answer(q.id, true)
            .map_err(|e| ApprovalError::NoQuestion(e.to_string()))?;
        Ok(0)
    }

    fn policy_of(&self, name: &str) -> Option<Policy> {
        self.live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| l.policy.clone()))
    }

    /// A standing grant that covers `grant` (see `network_grant`, `command_grant`) from this
    /// cell, described.
    fn grant_for(&self, name: &str, grant: &str) -> Option<String> {
        let grants = self.grants.lock().ok()?;
        grants
            .iter()
            .find(|g| g.key() == grant && g.cell.as_deref().is_none_or(|c| c == name))
            .map(|g| {
                format!(
                    "{} approved with scope {} by {}",
                    g.request,
                    if g.cell.is_some() { "cell" } else { "always" },
                    g.by
                )
            })
    }

    /// What the cell's command rules say of a command line (allow for a cell this harness
    /// does not supervise).
    pub(crate) fn command_verdict(
        &self,
        name: &str,
        argv: &[String],
    ) -> Result<(CommandVerdict, warden_policy::Approvals), HarnessError> {
        let live = self
            .live
            .lock()
            .map_err(|_| CellFailure::Core("the harness's state is poisoned".to_owned()))?;
        let Some(l) = live.get(name) else {
            return Ok((CommandVerdict::Allow, warden_policy::Approvals::default()));
        };
        let verdict = l
            .commands
            .as_ref()
            .map_or(CommandVerdict::Allow, |rules| rules.decide(argv));
        Ok((verdict, l.policy.approvals.clone()))
    }

    /// A verdict that refuses the command here and now: what `exec.denied` says, and the
    /// error. A deny rule always; an ask rule in a harness that lives for one command, where
    /// nobody could answer.
    pub(crate) fn refusal(
        &self,
        argv: &[String],
        verdict: &CommandVerdict,
    ) -> Option<(serde_json::Value, HarnessError)> {
        let line = argv.join(" ");
        match verdict {
            CommandVerdict::Allow => None,
            CommandVerdict::Deny(rule) => Some((
                json!({ "argv": argv, "rule": rule }),
                ExecError::Denied(format!(
                    "the cell's policy refuses the command `{line}` (rule {rule})"
                ))
                .into(),
            )),
            CommandVerdict::Ask(_) if !self.ephemeral => None,
            CommandVerdict::Ask(rule) => Some((
                json!({ "argv": argv, "rule": rule, "reason": "it asks a person, and no daemon runs to take the answer" }),
                ExecError::Denied(format!(
                    "the cell's policy holds the command `{line}` for a person's approval (rule {rule}), and without a daemon nobody can answer: start `warden serve` and run it again"
                ))
                .into(),
            )),
        }
    }

    /// Applies the cell's command rules to an exec: allowed, refused, or held until a person
    /// (or the policy's timeout) decides.
    pub(crate) async fn check_command(
        &self,
        name: &str,
        argv: &[String],
    ) -> Result<(), HarnessError> {
        let (verdict, approvals) = self.command_verdict(name, argv)?;
        if let Some((entry, refused)) = self.refusal(argv, &verdict) {
            self.record(Some(name), "exec.denied", entry).await?;
            return Err(refused);
        }
        let CommandVerdict::Ask(rule) = verdict else {
            return Ok(());
        };
        let request = format!("exec {}", shown_command(argv));
        self.ask_person(name, request, command_grant(argv), rule, &approvals)
            .await
    }

    /// Holds an effect a face decides to ask about (a tool of the warden's agent loop in `ask`
    /// mode) until a person answers, in the same queue as every other question, under the
    /// cell's policy's approval timeout. `request` says what is asked; a standing grant of it
    /// (scope `cell` or `always`) answers it from then on.
    pub async fn ask(&self, name: &str, request: String, rule: String) -> Result<(), HarnessError> {
        let approvals = self
            .policy_of(name)
            .ok_or_else(|| HarnessError::not_found(name))?
            .approvals;
        if self.ephemeral {
            return Err(ApprovalError::Refused(format!(
                "`{request}` waits for a person's approval ({rule}), and without a daemon nobody can answer: start `warden serve`"
            ))
            .into());
        }
        self.ask_person(name, request.clone(), request, rule, &approvals)
            .await
    }

    /// Holds an effect until a person answers (or a standing grant covers `grant`, or the
    /// policy's timeout decides).
    pub(crate) async fn ask_person(
        &self,
        name: &str,
        request: String,
        grant: String,
        rule: String,
        approvals: &warden_policy::Approvals,
    ) -> Result<(), HarnessError> {
        // What a person reads (the dashboard, the CLI, the journal): a command line, a tool's
        // arguments or a file's name come from the cell or its agent.
        let request = shown(&request);
        let line = request.clone();
        if let Some(by) = self.grant_for(name, &grant) {
            self.record(
                Some(name),
                "approval.answer",
                json!({ "request": request, "decision": "approve", "scope": "once", "by": format!("grant: {by}") }),
            )
            .await?;
            return Ok(());
        }
        let timeout = approvals.timeout.0;
        let asked = self
            .record(
                Some(name),
                "approval.ask",
                json!({ "id": null, "request": request, "rule": rule, "timeout_s": timeout.as_secs() }),
            )
            .await?;
        let id = asked.seq;
        let approval = Approval {
            cell: name.to_owned(),
            id,
            request: request.clone(),
            rule: rule.clone(),
            asked_at: crate::now_ms() / 1000,
            timeout_s: timeout.as_secs(),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Ok(mut questions) = self.exec_questions.lock() {
            questions.insert(
                (name.to_owned(), id),
                ExecQuestion {
                    approval,
                    grant,
                    answer: tx,
                },
            );
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(ApprovalError::Refused(format!(
                "a person refused `{line}` (question {id})"
            ))
            .into()),
            // Dropped with its cell (deleted, or its name taken by a new cell).
            Ok(Err(_)) => Err(CellFailure::Ended(format!(
                "cell `{name}` ended or was deleted while `{line}` waited for approval (question {id}); nothing ran"
            ))
            .into()),
            Err(_) => {
                let held = self
                    .exec_questions
                    .lock()
                    .ok()
                    .and_then(|mut q| q.remove(&(name.to_owned(), id)));
                let allow = approvals.on_timeout == warden_policy::ApprovalOutcome::Allow;
                if held.is_some() {
                    self.record(
                        Some(name),
                        "approval.timeout",
                        json!({ "id": id, "request": request, "outcome": if allow { "allow" } else { "deny" } }),
                    )
                    .await?;
                }
                if allow {
                    Ok(())
                } else {
                    Err(ApprovalError::Refused(format!(
                        "nobody answered about `{line}` within {} s; the policy's approvals.on_timeout refuses it",
                        timeout.as_secs()
                    ))
                    .into())
                }
            }
        }
    }

    /// The approvals waiting for a person, over every cell (a gateway's question once the
    /// daemon has journaled it: within a tick of its asking).
    pub fn approvals(&self) -> Vec<Approval> {
        let names: Vec<String> = self
            .live
            .lock()
            .map(|l| l.keys().cloned().collect::<Vec<String>>())
            .unwrap_or_default();
        let mut out = Vec::new();
        for name in names {
            let seen: HashMap<u64, u64> = self
                .live
                .lock()
                .ok()
                .and_then(|l| {
                    l.get(&name).map(|l| {
                        l.asked
                            .iter()
                            .filter(|(_, q)| !q.answered)
                            .map(|(id, q)| (*id, q.seq))
                            .collect()
                    })
                })
                .unwrap_or_default();
            for q in self.cell(&name).map(|c| c.questions()).unwrap_or_default() {
                let Some(seq) = seen.get(&q.id) else { continue };
                out.push(Approval {
                    cell: name.clone(),
                    id: *seq,
                    request: q.request,
                    rule: q.rule,
                    asked_at: q.asked_at,
                    timeout_s: q.timeout_s,
                });
            }
        }
        if let Ok(questions) = self.exec_questions.lock() {
            out.extend(questions.values().map(|q| q.approval.clone()));
        }
        out.sort_by_key(|a| a.id);
        out
    }

    /// Answers an approval; `by` says who (journaled with the answer).
    pub async fn answer(
        &self,
        name: &str,
        id: u64,
        allow: bool,
        scope: Scope,
        by: &str,
    ) -> Result<(), HarnessError> {
        self.entry(name)?;
        if !allow && scope != Scope::Once {
            return Err(ApprovalError::Invalid(
                "a denial answers one question (scope once); change the policy to refuse for good"
                    .to_owned(),
            )
            .into());
        }
        self.answer_inner(name, id, allow, scope, by).await
    }

    async fn answer_inner(
        &self,
        name: &str,
        id: u64,
        allow: bool,
        scope: Scope,
        by: &str,
    ) -> Result<(), HarnessError> {
        // A question about a command: the exec request waits on it in this daemon.
        let held = self
            .exec_questions
            .lock()
            .ok()
            .and_then(|mut q| q.remove(&(name.to_owned(), id)));
        if let Some(question) = held {
            let request = question.approval.request.clone();
            self.record_answer(name, id, &request, allow, scope, by)
                .await?;
            let _ = question.answer.send(allow);
            self.remember_grant(name, request, question.grant, allow, scope, by)?;
            return Ok(());
        }
        // A question of the cell's gateway, by the id the daemon gave it; marked answered
        // before anything else, so that the watch never answers it a second time.
        let found = self.live.lock().ok().and_then(|mut live| {
            let l = live.get_mut(name)?;
            let (gateway_id, q) = l.asked.iter_mut().find(|(_, q)| q.seq == id)?;
            if q.answered {
                return None;
            }
            q.answered = true;
            Some((*gateway_id, q.request.clone(), q.grant.clone()))
        });
        let Some((gateway_id, request, grant)) = found else {
            return Err(ApprovalError::NoQuestion(format!(
                "cell `{name}` has no open question {id}, or it was answered already (`warden approvals` lists the open ones)"
            ))
            .into());
        };
        self.record_answer(name, id, &request, allow, scope, by)
            .await?;
        self.cell(name)
            .ok_or_else(|| CellFailure::Ended(format!("cell `{name}` has ended")))?
            .answer(gateway_id, allow)
            .map_err(|e| ApprovalError::NoQuestion(e.to_string()))?;
        self.remember_grant(name, request, grant, allow, scope, by)
    }

    async fn record_answer(
        &self,
        name: &str,
        id: u64,
        request: &str,
        allow: bool,
        scope: Scope,
        by: &str,
    ) -> Result<(), HarnessError> {
        self.record(
            Some(name),
            "approval.answer",
            json!({
                "id": id,
                "request": request,
                "decision": if allow { "approve" } else { "deny" },
                "scope": scope.name(),
                "by": by,
            }),
        )
        .await
        .map(|_| ())
    }

    fn remember_grant(
        &self,
        name: &str,
        request: String,
        key: String,
        allow: bool,
        scope: Scope,
        by: &str,
    ) -> Result<(), HarnessError> {
        if allow && scope != Scope::Once {
            let grant = crate::state::Grant {
                cell: (scope == Scope::Cell).then(|| name.to_owned()),
                request,
                key: Some(key),
                by: by.to_owned(),
            };
            self.state.put_grant(&grant)?;
            if let Ok(mut grants) = self.grants.lock() {
                grants.push(grant);
            }
        }
        Ok(())
    }

    /// Applies the idle and wall-clock limits of a cell the daemon keeps.
    async fn lifecycle(&self, name: &str) {
        let running = self
            .processes
            .lock()
            .map(|p| {
                p.get(name)
                    .is_some_and(|list| list.iter().any(|p| p.exit().is_none()))
            })
            .unwrap_or(false);
        let mut due = None;
        if let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            if running {
                l.last_activity = Instant::now();
            }
            let limits = &l.policy.limits;
            if let Some(wall) = limits.wall
                && !l.wall_done
                && l.started.elapsed() >= wall.0
            {
                l.wall_done = true;
                due = Some(("cell.wall", limits.on_wall, wall.to_string()));
            } else if let Some(idle) = limits.idle
                && !l.idle_paused
                && l.last_activity.elapsed() >= idle.0
            {
                if limits.on_idle == LifecycleAction::Pause {
                    l.idle_paused = true;
                } else {
                    l.last_activity = Instant::now();
                }
                due = Some(("cell.idle", limits.on_idle, idle.to_string()));
            }
        }
        let Some((kind, action, limit)) = due else {
            return;
        };
        if action == LifecycleAction::Pause
            && self
                .cell(name)
                .is_some_and(|c| matches!(c.status(), Ok(Status::Paused)))
        {
            return;
        }
        let _ = self
            .record(
                Some(name),
                kind,
                json!({ "limit": limit, "action": action.name() }),
            )
            .await;
        if kind == "cell.wall" && action == LifecycleAction::Kill {
            // Processes cut by this kill ended by the wall-clock limit, and say so.
            if let Ok(mut walled) = self.walled.lock() {
                walled.insert(name.to_owned());
            }
        }
        let action = match action {
            LifecycleAction::Pause => crate::ControlAction::Pause,
            LifecycleAction::Kill => crate::ControlAction::Kill,
        };
        let _ = self.control(name, action, "policy").await;
    }
}
