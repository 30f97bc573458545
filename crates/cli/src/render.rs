//! Text from a cell, made safe for a person's terminal. What a cell writes (file contents,
//! names, link targets, TLS server names, request paths) is printed by `diff`, `net`, `replay`
//! and the lists; a control character in it could move the cursor, erase a line or recolour
//! one, so that a DENY reads as an allow. Every such character is shown as an escape instead.

use std::borrow::Cow;

/// `text` with every character that could steer a terminal, or hide or reorder what it shows,
/// written as `\u{..}` (tabs kept).
pub fn safe(text: &str) -> Cow<'_, str> {
    warden_protocol::text::escaped(text, steers)
}

/// An error and its causes, as `{:#}` writes them (`: ` between), each said once: a message
/// that already ends with its cause's text (an error type that quotes its source) is not
/// followed by that text again.
pub fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let said = cause.to_string();
        if text.ends_with(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

/// A multi-line text (a patch) made safe line by line: its line breaks stay breaks.
pub fn safe_lines(text: &str) -> String {
    text.split_inclusive('\n')
        .map(|line| match line.strip_suffix('\n') {
            Some(body) => format!("{}\n", safe(body)),
            None => safe(line).into_owned(),
        })
        .collect()
}

/// What `warden_protocol::text::hides`, but tabs.
fn steers(c: char) -> bool {
    c != '\t' && warden_protocol::text::hides(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_could_steer_a_terminal_is_escaped() {
        assert_eq!(safe("plain\ttext"), "plain\ttext");
        assert_eq!(safe("a\x1b[2Kb"), "a\\u{1b}[2Kb");
        assert_eq!(safe("x\ry"), "x\\u{d}y");
        assert_eq!(safe("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(safe("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
        assert_eq!(safe("README.md\u{200b}"), "README.md\\u{200b}");
        assert_eq!(safe_lines("+a\r\n-b\x08\n"), "+a\\u{d}\n-b\\u{8}\n");
    }

    #[test]
    fn an_error_that_quotes_its_cause_is_not_followed_by_it_again() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot read policy p.yaml: {source}")]
        struct Quoting {
            source: std::io::Error,
        }
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let err = anyhow::Error::new(Quoting { source: io() });
        assert_eq!(error_text(&err), "cannot read policy p.yaml: no such file");
        // A cause the message does not quote is still said, after it.
        let err = anyhow::Error::new(io()).context("reading the plan");
        assert_eq!(error_text(&err), "reading the plan: no such file");
        assert_eq!(error_text(&err), format!("{err:#}"));
    }
}
