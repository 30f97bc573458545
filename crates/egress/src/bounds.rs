//! What one cell can make its gateway hold. Every connection costs the warden a thread (two
//! for a tunnel), buffers and descriptors outside the cell's cgroup, so their number is capped
//! per cell, every head has one deadline, and a connection silent in both directions ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The bounds of one cell's gateway, from its policy's `limits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Connections open at once (proxy and redirected together).
    pub connections: usize,
    /// A connection with no byte either way for this long is closed.
    pub idle: Duration,
    /// Bytes the decision record may grow by.
    pub records: u64,
}

impl Bounds {
    pub fn of(limits: &warden_policy::Limits) -> Self {
        Self {
            connections: limits.connections as usize,
            idle: limits.connection_idle.0,
            records: limits.records.0,
        }
    }
}

impl Default for Bounds {
    fn default() -> Self {
        Self::of(&warden_policy::Limits::default())
    }
}

/// Time for a whole request head (and a TLS handshake before it).
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The connection slots of one gateway.
#[derive(Debug)]
pub(crate) struct Slots {
    used: AtomicUsize,
    max: usize,
}

/// One taken slot; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot(Arc<Slots>);

impl Slots {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicUsize::new(0),
            max,
        })
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// A slot, unless all are taken.
    pub(crate) fn take(self: &Arc<Self>) -> Option<Slot> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(self)))
    }

    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.used.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_and_given_back() {
        let slots = Slots::new(2);
        let a = slots.take().unwrap();
        let b = slots.take().unwrap();
        assert!(slots.take().is_none());
        drop(a);
        let c = slots.take().unwrap();
        assert_eq!(slots.used(), 2);
        drop((b, c));
        assert_eq!(slots.used(), 0);
    }
}
