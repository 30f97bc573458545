//! `warden audit verify`: proves the chain and every checkpoint signature.

use std::fs::File;
use std::io::{self, BufRead as _, BufReader};
use std::path::{Path, PathBuf};

use crate::entry::CHECKPOINT;
use crate::entry::{Entry, GENESIS};
use crate::keys::{self, PUBLIC_FILE};
use crate::ring::{RING_FILE, Ring};
use crate::writer::{Receipt, check_line, ring_continuation};

/// What a successful verification saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The first entry verified: 1, unless the oldest segments were archived or removed.
    pub first_seq: u64,
    /// Segment files read, oldest first.
    pub segments: usize,
    pub entries: u64,
    pub checkpoints: u64,
    pub last_seq: u64,
    pub head: String,
    /// The public key the checkpoints were checked against.
    pub key: String,
    /// Entries after the last checkpoint (chained, not yet signed).
    pub unsigned_tail: u64,
    /// Bytes of a torn last line (a write cut by a crash, never acknowledged: the journal's
    /// ring holds no entry from there on that continues the chain, else `verify` fails with
    /// `VerifyError::Missing`).
    pub torn_bytes: u64,
}

impl Report {
    /// How the chain read ends before `written`, the newest entry a running writer had
    /// written (`Journal::written_head`) when the read began; none where it ends there or
    /// beyond it (another process may have appended since).
    pub fn behind(&self, written: &Receipt) -> Option<String> {
        if self.last_seq < written.seq {
            Some(format!(
                "the journal's files end at entry {} but the running writer had written up to entry {}: entries it wrote are missing from them",
                self.last_seq, written.seq
            ))
        } else if self.last_seq == written.seq && self.head != written.hash {
            Some(format!(
                "the journal's files end at entry {}, but not at the one the running writer wrote with that number (another hash)",
                self.last_seq
            ))
        } else {
            None
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "no public key to check checkpoints with: {path} is missing or not a hex ed25519 key (pass --key)"
    )]
    NoKey { path: PathBuf },
    #[error("entry {seq} ({file} line {line}) is bad: {reason}")]
    Bad {
        /// The segment file's name.
        file: String,
        line: u64,
        /// The entry's sequence number as it should be.
        seq: u64,
        reason: String,
    },
    #[error(
        "{file} lacks {count} acknowledged entries ({first} to {last}) that the journal's ring ({RING_FILE}) holds as written past its end, after entry {after}{torn}: they were cut from it (from outside, or by a crash of the host before the journal was next opened); the journal's next open puts back what the ring holds, or restore the file from a backup"
    )]
    Missing {
        /// The active segment's name.
        file: String,
        /// The entry the segment's complete lines end with.
        after: u64,
        count: u64,
        first: u64,
        last: u64,
        /// What stands in the segment after `after`, in words (empty: nothing).
        torn: String,
    },
}

/// Verifies the journal in `dir`, every segment in chain order; `key` (hex) overrides the
/// public key kept there.
pub fn verify(dir: &Path, key: Option<&str>) -> Result<Report, VerifyError> {
    let key_text = match key {
        Some(k) => k.to_owned(),
        None => {
            let pub_path = dir.join(PUBLIC_FILE);
            std::fs::read_to_string(&pub_path).map_err(|_| VerifyError::NoKey { path: pub_path })?
        }
    };
    let public = keys::parse_public(&key_text).ok_or_else(|| VerifyError::NoKey {
        path: dir.join(PUBLIC_FILE),
    })?;
    let key_hex = key_text.trim().to_owned();
    let files = crate::segments::segments(dir).map_err(|source| VerifyError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if files.is_empty() {
        return Err(VerifyError::Io {
            path: dir.join(crate::segments::JOURNAL_FILE),
            source: io::Error::from(io::ErrorKind::NotFound),
        });
    }
    let mut report = Report {
        first_seq: 0,
        segments: files.len(),
        entries: 0,
        checkpoints: 0,
        last_seq: 0,
        head: GENESIS.to_owned(),
        key: key_hex.clone(),
        unsigned_tail: 0,
        torn_bytes: 0,
    };
    let mut active = None;
    for (index, path) in files.iter().enumerate() {
        let last_file = index + 1 == files.len();
        let file = File::open(path).map_err(|source| VerifyError::Io {
            path: path.clone(),
            source,
        })?;
        let end = verify_segment(path, &file, last_file, &public, &key_hex, &mut report)?;
        if last_file && path.ends_with(crate::segments::JOURNAL_FILE) {
            active = Some((path, file, end));
        }
    }
    check_ring(dir, active, &report)?;
    Ok(report)
}

/// Fails where the ring holds, past the end of the active segment's complete lines, entries
/// that continue the chain: entries written and acknowledged that the segment lacks (a torn
/// last line there is then not a write that was never acknowledged). `active`: the active
/// segment as read, and where its complete lines end (none: there is no active segment, and
/// the ring is read from the start of one).
fn check_ring(
    dir: &Path,
    active: Option<(&PathBuf, File, u64)>,
    report: &Report,
) -> Result<(), VerifyError> {
    let ring_path = dir.join(RING_FILE);
    let ring_io = |source| VerifyError::Io {
        path: ring_path.clone(),
        source,
    };
    let Some(ring) = Ring::open_to_read(dir).map_err(ring_io)? else {
        return Ok(());
    };
    let end = active.as_ref().map_or(0, |(_, _, end)| *end);
    let found = ring_continuation(&ring, end, report.last_seq, &report.head).map_err(ring_io)?;
    if found.count == 0 {
        return Ok(());
    }
    // A writer appends to the segment before it copies to the ring: entries appended since
    // the segment was read are in it now, and are not missing.
    let mut now = vec![0u8; found.bytes.len()];
    let mut have = 0;
    if let Some((path, file, _)) = &active {
        use std::os::unix::fs::FileExt as _;
        while have < now.len() {
            match file.read_at(&mut now[have..], end + have as u64) {
                Ok(0) => break,
                Ok(n) => have += n,
                Err(source) => {
                    return Err(VerifyError::Io {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
        }
    }
    let same = found
        .bytes
        .iter()
        .zip(&now[..have])
        .take_while(|(a, b)| a == b)
        .count();
    let present = found.bytes[..same].iter().filter(|b| **b == b'\n').count() as u64;
    if present == found.count {
        return Ok(());
    }
    // What stands in the segment after the entry it ends with, where none came since.
    let torn = match (present, report.torn_bytes) {
        (0, 0) if active.is_none() => " (there is no active segment)".to_owned(),
        (0, n) if n > 0 => format!(
            ", where it ends in a partial line of {n} bytes that is not a write cut by a crash and never acknowledged"
        ),
        _ => String::new(),
    };
    let after = report.last_seq + present;
    let count = found.count - present;
    Err(VerifyError::Missing {
        file: crate::segments::JOURNAL_FILE.to_owned(),
        after,
        count,
        first: after + 1,
        last: after + count,
        torn,
    })
}

/// Verifies one segment, read from `file` (at `path`), on from `report`; how many bytes its
/// complete lines hold.
fn verify_segment(
    path: &Path,
    file: &File,
    last_file: bool,
    public: &ed25519_dalek::VerifyingKey,
    key_hex: &str,
    report: &mut Report,
) -> Result<u64, VerifyError> {
    let io = |source| VerifyError::Io {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut number = 0u64;
    let mut complete = 0u64;
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(io)?;
        if read == 0 {
            break;
        }
        number += 1;
        // An error about this line, naming the entry that was due there.
        let bad = |seq: u64| {
            let file = name.clone();
            move |reason: String| VerifyError::Bad {
                file: file.clone(),
                line: number,
                seq,
                reason,
            }
        };
        let expected_seq = report.last_seq + 1;
        if line.last() != Some(&b'\n') {
            // Only the very last line can be torn, and only if nothing follows it.
            if !last_file {
                return Err(bad(expected_seq)(
                    "a closed segment ends in a partial line (it was cut or changed)".to_owned(),
                ));
            }
            report.torn_bytes = line.len() as u64;
            break;
        }
        let entry = check_line(&line[..line.len() - 1]).map_err(bad(expected_seq))?;
        if number == 1 {
            // A closed segment is named after its first entry; the first segment of all starts
            // the chain, unless it is a closed one whose elders were archived or removed.
            let due = crate::segments::segment_first_seq(path).unwrap_or(expected_seq);
            if entry.seq != due {
                return Err(bad(expected_seq)(format!(
                    "the segment's first entry is {} where {due} was due (entries were removed)",
                    entry.seq
                )));
            }
            if report.entries == 0 {
                report.first_seq = entry.seq;
                if entry.seq > 1 {
                    report.last_seq = entry.seq - 1;
                    report.head = entry.prev.clone();
                }
            }
        }
        let expected_seq = report.last_seq + 1;
        let bad = bad(expected_seq);
        if entry.seq != expected_seq {
            return Err(bad(format!(
                "its sequence number is {} where {expected_seq} was due (entries were removed or reordered)",
                entry.seq
            )));
        }
        if entry.prev != report.head {
            return Err(bad(
                "it does not follow the entry before it (the chain is broken)".to_owned(),
            ));
        }
        if entry.kind == CHECKPOINT {
            check_checkpoint(&entry, public, key_hex, report).map_err(bad)?;
            report.checkpoints += 1;
            report.unsigned_tail = 0;
        } else {
            report.unsigned_tail += 1;
        }
        report.entries += 1;
        report.last_seq = entry.seq;
        report.head = entry.hash;
        complete += read as u64;
    }
    Ok(complete)
}

fn check_checkpoint(
    entry: &Entry,
    public: &ed25519_dalek::VerifyingKey,
    key_hex: &str,
    report: &Report,
) -> Result<(), String> {
    let field = |name: &str| entry.data.get(name);
    let head_seq = field("head_seq").and_then(|v| v.as_u64());
    let head = field("head").and_then(|v| v.as_str());
    let key = field("key").and_then(|v| v.as_str());
    let signature = field("signature").and_then(|v| v.as_str());
    let (Some(head_seq), Some(head), Some(key), Some(signature)) = (head_seq, head, key, signature)
    else {
        return Err("a checkpoint without head_seq, head, key and signature".to_owned());
    };
    if head_seq != report.last_seq || head != report.head {
        return Err("a checkpoint that does not sign the entry before it".to_owned());
    }
    if !key.eq_ignore_ascii_case(key_hex) {
        return Err(format!(
            "a checkpoint signed by key {key}, not by the journal's key {key_hex}"
        ));
    }
    if !keys::check(public, head_seq, head, signature) {
        return Err("a checkpoint whose signature does not verify".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{JOURNAL_FILE, Journal};
    use serde_json::json;

    fn journal_with(n: u64) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        for i in 0..n {
            journal
                .append(Some("c"), "exec.exit", json!({"i": i, "status": 0}))
                .unwrap();
        }
        journal.close();
        let path = dir.path().join(JOURNAL_FILE);
        (dir, path)
    }

    #[test]
    fn flipping_any_single_byte_is_caught_and_named() {
        let (_dir, path) = journal_with(5);
        let original = std::fs::read(&path).unwrap();
        let dir = path.parent().unwrap().to_path_buf();
        let report = verify(&dir, None).unwrap();
        assert_eq!(report.entries, 6);
        // Flip one bit of every byte position in turn (newlines excepted: a flipped newline
        // merges or splits lines, caught the same way but not attributable to one entry).
        for at in 0..original.len() {
            if original[at] == b'\n' {
                continue;
            }
            let mut bytes = original.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&path, &bytes).unwrap();
            let line_of_byte = original[..at].iter().filter(|b| **b == b'\n').count() as u64 + 1;
            match verify(&dir, None) {
                Err(VerifyError::Bad { line, .. }) => assert_eq!(line, line_of_byte, "at {at}"),
                other => panic!("a flip at byte {at} was not caught: {other:?}"),
            }
        }
    }

    /// A copy of a journal (its ring with it) whose active segment lost its last lines: the
    /// ring holds them as written, so they were acknowledged, and verify fails saying so.
    #[test]
    fn acknowledged_entries_cut_from_the_segment_that_the_ring_holds_fail_the_check() {
        let (dir, path) = journal_with(6);
        let whole = std::fs::read(&path).unwrap();
        let copy = tempfile::tempdir().unwrap();
        for name in [JOURNAL_FILE, crate::RING_FILE, PUBLIC_FILE] {
            std::fs::copy(dir.path().join(name), copy.path().join(name)).unwrap();
        }
        let copied = copy.path().join(JOURNAL_FILE);
        // The last three lines cut (the closing checkpoint and two entries before it).
        let mut end = whole.len();
        for _ in 0..3 {
            end = whole[..end - 1].iter().rposition(|b| *b == b'\n').unwrap() + 1;
        }
        std::fs::write(&copied, &whole[..end]).unwrap();
        let err = verify(copy.path(), None).unwrap_err();
        assert!(
            matches!(
                err,
                VerifyError::Missing {
                    after: 4,
                    count: 3,
                    ..
                }
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("lacks 3 acknowledged entries (5 to 7)"),
            "{text}"
        );

        // The last entry changed and its newline taken off: not a torn write never
        // acknowledged, since the ring holds the entry as it was written.
        let last = &whole[whole[..whole.len() - 1]
            .iter()
            .rposition(|b| *b == b'\n')
            .unwrap()
            + 1..];
        let changed = String::from_utf8(last.to_vec())
            .unwrap()
            .replace("\"head_seq\":6", "\"head_seq\":5");
        let mut bytes = whole[..whole.len() - last.len()].to_vec();
        bytes.extend_from_slice(changed.trim_end().as_bytes());
        std::fs::write(&copied, &bytes).unwrap();
        let err = verify(copy.path(), None).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                VerifyError::Missing {
                    after: 6,
                    count: 1,
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("is not a write cut by a crash"), "{text}");

        // Whole, or with a torn line that the ring does not hold as an entry: as before.
        std::fs::write(&copied, &whole).unwrap();
        assert_eq!(verify(copy.path(), None).unwrap().last_seq, 7);
        let mut torn = whole.clone();
        torn.extend_from_slice(b"{\"seq\":8,\"time");
        std::fs::write(&copied, &torn).unwrap();
        assert_eq!(verify(copy.path(), None).unwrap().torn_bytes, 14);
    }

    #[test]
    fn a_removed_entry_and_a_rewritten_chain_are_caught() {
        let (dir, path) = journal_with(3);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let without_second = format!("{}\n{}\n", lines[0], lines[2..].join("\n"));
        std::fs::write(&path, without_second).unwrap();
        let err = verify(dir.path(), None).unwrap_err();
        assert!(
            err.to_string().contains("entry 2 (journal.jsonl line 2)"),
            "{err}"
        );

        // Rewrite the whole chain with correct hashes but without the key: the checkpoint's
        // signature no longer verifies.
        let mut prev = GENESIS.to_owned();
        let mut out = String::new();
        for line in &lines {
            let mut entry: Entry = serde_json::from_str(line).unwrap();
            if entry.seq == 2 {
                entry.data = json!({"i": 1, "status": 1});
            }
            if entry.kind == CHECKPOINT {
                entry.data["head"] = json!(prev.clone());
            }
            let sealed = Entry::seal(
                entry.seq,
                entry.time_ms,
                entry.cell,
                entry.kind,
                entry.data,
                prev,
            );
            prev = sealed.hash.clone();
            out.push_str(&String::from_utf8(sealed.to_line()).unwrap());
            out.push('\n');
        }
        std::fs::write(&path, out).unwrap();
        let err = verify(dir.path(), None).unwrap_err();
        assert!(
            err.to_string().contains("signature does not verify"),
            "{err}"
        );
        drop(dir);
    }
}
