//! The daemon's embedded state: which cells it made and with what, kept in redb so that a new
//! daemon knows them after a crash of the old one.

use std::collections::BTreeMap;
use std::path::Path;

use redb::{Database, ReadableTable as _, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::HarnessError;

const CELLS: TableDefinition<&str, &str> = TableDefinition::new("cells");
const GRANTS: TableDefinition<&str, &str> = TableDefinition::new("grants");
/// Processes started and not yet ended, so that a new daemon can journal the ones a crash cut.
const RUNNING: TableDefinition<u64, &str> = TableDefinition::new("running");

/// A standing approval: the same request is approved without asking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The cell it is limited to; `None` for every cell (scope `always`).
    pub cell: Option<String>,
    pub request: String,
    pub by: String,
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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicySource {
    Preset(String),
    Yaml(String),
}

#[derive(Debug)]
pub struct State {
    db: Database,
}

fn db_error(err: impl std::fmt::Display) -> HarnessError {
    HarnessError::internal(format!("the daemon's state database: {err}"))
}

impl State {
    pub fn open(path: &Path) -> Result<Self, HarnessError> {
        let db = Database::create(path).map_err(|e| {
            HarnessError::internal(format!(
                "opening the state database {}: {e}",
                path.display()
            ))
        })?;
        let txn = db.begin_write().map_err(db_error)?;
        txn.open_table(CELLS).map_err(db_error)?;
        txn.open_table(GRANTS).map_err(db_error)?;
        txn.open_table(RUNNING).map_err(db_error)?;
        txn.commit().map_err(db_error)?;
        Ok(Self { db })
    }

    pub fn put(&self, entry: &CellEntry) -> Result<(), HarnessError> {
        let json = serde_json::to_string(entry).map_err(db_error)?;
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut table = txn.open_table(CELLS).map_err(db_error)?;
            table
                .insert(entry.name.as_str(), json.as_str())
                .map_err(db_error)?;
        }
        txn.commit().map_err(db_error)
    }

    pub fn remove(&self, name: &str) -> Result<(), HarnessError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut table = txn.open_table(CELLS).map_err(db_error)?;
            table.remove(name).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)
    }

    pub fn get(&self, name: &str) -> Result<Option<CellEntry>, HarnessError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(CELLS).map_err(db_error)?;
        let Some(value) = table.get(name).map_err(db_error)? else {
            return Ok(None);
        };
        serde_json::from_str(value.value())
            .map(Some)
            .map_err(db_error)
    }

    pub fn all(&self) -> Result<Vec<CellEntry>, HarnessError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(CELLS).map_err(db_error)?;
        let mut out = Vec::new();
        for item in table.iter().map_err(db_error)? {
            let (_, value) = item.map_err(db_error)?;
            out.push(serde_json::from_str(value.value()).map_err(db_error)?);
        }
        Ok(out)
    }

    /// Keeps a scope-`always` grant across restarts.
    pub fn put_grant(&self, grant: &Grant) -> Result<(), HarnessError> {
        let json = serde_json::to_string(grant).map_err(db_error)?;
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut table = txn.open_table(GRANTS).map_err(db_error)?;
            table
                .insert(grant.request.as_str(), json.as_str())
                .map_err(db_error)?;
        }
        txn.commit().map_err(db_error)
    }

    pub fn grants(&self) -> Result<Vec<Grant>, HarnessError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(GRANTS).map_err(db_error)?;
        let mut out = Vec::new();
        for item in table.iter().map_err(db_error)? {
            let (_, value) = item.map_err(db_error)?;
            out.push(serde_json::from_str(value.value()).map_err(db_error)?);
        }
        Ok(out)
    }

    /// Notes a running process. Not synced on its own (the journal has its start already): a
    /// crash may lose the note, and then only the `exec.lost` entry.
    pub fn put_running(&self, id: u64, note: &serde_json::Value) -> Result<(), HarnessError> {
        let json = note.to_string();
        let mut txn = self.db.begin_write().map_err(db_error)?;
        txn.set_durability(redb::Durability::Eventual);
        {
            let mut table = txn.open_table(RUNNING).map_err(db_error)?;
            table.insert(id, json.as_str()).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)
    }

    pub fn remove_running(&self, id: u64) -> Result<(), HarnessError> {
        let mut txn = self.db.begin_write().map_err(db_error)?;
        txn.set_durability(redb::Durability::Eventual);
        {
            let mut table = txn.open_table(RUNNING).map_err(db_error)?;
            table.remove(id).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)
    }

    /// Takes every note of a running process (those of a daemon that is gone).
    pub fn take_running(&self) -> Result<Vec<(u64, serde_json::Value)>, HarnessError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let mut out = Vec::new();
        {
            let mut table = txn.open_table(RUNNING).map_err(db_error)?;
            for item in table.iter().map_err(db_error)? {
                let (key, value) = item.map_err(db_error)?;
                out.push((
                    key.value(),
                    serde_json::from_str(value.value()).unwrap_or_default(),
                ));
            }
            table.retain(|_, _| false).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)?;
        Ok(out)
    }
}
