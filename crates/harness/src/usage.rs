//! What cells use over time: the daemon samples each live cell's accounting (its tier's, the
//! cgroup for the process tier) every [`USAGE_EVERY`], keeps the last [`USAGE_KEPT`] samples
//! per cell for a client that arrives, and announces each round to whoever follows.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use warden_protocol::{CellUsage, UsageHistory};

use super::*;

/// How often the daemon reads each cell's use.
pub const USAGE_EVERY: Duration = Duration::from_secs(2);

/// Samples kept per cell (with [`USAGE_EVERY`], the last four minutes).
pub const USAGE_KEPT: usize = 120;

/// The samples of the live cells, and the round announced to followers.
#[derive(Debug)]
pub(crate) struct UsageBook {
    samples: Mutex<HashMap<String, VecDeque<CellUsage>>>,
    rounds: tokio::sync::broadcast::Sender<Arc<Vec<(String, CellUsage)>>>,
}

impl UsageBook {
    pub(crate) fn new() -> Self {
        Self {
            samples: Mutex::new(HashMap::new()),
            rounds: tokio::sync::broadcast::channel(16).0,
        }
    }

    /// Keeps one round of samples (cells that are gone lose their history) and announces it.
    fn keep(&self, round: Vec<(String, CellUsage)>) {
        if let Ok(mut samples) = self.samples.lock() {
            samples.retain(|name, _| round.iter().any(|(n, _)| n == name));
            for (name, usage) in &round {
                let kept = samples.entry(name.clone()).or_default();
                if kept.len() == USAGE_KEPT {
                    kept.pop_front();
                }
                kept.push_back(*usage);
            }
        }
        let _ = self.rounds.send(Arc::new(round));
    }
}

impl Harness {
    /// The recent use of every live cell (of `cell` only, when given), oldest sample first.
    pub fn usage(&self, cell: Option<&str>) -> Vec<UsageHistory> {
        let Ok(samples) = self.usage.samples.lock() else {
            return Vec::new();
        };
        let mut out: Vec<UsageHistory> = samples
            .iter()
            .filter(|(name, _)| cell.is_none_or(|c| c == name.as_str()))
            .map(|(name, kept)| UsageHistory {
                cell: name.clone(),
                samples: kept.iter().copied().collect(),
            })
            .collect();
        out.sort_by(|a, b| a.cell.cmp(&b.cell));
        out
    }

    /// Each round of samples as it is taken: `(cell, usage)` for every live cell that
    /// accounts for its use.
    pub fn subscribe_usage(
        &self,
    ) -> tokio::sync::broadcast::Receiver<Arc<Vec<(String, CellUsage)>>> {
        self.usage.rounds.subscribe()
    }

    /// Starts the sampler; it ends with the harness.
    pub(crate) fn sample_usage(self: &Arc<Self>) {
        let harness: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(USAGE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(harness) = harness.upgrade() else {
                    return;
                };
                let cells: Vec<Arc<dyn Cell>> = match harness.cells.lock() {
                    Ok(cells) => cells.values().cloned().collect(),
                    Err(_) => return,
                };
                let round = tokio::task::spawn_blocking(move || {
                    cells
                        .iter()
                        .filter_map(|cell| Some((cell.name().to_owned(), cell.usage()?)))
                        .collect::<Vec<_>>()
                })
                .await
                .unwrap_or_default();
                harness.usage.keep(round);
            }
        });
    }
}
