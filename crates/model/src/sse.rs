//! Server-sent events, decoded from bytes as they arrive (the warden's own client and the
//! gateway, which sees a response in the pieces its pump moves, feed the same decoder).

/// One event: its `event:` name (if any) and its `data:` lines joined by newlines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub event: Option<String>,
    pub data: String,
}

/// Longest event kept: a stream whose event never ends is refused, not buffered forever.
pub const EVENT_LIMIT: usize = 16 << 20;

/// Turns a byte stream into events. Lines may end with LF, CRLF or CR; comments (`:`) and
/// unknown fields are skipped, as the format says.
#[derive(Debug, Default)]
pub struct Decoder {
    line: Vec<u8>,
    event: Option<String>,
    data: Option<String>,
    /// The previous byte was a CR (its LF, if one follows, ends nothing more).
    after_cr: bool,
    size: usize,
}

/// The stream broke the format's bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an event of the stream is longer than {EVENT_LIMIT} bytes")]
pub struct TooLong;

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the events they completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Event>, TooLong> {
        let mut out = Vec::new();
        for &byte in bytes {
            match byte {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.after_cr = byte == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(event) = self.line_ended(&line) {
                        out.push(event);
                    }
                }
                _ => {
                    self.after_cr = false;
                    self.line.push(byte);
                    self.size += 1;
                    if self.size > EVENT_LIMIT {
                        return Err(TooLong);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The event still open when the stream ended without its blank line, if any.
    pub fn finish(&mut self) -> Option<Event> {
        let line = std::mem::take(&mut self.line);
        if !line.is_empty() {
            self.line_ended(&line);
        }
        self.dispatch()
    }

    fn line_ended(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            return self.dispatch();
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "" => {} // a comment
            "event" => self.event = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<Event> {
        self.size = 0;
        let event = self.event.take();
        let data = self.data.take()?;
        Some(Event { event, data })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = b": keepalive\r\nevent: a\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\ndata: two\n\ndata:three\r\rid: 7\nretry: 5\n\n";
        for cut in 0..stream.len() {
            let mut decoder = Decoder::new();
            let mut events = decoder.feed(&stream[..cut]).unwrap();
            events.extend(decoder.feed(&stream[cut..]).unwrap());
            assert_eq!(
                events,
                vec![
                    Event {
                        event: Some("a".into()),
                        data: "{\"x\":\n1}".into()
                    },
                    Event {
                        event: None,
                        data: "two".into()
                    },
                    Event {
                        event: None,
                        data: "three".into()
                    },
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn an_event_without_its_blank_line_is_finished_at_the_end() {
        let mut decoder = Decoder::new();
        assert!(decoder.feed(b"data: last").unwrap().is_empty());
        assert_eq!(decoder.finish().unwrap().data, "last");
        assert_eq!(decoder.finish(), None);
    }

    #[test]
    fn an_endless_event_is_refused() {
        let mut decoder = Decoder::new();
        let chunk = vec![b'x'; 1 << 20];
        decoder.feed(b"data: ").unwrap();
        let mut result = Ok(Vec::new());
        for _ in 0..17 {
            result = decoder.feed(&chunk);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(TooLong));
    }
}
