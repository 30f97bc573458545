//! `ask` rules: a connection that an ask rule matches is held until a person answers. The
//! warden writes each question as `ID.json` in the cell's approvals folder and tells its
//! terminal; `warden approve NAME ID` or `warden deny NAME ID` drops `ID.answer` beside it. With
//! no answer within the policy's `approvals.timeout`, `approvals.on_timeout` decides.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How often a held connection looks for its answer.
const POLL: Duration = Duration::from_millis(25);

/// A question waiting for its answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Question {
    pub id: u64,
    /// What the cell wants: `connect pypi.org:443`, `GET pypi.org:443/simple/`.
    pub request: String,
    /// Where to: `host:port` (what a standing grant of this question covers).
    #[serde(default)]
    pub destination: String,
    /// The ask rule that matched.
    pub rule: String,
    /// Seconds since the epoch when the question was asked.
    pub asked_at: u64,
    /// Seconds the question waits before `approvals.on_timeout` decides.
    pub timeout_s: u64,
}

/// The questions of one cell, and how long they wait.
pub struct Approvals {
    dir: PathBuf,
    timeout: Duration,
    on_timeout_allow: bool,
    next: AtomicU64,
    notify: Box<dyn Fn(&Question) + Send + Sync>,
}

impl std::fmt::Debug for Approvals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Approvals")
            .field("dir", &self.dir)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("cell `{name}` has no open question {id}; `warden approvals {name}` lists them")]
    NoQuestion { name: String, id: u64 },
    #[error("answering question {id} of cell `{name}`: {source}")]
    Io {
        name: String,
        id: u64,
        source: std::io::Error,
    },
}

impl Approvals {
    /// Questions go to `dir` (created, emptied of questions a previous run left); `notify` tells
    /// a person that one is waiting.
    pub fn new(
        dir: &Path,
        timeout: Duration,
        on_timeout_allow: bool,
        notify: impl Fn(&Question) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        for entry in std::fs::read_dir(dir)?.flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        Ok(Self {
            dir: dir.to_owned(),
            timeout,
            on_timeout_allow,
            next: AtomicU64::new(1),
            notify: Box::new(notify),
        })
    }

    /// Asks about `request` and waits for the answer: whether it is allowed, and why.
    pub(crate) fn ask(&self, request: String, destination: String, rule: &str) -> (bool, String) {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let question = Question {
            id,
            request,
            destination,
            rule: rule.to_owned(),
            asked_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            timeout_s: self.timeout.as_secs(),
        };
        let (asked, answer) = (question_file(&self.dir, id), answer_file(&self.dir, id));
        let written = serde_json::to_vec(&question)
            .map_err(std::io::Error::other)
            .and_then(|json| write_atomically(&asked, &json));
        if let Err(e) = written {
            return (false, format!("the question could not be asked: {e}"));
        }
        (self.notify)(&question);
        let deadline = Instant::now() + self.timeout;
        let verdict = loop {
            if let Ok(text) = std::fs::read_to_string(&answer) {
                break match text.trim() {
                    "allow" => (true, format!("approved (question {id})")),
                    _ => (false, format!("denied by a person (question {id})")),
                };
            }
            if Instant::now() >= deadline {
                let outcome = if self.on_timeout_allow {
                    "allow"
                } else {
                    "deny"
                };
                break (
                    self.on_timeout_allow,
                    format!(
                        "no answer to question {id} within {} s (approvals.on_timeout: {outcome})",
                        self.timeout.as_secs()
                    ),
                );
            }
            std::thread::sleep(POLL);
        };
        let _ = std::fs::remove_file(&asked);
        let _ = std::fs::remove_file(&answer);
        verdict
    }
}

/// The questions waiting in `dir`, oldest first.
pub fn pending(dir: &Path) -> Vec<Question> {
    let mut questions: Vec<Question> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                .filter_map(|e| std::fs::read(e.path()).ok())
                .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
                .collect()
        })
        .unwrap_or_default();
    questions.sort_by_key(|q| q.id);
    questions
}

/// Answers question `id` of cell `name`, whose questions are in `dir`.
pub fn answer(dir: &Path, name: &str, id: u64, allow: bool) -> Result<(), AnswerError> {
    if !question_file(dir, id).exists() {
        return Err(AnswerError::NoQuestion {
            name: name.to_owned(),
            id,
        });
    }
    let text: &[u8] = if allow { b"allow" } else { b"deny" };
    write_atomically(&answer_file(dir, id), text).map_err(|source| AnswerError::Io {
        name: name.to_owned(),
        id,
        source,
    })
}

fn question_file(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id}.json"))
}

fn answer_file(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id}.answer"))
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // `ID.json.tmp`, `ID.answer.tmp`: the question and its answer never share a temporary name.
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
