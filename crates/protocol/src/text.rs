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

#[cfg(test)]
mod tests {
    use super::*;

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
