//! Text that a cell, a model or an agent wrote, made safe where a person reads it (a terminal,
//! the dashboard, an approval question): a character that could move the cursor, restyle a
//! line, reorder what follows it or hide itself is shown as an escape, `\u{..}`, instead.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` could hide, reorder or restyle what a person reads: control characters (C0, DEL,
/// C1), line and paragraph separators, bidirectional marks, embeddings, overrides and isolates,
/// and the invisible format characters (soft hyphen, zero-width space and joiners, word joiner,
/// byte order mark, interlinear annotation marks), with which `README.md` and `README.md` and
/// a zero-width space read alike.
pub fn hides(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{ad}' | '\u{61c}' | '\u{180e}' | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}')
}

/// `text` with each character for which `escape` holds written as `\u{..}` (borrowed where
/// there is none).
pub fn escaped(text: &str, escape: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(&escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if escape(c) {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// How many characters of a name or other echoed text an error message shows.
pub const ECHO_CHARS: usize = 256;

/// `text` as an error message echoes it: whole up to [`ECHO_CHARS`] characters, else its first
/// [`ECHO_CHARS`] and how long it was, so that a 100 KB name is not sent back whole.
/// Text clipped already (by a lower layer) is kept as it is.
pub fn clipped(text: &str) -> Cow<'_, str> {
    match text.char_indices().nth(ECHO_CHARS) {
        None => Cow::Borrowed(text),
        Some((at, _)) if is_clip(&text[at..]) => Cow::Borrowed(text),
        Some((at, _)) => Cow::Owned(format!("{}... ({} bytes)", &text[..at], text.len())),
    }
}

/// Whether `tail` is what [`clipped`] puts after the characters it keeps.
fn is_clip(tail: &str) -> bool {
    tail.strip_prefix("... (")
        .and_then(|rest| rest.strip_suffix(" bytes)"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// `message` with each span quoted in backticks (where messages echo what was sent: names,
/// paths, values) [`clipped`].
pub fn clip_quoted(message: &str) -> Cow<'_, str> {
    let mut spans = message.split('`');
    if !spans
        .clone()
        .skip(1)
        .step_by(2)
        .any(|s| s.chars().nth(ECHO_CHARS).is_some())
    {
        return Cow::Borrowed(message);
    }
    let mut out = String::with_capacity(message.len().min(4096));
    let mut quoted = false;
    if let Some(first) = spans.next() {
        out.push_str(first);
    }
    for span in spans {
        quoted = !quoted;
        out.push('`');
        match quoted {
            true => out.push_str(&clipped(span)),
            false => out.push_str(span),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_quoted_spans_are_clipped_and_short_ones_kept() {
        assert_eq!(clip_quoted("cell `abc` is gone"), "cell `abc` is gone");
        let long = "x".repeat(100_000);
        let message = format!("no cell named `{long}`; see `warden ps`");
        let clipped = clip_quoted(&message);
        assert_eq!(
            clipped,
            format!(
                "no cell named `{}... (100000 bytes)`; see `warden ps`",
                "x".repeat(ECHO_CHARS)
            )
        );
        // Clipped once, kept: a layer above does not clip it again.
        assert_eq!(clip_quoted(&clipped), clipped);
        // Characters, not bytes: a cut never splits one.
        let wide = "é".repeat(300);
        assert_eq!(
            super::clipped(&wide),
            format!("{}... (600 bytes)", "é".repeat(ECHO_CHARS))
        );
    }

    #[test]
    fn what_hides_or_reorders_text_is_escaped() {
        assert_eq!(escaped("plain text", hides), "plain text");
        assert_eq!(escaped("a\x1b[2Kb", hides), "a\\u{1b}[2Kb");
        assert_eq!(escaped("README.md\u{200b}", hides), "README.md\\u{200b}");
        assert_eq!(escaped("\u{feff}x\u{2028}y", hides), "\\u{feff}x\\u{2028}y");
        assert_eq!(escaped("evil\u{202e}txt", hides), "evil\\u{202e}txt");
        assert_eq!(escaped("a\tb", |c| c != '\t' && hides(c)), "a\tb");
    }
}
