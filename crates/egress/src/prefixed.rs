//! A stream that gives back bytes already read before it reads on: what a connection whose
//! first bytes were looked at (to tell TLS from plain HTTP, to read its SNI) is handed on as.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

/// Reads from an already-read prefix, then from the stream; writes go to the stream. Reads
/// from the stream are made ahead, into a buffer that grows (16 KiB to 1 MiB) while they fill
/// it: rustls asks for 4 KiB at a time, which on a bulk transfer would be a system call for
/// every TLS record. Until `until`, every read waits only for what is left of that deadline.
pub(crate) struct Prefixed {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    inner: TcpStream,
    pub(crate) until: Option<Instant>,
}

impl Prefixed {
    const FIRST_AHEAD: usize = 16 * 1024;
    const MAX_AHEAD: usize = 1 << 20;

    pub(crate) fn new(early: Vec<u8>, inner: TcpStream, until: Option<Instant>) -> Self {
        let end = early.len();
        let mut buf = early;
        buf.resize(end.max(Self::FIRST_AHEAD), 0);
        Self {
            buf,
            start: 0,
            end,
            inner,
            until,
        }
    }
}

impl Read for Prefixed {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.start == self.end {
            if let Some(until) = self.until {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                self.inner.set_read_timeout(Some(left))?;
            }
            let n = match self.inner.read(&mut self.buf) {
                Err(e) if self.until.is_some() && e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                other => other?,
            };
            (self.start, self.end) = (0, n);
            if n == self.buf.len() && n < Self::MAX_AHEAD {
                self.buf.resize(n * 2, 0);
            }
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

impl Write for Prefixed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_prefixed_stream_gives_the_prefix_then_the_stream_whole_and_reads_ahead() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        let data: Vec<u8> = (0..5u32 << 20).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let feeder = std::thread::spawn(move || {
            writer.write_all(&sent).unwrap();
        });
        let mut stream = Prefixed::new(b"early bytes|".to_vec(), reader, None);
        let mut received = Vec::new();
        // rustls's way: 4 KiB at a time, and an empty read that must not wait.
        let mut chunk = [0u8; 4096];
        assert_eq!(stream.read(&mut []).unwrap(), 0);
        while received.len() < 12 + data.len() {
            let n = stream.read(&mut chunk).unwrap();
            assert!(n > 0, "the stream ended early");
            received.extend_from_slice(&chunk[..n]);
        }
        feeder.join().unwrap();
        assert_eq!(&received[..12], b"early bytes|");
        assert!(received[12..] == data[..], "the stream's bytes differ");
        assert!(
            stream.buf.len() > Prefixed::FIRST_AHEAD,
            "no read was made ahead"
        );
    }

    #[test]
    fn a_deadline_holds_for_all_reads_together() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        // A byte every 100 ms: each read is quick, all of them together are not.
        let trickle = std::thread::spawn(move || {
            for _ in 0..30 {
                if writer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let begun = Instant::now();
        let mut stream = Prefixed::new(
            Vec::new(),
            reader,
            Some(begun + std::time::Duration::from_millis(500)),
        );
        let mut byte = [0u8; 1];
        let ended = loop {
            if let Err(e) = stream.read(&mut byte) {
                break e;
            }
        };
        assert_eq!(ended.kind(), io::ErrorKind::TimedOut);
        let took = begun.elapsed();
        assert!(
            took < std::time::Duration::from_millis(900),
            "the deadline of 500 ms held for {took:?}"
        );
        drop(stream);
        let _ = trickle.join();
    }
}
