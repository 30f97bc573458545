//! What a model's tools are made of, for every face that offers them (the MCP server, the
//! warden's own agent loop): a command run to its end with its output held within a limit, and
//! a file's text edited by exact replacement.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use serde::Serialize;

use crate::process::{Item, KillOnDrop, Process};
use crate::{ExecError, ExitInfo, ExitReason, FilesError, HarnessError, Stream};

/// Keeps the first and the last `limit / 2` bytes of a stream and counts what falls between.
#[derive(Debug)]
pub struct Capped {
    half: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    skipped: u64,
}

impl Capped {
    pub fn new(limit: usize) -> Self {
        Self {
            half: (limit / 2).max(1),
            head: Vec::new(),
            tail: VecDeque::new(),
            skipped: 0,
        }
    }

    pub fn push(&mut self, mut bytes: &[u8]) {
        let room = self.half - self.head.len();
        if room > 0 {
            let take = room.min(bytes.len());
            self.head.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
        self.tail.extend(bytes);
        let over = self.tail.len().saturating_sub(self.half);
        if over > 0 {
            self.tail.drain(..over);
            self.skipped += over as u64;
        }
    }

    /// The kept bytes as text (invalid UTF-8 replaced), with a line where bytes were left out.
    pub fn text(self) -> String {
        let mut text = String::from_utf8_lossy(&self.head).into_owned();
        if self.skipped > 0 {
            text.push_str(&format!("\n[... {} bytes left out ...]\n", self.skipped));
        }
        let tail: Vec<u8> = self.tail.into();
        text.push_str(&String::from_utf8_lossy(&tail));
        text
    }
}

/// A command run to its end, as a tool answers it.
#[derive(Debug, Clone, Serialize)]
pub struct Ran {
    pub exit: ExitInfo,
    /// The exit status a shell would show (128 + the signal for a signal, and so on).
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
    /// Output the warden could not keep for this reader (a flood).
    pub dropped_bytes: u64,
}

impl Ran {
    /// The result as a model reads it: how it ended, then each stream that said something.
    pub fn text(&self) -> String {
        let mut text = match self.exit.reason {
            ExitReason::Exited => format!("exit {}", self.status),
            reason => format!(
                "ended: {}{} (status {})",
                word(reason),
                self.exit
                    .message
                    .as_deref()
                    .map(|m| format!(", {m}"))
                    .unwrap_or_default(),
                self.status
            ),
        };
        for (name, stream) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            if !stream.is_empty() {
                text.push_str(&format!("\n--- {name} ---\n{stream}"));
            }
        }
        text
    }
}

/// Reads a started process to its end, keeping the head and tail of each stream within
/// `limit` and handing each piece of output to `each` as it comes (a face streams it on). When
/// `cancelled` completes first, the process is killed and the answer says so; a caller that
/// drops this future kills it too.
pub async fn run_to_end<F, Fut>(
    process: Arc<Process>,
    limit: usize,
    cancelled: impl Future<Output = ()>,
    mut each: F,
) -> Result<Ran, HarnessError>
where
    F: FnMut(Stream, &[u8]) -> Fut,
    Fut: Future<Output = ()>,
{
    let _kill = KillOnDrop(Arc::clone(&process));
    let mut streams = [Capped::new(limit), Capped::new(limit)];
    let mut dropped = 0;
    let mut cursor = crate::Cursor::start();
    let mut cancelled = std::pin::pin!(cancelled);
    let exit = loop {
        let item = tokio::select! {
            item = process.next(&mut cursor) => item,
            () = &mut cancelled => {
                return Err(HarnessError::from(ExecError::State("the call was cancelled; the command was killed".into())));
            }
        };
        match item {
            Item::Output(stream, bytes) => {
                streams[usize::from(stream == Stream::Stderr)].push(&bytes);
                each(stream, &bytes).await;
            }
            Item::Dropped(bytes) => dropped += bytes,
            Item::Exit(exit) => break exit,
        }
    };
    let [stdout, stderr] = streams;
    Ok(Ran {
        status: exit.status(),
        exit,
        stdout: stdout.text(),
        stderr: stderr.text(),
        dropped_bytes: dropped,
    })
}

/// The name serde gives a unit variant (`forbidden`, `file`, `timeout`).
pub fn word(value: impl Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The command a search runs in the cell: `grep -E` below `path`, `file:line:text` for each
/// match (its exit status 1 means no match).
pub fn search_argv(pattern: &str, path: &str, ignore_case: bool) -> Vec<String> {
    let mut argv = vec!["grep".to_owned(), "-rnIE".to_owned()];
    if ignore_case {
        argv.push("-i".to_owned());
    }
    argv.extend([
        "-e".to_owned(),
        pattern.to_owned(),
        "--".to_owned(),
        path.to_owned(),
    ]);
    argv
}

/// A directory's entries as a model reads them: kind, size and name, a line each.
pub fn listing(entries: &[crate::FileInfo]) -> String {
    entries
        .iter()
        .map(|e| format!("{:<9} {:>10} {}", word(e.kind), e.size, e.name))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` with `old` replaced by `new`: `old` must occur exactly once, unless `all`. Answers
/// the new text and how many were replaced; `path` names the file in the errors. An edit whose
/// result would be larger than a file the warden writes ([`crate::files::WRITE_LIMIT`]) is
/// refused before it is made: a one-letter `old` replaced throughout a large file by a long
/// `new` asked for gigabytes of the daemon's memory, which ended it.
pub fn edit_text(
    path: &str,
    text: &str,
    old: &str,
    new: &str,
    all: bool,
) -> Result<(String, usize), HarnessError> {
    if old.is_empty() {
        return Err(HarnessError::from(FilesError::Invalid(
            "the text to replace may not be empty".into(),
        )));
    }
    match (text.matches(old).count(), all) {
        (0, _) => Err(HarnessError::from(FilesError::Invalid(format!(
            "the text to replace does not occur in {path}; read the file and copy the text exactly"
        )))),
        (n @ 1, _) | (n, true) => {
            let size = (text.len() as u128) - (n as u128) * (old.len() as u128)
                + (n as u128) * (new.len() as u128);
            let limit = crate::files::WRITE_LIMIT;
            if size > u128::from(limit) {
                return Err(HarnessError::from(FilesError::Invalid(format!(
                    "replacing {n} occurrence(s) in {path} would make it {size} bytes, more than the {limit} a file written through the warden may have; replace fewer occurrences at a time, or change the file with a command"
                ))));
            }
            Ok((text.replace(old, new), n))
        }
        (n, false) => Err(HarnessError::from(FilesError::Invalid(format!(
            "the text to replace occurs {n} times in {path}; give more of the text around it, or replace all"
        )))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_short_stream_is_kept_whole() {
        let mut c = Capped::new(16);
        c.push(b"abc");
        c.push(b"def");
        assert_eq!(c.text(), "abcdef");
    }

    #[test]
    fn a_long_stream_keeps_its_head_and_tail_and_counts_the_rest() {
        let mut c = Capped::new(8);
        for chunk in [b"0123".as_slice(), b"456789", b"abcdef"] {
            c.push(chunk);
        }
        assert_eq!(c.text(), "0123\n[... 8 bytes left out ...]\ncdef");
    }

    #[test]
    fn an_edit_replaces_exactly_one_occurrence_unless_told_all() {
        assert_eq!(
            edit_text("f", "a b a", "b", "c", false).unwrap(),
            ("a c a".into(), 1)
        );
        assert!(
            edit_text("f", "a b a", "a", "c", false)
                .unwrap_err()
                .message
                .contains("occurs 2 times")
        );
        assert_eq!(
            edit_text("f", "a b a", "a", "c", true).unwrap(),
            ("c b c".into(), 2)
        );
        assert!(
            edit_text("f", "a", "z", "c", false)
                .unwrap_err()
                .message
                .contains("does not occur")
        );
        assert!(edit_text("f", "a", "", "c", false).is_err());
    }

    #[test]
    fn an_edit_past_the_write_limit_is_refused_before_it_is_made() {
        let text = "a".repeat(1 << 20);
        let long = "x".repeat(65);
        let refused = edit_text("big", &text, "a", &long, true).unwrap_err();
        assert!(
            refused.message.contains("1048576 occurrence(s) in big")
                && refused.message.contains("more than the 67108864"),
            "{}",
            refused.message
        );
        let (edited, n) = edit_text("big", &text, "a", &"x".repeat(64), true).unwrap();
        assert_eq!((edited.len(), n), (64 << 20, 1 << 20));
    }
}
