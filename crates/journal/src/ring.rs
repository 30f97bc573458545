//! The journal's ring: a file of fixed size, written in full when it is made, that holds a copy
//! of the newest bytes of the active segment, each at its offset in the segment modulo the
//! ring's size. An entry is made durable by an fdatasync of the ring rather than of the
//! segment: the ring's blocks are there already and its size never changes, so the disk is
//! asked for the data and a flush, where a segment that grows also needs its inode written
//! (one more round trip to the disk, each about a third of an fdatasync on a virtual disk).
//!
//! The segment itself is synced before the ring writes over bytes of it that are not on disk
//! yet (once per half a ring of entries, by the syncer when it runs), at a rotation and at the
//! close. After a crash, the segment on disk is a prefix of what was written (ext4 and btrfs
//! extend a file's size on disk only with its data): the next writer to open the journal
//! reads the ring at the segment's end and appends the entries found there that continue the
//! chain (the hashes tell a stale or torn copy from the entries that followed).
//!
//! The header, in the ring's first block, says the ring's size and how much of which segment
//! is known to be on disk (for a writer that opens the journal later: it need not sync the
//! segment before its first entry). It is written only after such a sync, so whenever it is
//! on disk it is true.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

/// The ring's file in the journal directory.
pub const RING_FILE: &str = "journal.ring";
/// Where the ring's data starts (the header has the first block to itself).
const DATA_AT: u64 = 4096;
const MAGIC: &str = "warden-journal-ring 1";

/// What the header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// The ring's size (its data; the file is one block longer).
    pub bytes: u64,
    /// The first entry of the segment that `durable` is about.
    pub segment: u64,
    /// How many bytes of that segment are on disk.
    pub durable: u64,
}

#[derive(Debug)]
pub(crate) struct Ring {
    file: File,
    bytes: u64,
}

impl Ring {
    /// Opens the ring in `dir`, making it (`bytes` long, every block written) when there is
    /// none, or the one there is not whole; `true` with a ring made now, whose header knows
    /// nothing of the segment.
    pub fn open(dir: &Path, bytes: u64) -> io::Result<(Self, Header, bool)> {
        let file = crate::segments::open_own(&dir.join(RING_FILE))?;
        let (_, len) = crate::segments::shape(&file)?;
        if let Some(header) = read_header(&file)?
            && header.bytes > 0
            && len >= DATA_AT + header.bytes
        {
            let ring = Self {
                file,
                bytes: header.bytes,
            };
            return Ok((ring, header, false));
        }
        // Made anew: the data written in full (blocks of its own that a write never has to
        // allocate), then the header, then both to the disk. A ring cut short by a crash
        // meanwhile has no header that says its size, and is made again.
        file.set_len(0)?;
        let zeros = vec![0u8; 64 * 1024];
        let mut at = DATA_AT;
        while at < DATA_AT + bytes {
            let n = (DATA_AT + bytes - at).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        let header = Header {
            bytes,
            segment: 0,
            durable: 0,
        };
        let ring = Self { file, bytes };
        ring.write_header(header)?;
        ring.file.sync_all()?;
        Ok((ring, header, true))
    }

    /// The ring in `dir` as it is, opened only to be read (for `verify`, which changes no
    /// file): none where there is none, or where it is not whole.
    pub fn open_to_read(dir: &Path) -> io::Result<Option<Self>> {
        let file = match File::open(dir.join(RING_FILE)) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        let (_, len) = crate::segments::shape(&file)?;
        Ok(read_header(&file)?
            .filter(|header| header.bytes > 0 && len >= DATA_AT + header.bytes)
            .map(|header| Self {
                file,
                bytes: header.bytes,
            }))
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Copies `data`, which starts at `offset` in the segment, to its place (`data` is at most
    /// the ring's size).
    pub fn mirror(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let at = offset % self.bytes;
        let first = ((self.bytes - at) as usize).min(data.len());
        self.file.write_all_at(&data[..first], DATA_AT + at)?;
        if first < data.len() {
            self.file.write_all_at(&data[first..], DATA_AT)?;
        }
        Ok(())
    }

    /// Up to `len` bytes as they stand at `offset` of the segment (the ring's whole size at
    /// most: beyond it, they start over).
    pub fn read(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let len = len.min(self.bytes);
        let at = offset % self.bytes;
        let first = (self.bytes - at).min(len);
        let mut out = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut out[..first as usize], DATA_AT + at)?;
        if first < len {
            self.file
                .read_exact_at(&mut out[first as usize..], DATA_AT)?;
        }
        Ok(out)
    }

    /// Takes what was copied to the disk (the ring's data and a flush: its blocks and size
    /// never change).
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// The header as the file has it now.
    pub fn header(&self) -> io::Result<Option<Header>> {
        read_header(&self.file)
    }

    /// Records that `durable` bytes of the segment whose first entry is `segment` are on disk
    /// (to be called only once they are). Goes to the disk with the ring's next sync.
    pub fn note_durable(&self, segment: u64, durable: u64) -> io::Result<()> {
        self.write_header(Header {
            bytes: self.bytes,
            segment,
            durable,
        })
    }

    fn write_header(&self, header: Header) -> io::Result<()> {
        let mut block = format!(
            "{MAGIC} bytes={} segment={} durable={}\n",
            header.bytes, header.segment, header.durable
        )
        .into_bytes();
        block.resize(512, 0);
        self.file.write_all_at(&block, 0)
    }
}

fn read_header(file: &File) -> io::Result<Option<Header>> {
    let mut block = [0u8; 512];
    let n = file.read_at(&mut block, 0)?;
    let Some(line) = block[..n]
        .split(|b| *b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
    else {
        return Ok(None);
    };
    let Some(fields) = line.strip_prefix(MAGIC) else {
        return Ok(None);
    };
    let mut header = Header {
        bytes: 0,
        segment: 0,
        durable: 0,
    };
    for field in fields.split_whitespace() {
        let (key, value) = field.split_once('=').unwrap_or((field, ""));
        let Ok(value) = value.parse::<u64>() else {
            return Ok(None);
        };
        match key {
            "bytes" => header.bytes = value,
            "segment" => header.segment = value,
            "durable" => header.durable = value,
            _ => {}
        }
    }
    Ok(Some(header))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bytes_go_to_their_offset_modulo_the_size_and_come_back_across_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, header, made) = Ring::open(dir.path(), 16).unwrap();
        assert!(made);
        assert_eq!(header.bytes, 16);
        // Every block of it is written when it is made (none left to allocate later).
        let meta = std::fs::metadata(dir.path().join(RING_FILE)).unwrap();
        assert_eq!(meta.len(), DATA_AT + 16);
        assert!(
            std::os::unix::fs::MetadataExt::blocks(&meta) * 512 >= meta.len(),
            "{meta:?}"
        );
        ring.mirror(30, b"abcdef").unwrap();
        // Offset 30 is at 14 of 16: two bytes before the end, four from the start.
        assert_eq!(ring.read(30, 6).unwrap(), b"abcdef");
        assert_eq!(ring.read(32, 4).unwrap(), b"cdef");
        assert_eq!(ring.read(16, 4).unwrap(), b"cdef");
        // At most the ring's size comes back.
        assert_eq!(ring.read(0, 100).unwrap().len(), 16);
        ring.note_durable(7, 1234).unwrap();
        drop(ring);
        // Opened again, it is the same ring, whatever size is asked for now.
        let (ring, header, made) = Ring::open(dir.path(), 64).unwrap();
        assert!(!made);
        assert_eq!(
            header,
            Header {
                bytes: 16,
                segment: 7,
                durable: 1234
            }
        );
        assert_eq!(ring.read(30, 6).unwrap(), b"abcdef");
    }

    #[test]
    fn a_ring_cut_short_is_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, ..) = Ring::open(dir.path(), 4096).unwrap();
        ring.note_durable(3, 10).unwrap();
        drop(ring);
        let path = dir.path().join(RING_FILE);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(DATA_AT + 100).unwrap();
        let (_, header, made) = Ring::open(dir.path(), 4096).unwrap();
        assert!(
            made,
            "a ring shorter than its header says was taken as whole"
        );
        assert_eq!(header.durable, 0);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), DATA_AT + 4096);
    }
}
