//! Cells as a whole: their lifecycle, workspace, policy, approvals and the journal's stream.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::convert::Infallible;
use std::time::Duration;
use warden_harness::CreateCell;

use super::*;

pub(super) async fn list_cells(State(harness): State<Shared>) -> Result<Response, ApiError> {
    Ok(Json(harness.list()?).into_response())
}

pub(super) async fn create_cell(
    State(harness): State<Shared>,
    Body(request): Body<CreateCell>,
) -> Result<Response, ApiError> {
    let cell = harness.create(request).await?;
    Ok((StatusCode::CREATED, Json(cell)).into_response())
}

pub(super) async fn get_cell(
    State(harness): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(harness.get(&name)?).into_response())
}

pub(super) async fn delete_cell(
    State(harness): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    harness.delete(&name, &caller(by)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn pause(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Pause, &caller(by))
            .await?,
    )
    .into_response())
}

pub(super) async fn resume(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Resume, &caller(by))
            .await?,
    )
    .into_response())
}

pub(super) async fn kill(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(
        h.control(&name, warden_protocol::ControlAction::Kill, &caller(by))
            .await?,
    )
    .into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotBody {
    #[serde(rename = "as")]
    as_name: Option<String>,
}

pub(super) async fn snapshot(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<SnapshotBody>,
) -> Result<Response, ApiError> {
    let snap = h.snapshot(&name, body.as_name.as_deref()).await?;
    Ok((StatusCode::CREATED, Json(snap)).into_response())
}

pub(super) async fn checkpoint(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
    Body(body): Body<warden_protocol::CheckpointRequest>,
) -> Result<Response, ApiError> {
    let saved = h
        .checkpoint(&name, body.as_name.as_deref(), &caller(by))
        .await?;
    Ok((StatusCode::CREATED, Json(saved)).into_response())
}

pub(super) async fn snapshots(
    State(h): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(h.snapshots(&name)?).into_response())
}

pub(super) async fn remove_snapshot(
    State(h): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    h.remove_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ResetBody {
    /// `SNAP` or `CELL@SNAP`; none: the start.
    to: Option<String>,
}

pub(super) async fn reset(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<ResetBody>,
) -> Result<Response, ApiError> {
    h.reset(&name, body.to.as_deref()).await?;
    Ok(Json(h.get(&name)?).into_response())
}

pub(super) async fn diff(
    State(h): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(h.changes(&name).await?).into_response())
}

pub(super) async fn apply(
    State(h): State<Shared>,
    Path(name): Path<String>,
    by: Option<Extension<Caller>>,
    Body(request): Body<warden_harness::ApplyRequest>,
) -> Result<Response, ApiError> {
    Ok(Json(h.apply(&name, &request, &caller(by)).await?).into_response())
}

pub(super) async fn get_policy(
    State(h): State<Shared>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let (made, replaced) = h.policy(&name)?;
    let mut body = match made {
        warden_harness::PolicySource::Preset(p) => json!({ "preset": p }),
        warden_harness::PolicySource::Yaml(y) => json!({ "policy": y }),
    };
    if let Some(replaced) = replaced {
        body["replaced"] = json!(replaced);
    }
    Ok(Json(body).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PolicyBody {
    /// A whole policy (YAML); its `network` and `commands` replace the running cell's.
    policy: String,
}

pub(super) async fn put_policy(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PolicyBody>,
) -> Result<Response, ApiError> {
    let closed = h.replace_policy(&name, &body.policy).await?;
    Ok(Json(json!({ "closed_connections": closed })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    cell: Option<String>,
    /// Start after this entry (its `seq`, which is each event's id): the entries written
    /// since come first, then the live ones. `Last-Event-ID` does the same.
    after: Option<u64>,
    /// Also each round of the cells' use (`usage` events, every few seconds: CPU time, memory,
    /// tasks per live cell), for a live view.
    #[serde(default)]
    usage: bool,
}

/// Journal entries as they are written (`entry` events, each with the entry's `seq` as its
/// id), optionally of one cell; a client that reconnects with `after` (or `Last-Event-ID`)
/// gets what it missed first.
pub(super) async fn events(
    State(h): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    let after = q.after.or_else(|| {
        headers
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
    });
    // Subscribed before the journal is read: nothing falls between the two.
    let entries = h.subscribe();
    let usage = q.usage.then(|| h.subscribe_usage());
    // What it missed, read as it is sent (a client far behind would otherwise have had the
    // daemon hold every entry it missed at once).
    let missed = after.map(|after| h.stream_entries_after(after, q.cell.clone()));
    // The stream reads the next entry when the connection asks for its next event: a client
    // that stops reading holds what its connection buffers and the shared ring of entries
    // (`Harness::subscribe`), not a queue of its own (64 entries of up to ~180 KB each were
    // ~11 MB for each stalled subscriber).
    let feed = EventsFeed {
        entries,
        usage,
        missed,
        last: after.unwrap_or(0),
        cell: q.cell,
        done: false,
    };
    let events = futures_util::stream::unfold(feed, |mut feed| async move {
        let event = feed.next().await?;
        Some((Ok::<_, Infallible>(event), feed))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// The rounds of the cells' use, as the usage sampler announces them.
type UsageRounds = tokio::sync::broadcast::Receiver<Arc<Vec<(String, warden_protocol::CellUsage)>>>;

/// What an `/v1/events` stream reads from: the backlog a reconnecting client missed, then the
/// live entries (and the usage rounds, where asked for).
struct EventsFeed {
    entries: tokio::sync::broadcast::Receiver<Arc<serde_json::Value>>,
    usage: Option<UsageRounds>,
    missed: Option<
        tokio::sync::mpsc::Receiver<Result<serde_json::Value, warden_harness::HarnessError>>,
    >,
    last: u64,
    cell: Option<String>,
    done: bool,
}

impl EventsFeed {
    fn entry_event(entry: &serde_json::Value) -> Event {
        let event = Event::default().event("entry").data(entry.to_string());
        match entry["seq"].as_u64() {
            Some(seq) => event.id(seq.to_string()),
            None => event,
        }
    }

    /// The next event (`None`: the stream ends).
    async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        if let Some(missed) = self.missed.as_mut() {
            match missed.recv().await {
                Some(Ok(entry)) => {
                    self.last = self.last.max(entry["seq"].as_u64().unwrap_or(0));
                    return Some(Self::entry_event(&entry));
                }
                // The journal could not be read back: said, and the stream ends (a client
                // that reconnects asks again).
                Some(Err(e)) => {
                    self.done = true;
                    return Some(
                        Event::default()
                            .event("error")
                            .data(json!({ "error": e.message }).to_string()),
                    );
                }
                None => self.missed = None,
            }
        }
        loop {
            let usage = &mut self.usage;
            let entry = tokio::select! {
                entry = self.entries.recv() => entry,
                Some(round) = async { usage.as_mut()?.recv().await.ok() }, if usage.is_some() => {
                    let cells: Vec<serde_json::Value> = round
                        .iter()
                        .map(|(cell, usage)| json!({ "cell": cell, "usage": usage }))
                        .collect();
                    return Some(Event::default().event("usage").data(json!(cells).to_string()));
                }
            };
            return Some(match entry {
                Ok(entry) => {
                    if self.cell.as_deref().is_some_and(|c| entry["cell"] != c)
                        || entry["seq"].as_u64().is_some_and(|seq| seq <= self.last)
                    {
                        continue;
                    }
                    Self::entry_event(&entry)
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => Event::default()
                    .event("lagged")
                    .data(json!({ "missed": missed }).to_string()),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            });
        }
    }
}

pub(super) async fn journal(
    State(h): State<Shared>,
    Query(query): Query<warden_protocol::JournalQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(h.journal_page(query).await?).into_response())
}

pub(super) async fn verify_journal(State(h): State<Shared>) -> Result<Response, ApiError> {
    Ok(Json(h.check_journal().await?).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UsageQuery {
    cell: Option<String>,
}

/// The recent use of the live cells, oldest sample first.
pub(super) async fn usage(
    State(h): State<Shared>,
    Query(q): Query<UsageQuery>,
) -> Json<Vec<warden_protocol::UsageHistory>> {
    Json(h.usage(q.cell.as_deref()))
}

pub(super) async fn pools(State(h): State<Shared>) -> Json<Vec<warden_protocol::PoolInfo>> {
    Json(h.pools())
}

pub(super) async fn approvals(
    State(harness): State<Shared>,
) -> Json<Vec<warden_harness::Approval>> {
    Json(harness.approvals())
}

pub(super) async fn answer(
    State(harness): State<Shared>,
    Path((name, id)): Path<(String, u64)>,
    by: Option<Extension<Caller>>,
    Body(body): Body<warden_protocol::Answer>,
) -> Result<Response, ApiError> {
    let allow = body.decision == warden_protocol::Decision::Approve;
    harness
        .answer(&name, id, allow, body.scope, &caller(by))
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
