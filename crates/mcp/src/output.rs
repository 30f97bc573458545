//! An output stream as a tool's answer holds it: its head and its tail, within a limit.

use std::collections::VecDeque;

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

#[cfg(test)]
mod tests {
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
}
