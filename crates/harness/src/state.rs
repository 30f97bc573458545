//! The daemon's embedded state: which cells it made and with what, kept in redb so that a new
//! daemon knows them after a crash of the old one.

use std::collections::BTreeMap;
use std::path::Path;

use redb::{Database, ReadableTable as _, TableDefinition, TableHandle as _};
use serde::{Deserialize, Serialize};

use crate::{CellFailure, ErrorKind, HarnessError};

const CELLS: TableDefinition<&str, &str> = TableDefinition::new("cells");
const GRANTS: TableDefinition<&str, &str> = TableDefinition::new("grants");
/// How far into each cell's egress record the journal has copied (bytes).
const RECORD_OFFSETS: TableDefinition<&str, u64> = TableDefinition::new("record_offsets");
/// The public id (journal sequence number) of each open gateway question, keyed by cell,
/// gateway id and time asked, so that a question keeps its id across daemon restarts.
const QUESTIONS: TableDefinition<&str, u64> = TableDefinition::new("questions");

/// A standing approval: the same request is approved without asking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The cell it is limited to; `None` for every cell (scope `always`).
    pub cell: Option<String>,
    /// The request it was given for (shown).
    pub request: String,
    /// What it covers (the rule and destination of a network question, the command line of a
    /// command); grants kept by an earlier version cover their exact request.
    #[serde(default)]
    pub key: Option<String>,
    pub by: String,
}

impl Grant {
    pub fn key(&self) -> &str {
        self.key.as_deref().unwrap_or(&self.request)
    }
}

/// What the daemon remembers of a cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellEntry {
    pub name: String,
    pub created_ms: u64,
    /// The policy as given (YAML), or the preset's name.
    pub policy: PolicySource,
    pub workspace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Set once the cell's processes are gone, with why.
    #[serde(default)]
    pub ended: Option<String>,
    /// The latest policy document that replaced the cell's `network` and `commands` while it
    /// ran (the other sections stay as made).
    #[serde(default)]
    pub replaced: Option<String>,
    /// Paused through the harness's control (a person, an agent session) and not resumed
    /// since: what a daemon that takes the cell back keeps frozen. A cell found frozen without
    /// it was held by the warden's own look at its layer when the last daemon stopped.
    #[serde(default)]
    pub paused: bool,
    /// Its tier, and the preset it was made from (or that its document `extends`), as the
    /// faces show them; kept here so that listing cells reads no policy.
    #[serde(default)]
    pub tier: Option<String>,
    #[serde(default)]
    pub preset: Option<String>,
    /// Made for one command (`POST /v1/run`) and deleted at its end: a daemon that finds it
    /// after its run's daemon stopped deletes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub run: bool,
}

impl CellEntry {
    /// The policy in force: as the cell was made, with the `network` and `commands` of its
    /// latest replacement.
    pub fn policy_in_force(&self) -> Option<warden_policy::Policy> {
        let mut policy = match &self.policy {
            PolicySource::Preset(p) => warden_policy::preset(p).ok(),
            PolicySource::Yaml(y) => warden_policy::from_yaml("policy", y).ok(),
        }?;
        if let Some(newer) = self
            .replaced
            .as_deref()
            .and_then(|y| warden_policy::from_yaml("policy", y).ok())
        {
            policy.network = newer.network;
            policy.commands = newer.commands;
        }
        Some(policy)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicySource {
    Preset(String),
    Yaml(String),
}

#[derive(Debug)]
pub struct State {
    backing: Backing,
    /// Cells forgotten already for whoever reads this state, whose removal from the database
    /// is still to be committed (see [`State::forget_later`]).
    forgetting: std::sync::Mutex<std::collections::HashSet<String>>,
}

#[derive(Debug)]
enum Backing {
    Db(Database),
    /// The state of a harness that lives for one command: maps, gone with the process.
    Memory(std::sync::Mutex<Memory>),
}

/// The state of a harness for one command: every table's entries, by table and key.
type Memory = BTreeMap<(String, String), Stored>;

/// A value kept in memory.
#[derive(Debug, Clone)]
enum Stored {
    Text(String),
    Number(u64),
}

type Table<V> = TableDefinition<'static, &'static str, V>;

/// What a table's values are, in the database and in memory: one implementation of the
/// tables' operations serves both kinds of value and both backings.
trait Column: redb::Value + 'static {
    type Owned;
    fn owned(value: Self::SelfType<'_>) -> Self::Owned;
    /// Calls `f` with the database's form of `value`.
    fn with_value<R>(value: &Self::Owned, f: impl FnOnce(Self::SelfType<'_>) -> R) -> R;
    fn stored(value: &Self::Owned) -> Stored;
    fn from_stored(stored: &Stored) -> Option<Self::Owned>;
}

impl Column for &'static str {
    type Owned = String;
    fn owned(value: &str) -> String {
        value.to_owned()
    }
    fn with_value<R>(value: &String, f: impl FnOnce(&str) -> R) -> R {
        f(value)
    }
    fn stored(value: &String) -> Stored {
        Stored::Text(value.clone())
    }
    fn from_stored(stored: &Stored) -> Option<String> {
        match stored {
            Stored::Text(text) => Some(text.clone()),
            Stored::Number(_) => None,
        }
    }
}

impl Column for u64 {
    type Owned = u64;
    fn owned(value: u64) -> u64 {
        value
    }
    fn with_value<R>(value: &u64, f: impl FnOnce(u64) -> R) -> R {
        f(*value)
    }
    fn stored(value: &u64) -> Stored {
        Stored::Number(*value)
    }
    fn from_stored(stored: &Stored) -> Option<u64> {
        match stored {
            Stored::Number(n) => Some(*n),
            Stored::Text(_) => None,
        }
    }
}

/// The cell an entry of a table belongs to, by its key (a grant for every cell: none).
/// Whether the entry `key` of table `table` belongs to one of the cells `forgetting`.
fn among(forgetting: &std::collections::HashSet<String>, table: &str, key: &str) -> bool {
    !forgetting.is_empty() && owner(table, key).is_some_and(|cell| forgetting.contains(cell))
}

fn owner<'a>(table: &str, key: &'a str) -> Option<&'a str> {
    if table == CELLS.name() || table == RECORD_OFFSETS.name() {
        Some(key)
    } else if table == QUESTIONS.name() {
        key.split('/').next()
    } else if table == GRANTS.name() {
        key.strip_prefix("cell ")
            .and_then(|rest| rest.split(' ').next())
    } else {
        None
    }
}

fn db_error(err: impl std::fmt::Display) -> HarnessError {
    HarnessError::from(CellFailure::Core(format!(
        "the daemon's state database: {err}"
    )))
}

fn poisoned<T>(_: T) -> HarnessError {
    HarnessError::from(CellFailure::Core("the harness's state is poisoned".into()))
}

impl State {
    pub fn open(path: &Path) -> Result<Self, HarnessError> {
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => HarnessError::new(
                ErrorKind::Conflict,
                format!(
                    "another warden holds the state database {}: a daemon (`warden serve`), or a `warden mcp` that runs without one; stop it first; for several sessions at once, run `warden serve` and start them after it (a `warden mcp` started while a daemon runs goes through the daemon)",
                    path.display()
                ),
            ),
            e => HarnessError::from(CellFailure::Core(format!(
                "opening the state database {}: {e}",
                path.display()
            ))),
        })?;
        let txn = db.begin_write().map_err(db_error)?;
        txn.open_table(CELLS).map_err(db_error)?;
        txn.open_table(GRANTS).map_err(db_error)?;
        txn.open_table(RECORD_OFFSETS).map_err(db_error)?;
        txn.open_table(QUESTIONS).map_err(db_error)?;
        txn.commit().map_err(db_error)?;
        Ok(Self {
            backing: Backing::Db(db),
            forgetting: Default::default(),
        })
    }

    /// State that lives as long as this process: that of a harness that holds its cells only
    /// while it runs (`warden run` without a daemon). Maps, not a database (making even an
    /// in-memory database costs milliseconds a one-command run does not have).
    pub fn in_memory() -> Self {
        Self {
            backing: Backing::Memory(std::sync::Mutex::new(Memory::new())),
            forgetting: Default::default(),
        }
    }

    fn load<V: Column>(
        &self,
        table: Table<V>,
        key: &str,
    ) -> Result<Option<V::Owned>, HarnessError> {
        if self.hidden(table.name(), key) {
            return Ok(None);
        }
        match &self.backing {
            Backing::Db(db) => {
                let txn = db.begin_read().map_err(db_error)?;
                let table = txn.open_table(table).map_err(db_error)?;
                Ok(table
                    .get(key)
                    .map_err(db_error)?
                    .map(|v| V::owned(v.value())))
            }
            Backing::Memory(m) => Ok(m
                .lock()
                .map_err(poisoned)?
                .get(&(table.name().to_owned(), key.to_owned()))
                .and_then(V::from_stored)),
        }
    }

    fn store<V: Column>(
        &self,
        table: Table<V>,
        key: &str,
        value: Option<&V::Owned>,
    ) -> Result<(), HarnessError> {
        if let Some(cell) = owner(table.name(), key) {
            self.forget_pending(cell)?;
        }
        match &self.backing {
            Backing::Db(db) => {
                let txn = db.begin_write().map_err(db_error)?;
                {
                    let mut table = txn.open_table(table).map_err(db_error)?;
                    match value {
                        Some(value) => V::with_value(value, |v| {
                            table.insert(key, v).map(drop).map_err(db_error)
                        })?,
                        None => drop(table.remove(key).map_err(db_error)?),
                    }
                }
                txn.commit().map_err(db_error)
            }
            Backing::Memory(m) => {
                let mut m = m.lock().map_err(poisoned)?;
                let key = (table.name().to_owned(), key.to_owned());
                match value {
                    Some(value) => m.insert(key, V::stored(value)),
                    None => m.remove(&key),
                };
                Ok(())
            }
        }
    }

    fn load_all<V: Column>(&self, table: Table<V>) -> Result<Vec<V::Owned>, HarnessError> {
        match &self.backing {
            Backing::Db(db) => {
                // The cells being forgotten, taken before the read: one whose forgetting is
                // committed (and no longer pending) after the read began is still in what the
                // read sees, and must still be hidden (a listing showed a deleted cell so).
                let forgetting = self.forgetting.lock().map_err(poisoned)?.clone();
                let txn = db.begin_read().map_err(db_error)?;
                let table = txn.open_table(table).map_err(db_error)?;
                let mut out = Vec::new();
                for item in table.iter().map_err(db_error)? {
                    let (key, value) = item.map_err(db_error)?;
                    if !among(&forgetting, table.name(), key.value()) {
                        out.push(V::owned(value.value()));
                    }
                }
                Ok(out)
            }
            Backing::Memory(m) => Ok(m
                .lock()
                .map_err(poisoned)?
                .iter()
                .filter(|((t, _), _)| t == table.name())
                .filter_map(|(_, v)| V::from_stored(v))
                .collect()),
        }
    }

    fn keep_only<V: Column>(
        &self,
        table: Table<V>,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(), HarnessError> {
        match &self.backing {
            Backing::Db(db) => {
                let txn = db.begin_write().map_err(db_error)?;
                {
                    let mut table = txn.open_table(table).map_err(db_error)?;
                    table.retain(|key, _| keep(key)).map_err(db_error)?;
                }
                txn.commit().map_err(db_error)
            }
            Backing::Memory(m) => {
                m.lock()
                    .map_err(poisoned)?
                    .retain(|(t, k), _| t != table.name() || keep(k));
                Ok(())
            }
        }
    }

    fn question_key(name: &str, gateway_id: u64, asked_at: u64) -> String {
        format!("{name}/{gateway_id}/{asked_at}")
    }

    /// The id a gateway question was given when it was first seen, if it was.
    pub fn question_id(
        &self,
        name: &str,
        gateway_id: u64,
        asked_at: u64,
    ) -> Result<Option<u64>, HarnessError> {
        self.load(QUESTIONS, &Self::question_key(name, gateway_id, asked_at))
    }

    /// Notes (or, with `None`, forgets) the id of a gateway question.
    pub fn set_question_id(
        &self,
        name: &str,
        gateway_id: u64,
        asked_at: u64,
        id: Option<u64>,
    ) -> Result<(), HarnessError> {
        self.store(
            QUESTIONS,
            &Self::question_key(name, gateway_id, asked_at),
            id.as_ref(),
        )
    }

    /// Forgets every question of a cell (it ended or was removed).
    pub fn forget_questions(&self, name: &str) -> Result<(), HarnessError> {
        let prefix = format!("{name}/");
        self.keep_only(QUESTIONS, |key| !key.starts_with(&prefix))
    }

    /// How far into the cell's egress record the journal has copied.
    pub fn record_offset(&self, name: &str) -> Result<u64, HarnessError> {
        Ok(self.load(RECORD_OFFSETS, name)?.unwrap_or(0))
    }

    /// Notes how far the journal has copied the cell's egress record (`None`: forget it, for
    /// a new cell of that name).
    pub fn set_record_offset(&self, name: &str, offset: Option<u64>) -> Result<(), HarnessError> {
        self.store(RECORD_OFFSETS, name, offset.as_ref())
    }

    pub fn put(&self, entry: &CellEntry) -> Result<(), HarnessError> {
        let json = serde_json::to_string(entry).map_err(db_error)?;
        self.store(CELLS, &entry.name, Some(&json))
    }

    pub fn remove(&self, name: &str) -> Result<(), HarnessError> {
        self.store(CELLS, name, None)
    }

    /// A new cell's entry, and no record offset of an earlier cell of its name: one commit.
    pub fn put_new(&self, entry: &CellEntry) -> Result<(), HarnessError> {
        let json = serde_json::to_string(entry).map_err(db_error)?;
        self.forget_pending(&entry.name)?;
        match &self.backing {
            Backing::Db(db) => {
                let txn = db.begin_write().map_err(db_error)?;
                {
                    let mut cells = txn.open_table(CELLS).map_err(db_error)?;
                    cells
                        .insert(entry.name.as_str(), json.as_str())
                        .map_err(db_error)?;
                    let mut offsets = txn.open_table(RECORD_OFFSETS).map_err(db_error)?;
                    offsets.remove(entry.name.as_str()).map_err(db_error)?;
                }
                txn.commit().map_err(db_error)
            }
            Backing::Memory(_) => {
                self.put(entry)?;
                self.set_record_offset(&entry.name, None)
            }
        }
    }

    /// Forgets a cell whole (its entry, record offset, questions and standing grants): one
    /// commit, or none where the database holds nothing of it (a run's cell from a pool is
    /// never written there).
    pub fn forget(&self, name: &str) -> Result<(), HarnessError> {
        let questions = format!("{name}/");
        let grants = format!("cell {name} ");
        match &self.backing {
            Backing::Db(db) => {
                let txn = db.begin_write().map_err(db_error)?;
                let mut changed = false;
                {
                    let mut table = txn.open_table(RECORD_OFFSETS).map_err(db_error)?;
                    changed |= table.remove(name).map_err(db_error)?.is_some();
                    let mut table = txn.open_table(QUESTIONS).map_err(db_error)?;
                    if holds_prefix(&table, &questions)? {
                        changed = true;
                        table
                            .retain(|key, _| !key.starts_with(&questions))
                            .map_err(db_error)?;
                    }
                    let mut table = txn.open_table(GRANTS).map_err(db_error)?;
                    if holds_prefix(&table, &grants)? {
                        changed = true;
                        table
                            .retain(|key, _| !key.starts_with(&grants))
                            .map_err(db_error)?;
                    }
                    let mut table = txn.open_table(CELLS).map_err(db_error)?;
                    changed |= table.remove(name).map_err(db_error)?.is_some();
                }
                match changed {
                    true => txn.commit().map_err(db_error)?,
                    // Nothing to write: no commit, and no flush of the disk.
                    false => txn.abort().map_err(db_error)?,
                }
                // Gone from the database: nothing left to hide.
                if let Ok(mut forgetting) = self.forgetting.lock() {
                    forgetting.remove(name);
                }
                Ok(())
            }
            Backing::Memory(_) => {
                self.set_record_offset(name, None)?;
                self.forget_questions(name)?;
                self.forget_grants_of(name)?;
                self.remove(name)
            }
        }
    }

    /// Forgets a cell whole for every reader of this state at once, and in the database when
    /// [`State::forget_pending`] is called for it (or the cell's name is written again): a
    /// delete answers without waiting for the database's commit. A daemon that dies before that
    /// commit leaves the cell in the database; the journal, which has its delete, is what the
    /// next daemon goes by (see `Harness::reconcile`).
    pub fn forget_later(&self, name: &str) -> Result<(), HarnessError> {
        match &self.backing {
            Backing::Db(_) => {
                self.forgetting
                    .lock()
                    .map_err(poisoned)?
                    .insert(name.to_owned());
                Ok(())
            }
            Backing::Memory(_) => self.forget(name),
        }
    }

    /// Commits the forgetting of `name` that [`State::forget_later`] began, if it is pending.
    pub fn forget_pending(&self, name: &str) -> Result<(), HarnessError> {
        let pending = self.forgetting.lock().map_err(poisoned)?.contains(name);
        if pending {
            self.forget(name)?;
        }
        Ok(())
    }

    /// Commits every pending forgetting (a daemon that stops).
    pub fn forget_all_pending(&self) -> Result<(), HarnessError> {
        let pending: Vec<String> = self
            .forgetting
            .lock()
            .map_err(poisoned)?
            .iter()
            .cloned()
            .collect();
        pending.iter().try_for_each(|name| self.forget(name))
    }

    /// Whether the entry `key` of table `table` belongs to a cell whose forgetting is pending.
    fn hidden(&self, table: &str, key: &str) -> bool {
        self.forgetting
            .lock()
            .is_ok_and(|forgetting| among(&forgetting, table, key))
    }

    pub fn get(&self, name: &str) -> Result<Option<CellEntry>, HarnessError> {
        self.load(CELLS, name)?
            .map(|text| serde_json::from_str(&text).map_err(db_error))
            .transpose()
    }

    pub fn all(&self) -> Result<Vec<CellEntry>, HarnessError> {
        self.load_all(CELLS)?
            .iter()
            .map(|text| serde_json::from_str(text).map_err(db_error))
            .collect()
    }

    /// Keeps a standing grant across restarts (one of a cell until the cell is removed).
    pub fn put_grant(&self, grant: &Grant) -> Result<(), HarnessError> {
        let json = serde_json::to_string(grant).map_err(db_error)?;
        let key = match &grant.cell {
            None => grant.key().to_owned(),
            Some(cell) => format!("cell {cell} {}", grant.key()),
        };
        self.store(GRANTS, &key, Some(&json))
    }

    /// Forgets the grants limited to a cell (it was removed; a new cell of its name starts
    /// with none).
    pub fn forget_grants_of(&self, name: &str) -> Result<(), HarnessError> {
        let prefix = format!("cell {name} ");
        self.keep_only(GRANTS, |key| !key.starts_with(&prefix))
    }

    pub fn grants(&self) -> Result<Vec<Grant>, HarnessError> {
        self.load_all(GRANTS)?
            .iter()
            .map(|text| serde_json::from_str(text).map_err(db_error))
            .collect()
    }
}

/// Whether `table` has a key that starts with `prefix`.
fn holds_prefix<V: redb::Value + 'static>(
    table: &impl redb::ReadableTable<&'static str, V>,
    prefix: &str,
) -> Result<bool, HarnessError> {
    let mut after = table.range(prefix..).map_err(db_error)?;
    Ok(match after.next() {
        Some(first) => first.map_err(db_error)?.0.value().starts_with(prefix),
        None => false,
    })
}

/// Notes of running processes, so that a new daemon can journal the ones a crash cut: an
/// append-only file of `+ID JSON` and `-ID` lines, written without fsync (each start is in the
/// journal already). The page cache keeps it through a crash of the daemon, not a power cut.
#[derive(Debug)]
pub struct RunningLog {
    /// None: a harness whose processes cannot outlive it (they are its own children).
    file: Option<std::sync::Mutex<std::fs::File>>,
}

impl RunningLog {
    /// Opens the log and returns the processes it still lists (those of a daemon that is gone),
    /// then starts it afresh.
    pub fn open(path: &Path) -> Result<(Self, Vec<(u64, serde_json::Value)>), HarnessError> {
        let io = |e: std::io::Error| {
            HarnessError::from(CellFailure::Core(format!(
                "the running-process log {}: {e}",
                path.display()
            )))
        };
        let mut running = std::collections::BTreeMap::new();
        if let Ok(text) = std::fs::read_to_string(path) {
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix('+') {
                    let (id, note) = rest.split_once(' ').unwrap_or((rest, "null"));
                    if let Ok(id) = id.parse::<u64>() {
                        running.insert(id, serde_json::from_str(note).unwrap_or_default());
                    }
                } else if let Some(id) = line.strip_prefix('-').and_then(|i| i.parse().ok()) {
                    running.remove(&id);
                }
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)
            .map_err(io)?;
        drop(file);
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io)?;
        Ok((
            Self {
                file: Some(std::sync::Mutex::new(file)),
            },
            running.into_iter().collect(),
        ))
    }

    /// No log.
    pub fn none() -> Self {
        Self { file: None }
    }

    fn write(&self, line: String) {
        use std::io::Write as _;
        if let Some(Ok(mut file)) = self.file.as_ref().map(|f| f.lock()) {
            let _ = file.write_all(line.as_bytes());
        }
    }

    pub fn put(&self, id: u64, note: &serde_json::Value) {
        self.write(format!("+{id} {note}\n"));
    }

    pub fn remove(&self, id: u64) {
        self.write(format!("-{id}\n"));
    }
}

/// What the journal's newest entries say that the database may not have yet, after a crash.
#[derive(Debug, Default)]
pub struct JournalTail {
    /// How far each cell's egress record was copied: a crash between journaling a batch of
    /// decisions and noting its end in the database leaves the end only in the journal.
    pub record_ends: std::collections::HashMap<String, u64>,
    /// The cells whose latest lifecycle entry is their delete: a delete answers before the
    /// database forgets the cell (see [`State::forget_later`]).
    pub deleted: std::collections::HashSet<String>,
}

/// Reads the last `window` bytes of the journal's newest segments (see [`JournalTail`]); a
/// cell made again within them starts over.
pub fn journal_tail(journal: &Path, window: u64) -> JournalTail {
    use std::io::{Read as _, Seek as _};
    let mut ends = std::collections::HashMap::new();
    let mut deleted = std::collections::HashSet::new();
    let Ok(segments) = warden_journal::segments(journal) else {
        return JournalTail::default();
    };
    // The newest segments, as many as the window reaches, oldest of them first.
    let mut picked = Vec::new();
    let mut left = window;
    for path in segments.iter().rev() {
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        picked.push((path.clone(), size.saturating_sub(left)));
        left = left.saturating_sub(size);
        if left == 0 {
            break;
        }
    }
    for (path, from) in picked.into_iter().rev() {
        let Ok(mut file) = std::fs::File::open(&path) else {
            continue;
        };
        let mut text = Vec::new();
        if file.seek(std::io::SeekFrom::Start(from)).is_err()
            || file.read_to_end(&mut text).is_err()
        {
            continue;
        }
        let mut lines = text.split(|b| *b == b'\n');
        if from > 0 {
            lines.next(); // a line cut by the window
        }
        for line in lines {
            let Ok(entry) = serde_json::from_slice::<warden_journal::Entry>(line) else {
                continue;
            };
            let Some(cell) = entry.cell else { continue };
            match entry.kind.as_str() {
                "cell.create" => {
                    ends.remove(&cell);
                    deleted.remove(&cell);
                }
                "cell.delete" => {
                    deleted.insert(cell);
                }
                "net.decision" => {
                    if let Some(end) = entry.data["record_end"].as_u64() {
                        let known = ends.entry(cell).or_insert(0);
                        *known = (*known).max(end);
                    }
                }
                _ => {}
            }
        }
    }
    JournalTail {
        record_ends: ends,
        deleted,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn entry(name: &str) -> CellEntry {
        CellEntry {
            paused: false,
            name: name.to_owned(),
            created_ms: 7,
            policy: PolicySource::Preset("default".to_owned()),
            workspace: None,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            ended: None,
            replaced: None,
            tier: None,
            preset: None,
            run: false,
        }
    }

    /// The database and the maps keep the same things the same way.
    #[test]
    fn both_backings_keep_cells_grants_offsets_and_questions_alike() {
        let dir = tempfile::tempdir().unwrap();
        for state in [
            State::open(&dir.path().join("s.redb")).unwrap(),
            State::in_memory(),
        ] {
            state.put(&entry("a")).unwrap();
            state.put(&entry("b")).unwrap();
            assert_eq!(state.get("a").unwrap().unwrap().created_ms, 7);
            assert_eq!(state.all().unwrap().len(), 2);
            state.remove("a").unwrap();
            assert!(state.get("a").unwrap().is_none());
            assert_eq!(state.record_offset("b").unwrap(), 0);
            state.set_record_offset("b", Some(42)).unwrap();
            assert_eq!(state.record_offset("b").unwrap(), 42);
            state.set_record_offset("b", None).unwrap();
            assert_eq!(state.record_offset("b").unwrap(), 0);
            state.set_question_id("b", 1, 2, Some(9)).unwrap();
            state.set_question_id("c", 1, 2, Some(10)).unwrap();
            assert_eq!(state.question_id("b", 1, 2).unwrap(), Some(9));
            state.forget_questions("b").unwrap();
            assert_eq!(state.question_id("b", 1, 2).unwrap(), None);
            assert_eq!(state.question_id("c", 1, 2).unwrap(), Some(10));
            let grant = Grant {
                cell: Some("b".to_owned()),
                request: "r".to_owned(),
                key: None,
                by: "t".to_owned(),
            };
            state.put_grant(&grant).unwrap();
            assert_eq!(state.grants().unwrap(), vec![grant]);
            state.forget_grants_of("b").unwrap();
            assert!(state.grants().unwrap().is_empty());
            // A number table and a text table of the same key do not meet.
            assert_eq!(state.all().unwrap().len(), 1);
        }
    }

    /// A cell forgotten for later stays hidden from a listing whose read began before its
    /// forgetting was committed (the read sees the database as it was; the forgetting is no
    /// longer pending once committed): a deleted cell was listed so, as ended, in a test.
    #[test]
    fn a_listing_under_way_never_shows_a_cell_whose_forgetting_commits_meanwhile() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(State::open(&dir.path().join("s.redb")).unwrap());
        // Cells `gone0`, `gone1`, ... below `hidden` are forgotten (pending or committed) when
        // a listing begins: none of them may be in it.
        let (hidden, stop) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let lister = {
            let (state, hidden, stop) = (state.clone(), hidden.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut lists, mut shown) = (0, Vec::new());
                while !stop.load(Ordering::SeqCst) {
                    let before = hidden.load(Ordering::SeqCst);
                    for entry in state.all().unwrap() {
                        let round = entry.name.strip_prefix("gone").map(|n| n.parse().unwrap());
                        if round.is_some_and(|r: usize| r < before) {
                            shown.push(entry.name);
                        }
                    }
                    lists += 1;
                }
                (lists, shown)
            })
        };
        for round in 0..300 {
            let name = format!("gone{round}");
            state.put(&entry(&name)).unwrap();
            state.forget_later(&name).unwrap();
            hidden.store(round + 1, Ordering::SeqCst);
            state.forget_pending(&name).unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        let (lists, shown) = lister.join().unwrap();
        assert!(lists > 10, "the listing ran {lists} times");
        assert!(shown.is_empty(), "listed after their delete: {shown:?}");
    }

    /// A cell forgotten for later is gone at once for every reader; the database keeps it until
    /// the commit (a daemon killed before it finds it again), which writing its name again
    /// makes first.
    #[test]
    fn a_cell_forgotten_for_later_is_hidden_at_once_and_gone_from_the_disk_once_committed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let grant = |cell: &str| Grant {
            cell: Some(cell.to_owned()),
            request: "r".to_owned(),
            key: None,
            by: "t".to_owned(),
        };
        {
            let state = State::open(&path).unwrap();
            for name in ["a", "b", "ab"] {
                state.put(&entry(name)).unwrap();
                state.set_record_offset(name, Some(5)).unwrap();
                state.set_question_id(name, 1, 2, Some(9)).unwrap();
                state.put_grant(&grant(name)).unwrap();
            }
            state.forget_later("a").unwrap();
            assert!(state.get("a").unwrap().is_none());
            let names = |state: &State| -> Vec<String> {
                state.all().unwrap().into_iter().map(|e| e.name).collect()
            };
            assert_eq!(names(&state), ["ab", "b"]);
            assert_eq!(state.record_offset("a").unwrap(), 0);
            assert_eq!(state.question_id("a", 1, 2).unwrap(), None);
            assert_eq!(state.grants().unwrap(), vec![grant("ab"), grant("b")]);
            assert_eq!(state.record_offset("ab").unwrap(), 5);
            state.forget_later("b").unwrap();
            // Dropped without the commits: a daemon killed.
        }
        {
            let state = State::open(&path).unwrap();
            assert_eq!(state.all().unwrap().len(), 3, "lost before its commit");
            state.forget_later("a").unwrap();
            state.forget_later("b").unwrap();
            state.forget_pending("a").unwrap();
            // A new cell of a name being forgotten: the old one's forgetting comes first.
            let mut new = entry("b");
            new.created_ms = 8;
            state.put_new(&new).unwrap();
            assert_eq!(state.get("b").unwrap().unwrap().created_ms, 8);
            assert_eq!(state.record_offset("b").unwrap(), 0);
            assert_eq!(state.question_id("b", 1, 2).unwrap(), None);
        }
        let state = State::open(&path).unwrap();
        assert!(state.get("a").unwrap().is_none());
        assert_eq!(state.get("b").unwrap().unwrap().created_ms, 8);
        assert_eq!(state.grants().unwrap(), vec![grant("ab")]);
        // In memory, forgetting for later is forgetting.
        let memory = State::in_memory();
        memory.put(&entry("a")).unwrap();
        memory.forget_later("a").unwrap();
        assert!(memory.get("a").unwrap().is_none());
    }
}
