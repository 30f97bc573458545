//! The journal read back whole, for faces that show it: pages of entries newest first (with
//! hash and link, for a timeline), and a check of the whole chain against the daemon's key.

use warden_protocol::{JournalCheck, JournalEntry, JournalPage, JournalQuery};

use super::*;

/// Entries in a page unless asked otherwise, and at most.
const PAGE: usize = 200;
const PAGE_MAX: usize = 1000;

impl Harness {
    /// A page of the journal, newest first; only the segments that can hold it are read.
    pub async fn journal_page(&self, query: JournalQuery) -> Result<JournalPage, HarnessError> {
        let limit = query.limit.unwrap_or(PAGE);
        if limit == 0 || limit > PAGE_MAX {
            return Err(HarnessError::from(HistoryError::Invalid(format!(
                "limit {limit}: a page holds 1 to {PAGE_MAX} entries; page back with `before`"
            ))));
        }
        if let (Some(since), Some(until)) = (query.since_ms, query.until_ms)
            && since > until
        {
            return Err(HarnessError::from(HistoryError::Invalid(format!(
                "since_ms {since} is after until_ms {until}: no entry can be in that window; \
                 give since_ms at or before until_ms"
            ))));
        }
        let dir = self.journal.dir().to_path_buf();
        tokio::task::spawn_blocking(move || read_page(&dir, &query, limit))
            .await
            .map_err(|e| HarnessError::from(HistoryError::Unreadable(e.to_string())))?
    }

    /// Checks every entry's hash and link and every checkpoint's signature, as `warden audit
    /// verify` does, against the key this daemon signs with.
    pub async fn check_journal(&self) -> Result<JournalCheck, HarnessError> {
        let dir = self.journal.dir().to_path_buf();
        let key = self.journal.public_key().to_owned();
        // What this daemon wrote (taken before the check reads the files): files that end
        // before it lost entries it acknowledged, however whole their chain is.
        let written = self.journal.written_head();
        tokio::task::spawn_blocking(move || match warden_journal::verify(&dir, Some(&key)) {
            Ok(report) => {
                let behind = written.as_ref().and_then(|w| report.behind(w));
                JournalCheck {
                    ok: behind.is_none(),
                    error: behind,
                    first_seq: report.first_seq,
                    last_seq: report.last_seq,
                    entries: report.entries,
                    checkpoints: report.checkpoints,
                    unsigned_tail: report.unsigned_tail,
                    head: report.head,
                    key: report.key,
                }
            }
            Err(err) => JournalCheck {
                ok: false,
                error: Some(err.to_string()),
                first_seq: 0,
                last_seq: 0,
                entries: 0,
                checkpoints: 0,
                unsigned_tail: 0,
                head: String::new(),
                key,
            },
        })
        .await
        .map_err(|e| HarnessError::from(HistoryError::Unreadable(e.to_string())))
    }
}

fn read_page(dir: &Path, query: &JournalQuery, limit: usize) -> Result<JournalPage, HarnessError> {
    let segments = warden_journal::segments(dir).map_err(|e| {
        HarnessError::from(HistoryError::Unreadable(format!(
            "listing the journal: {e}"
        )))
    })?;
    let matches = |entry: &warden_journal::Entry| {
        query.before.is_none_or(|b| entry.seq < b)
            && query
                .cell
                .as_deref()
                .is_none_or(|c| entry.cell.as_deref() == Some(c))
            && query
                .kind
                .as_deref()
                .is_none_or(|k| entry.kind.starts_with(k))
            && query.since_ms.is_none_or(|t| entry.time_ms >= t)
            && query.until_ms.is_none_or(|t| entry.time_ms < t)
    };
    let mut head_seq = 0;
    // Newest first, one more than asked for: whether an older page exists.
    let mut found: Vec<JournalEntry> = Vec::new();
    for (index, path) in segments.iter().enumerate().rev() {
        let newest_segment = index + 1 == segments.len();
        // Closed segments are named by their first entry: one that starts at or after
        // `before` holds nothing for this page.
        if !newest_segment
            && query
                .before
                .is_some_and(|b| warden_journal::segment_first_seq(path).is_some_and(|f| f >= b))
        {
            continue;
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            HarnessError::from(HistoryError::Unreadable(format!(
                "reading {}: {e}",
                path.display()
            )))
        })?;
        let mut here: Vec<JournalEntry> = Vec::new();
        for line in text.lines() {
            let Ok(entry) = serde_json::from_str::<warden_journal::Entry>(line) else {
                continue;
            };
            if newest_segment {
                head_seq = head_seq.max(entry.seq);
            }
            if matches(&entry) {
                here.push(JournalEntry {
                    seq: entry.seq,
                    time_ms: entry.time_ms,
                    cell: entry.cell,
                    kind: entry.kind,
                    data: entry.data,
                    prev: entry.prev,
                    hash: entry.hash,
                });
            }
        }
        found.extend(here.into_iter().rev().take(limit + 1 - found.len()));
        if found.len() > limit {
            break;
        }
    }
    let more = found.len() > limit;
    found.truncate(limit);
    let next_before = if more {
        found.last().map(|e| e.seq)
    } else {
        None
    };
    Ok(JournalPage {
        entries: found,
        next_before,
        head_seq,
    })
}
