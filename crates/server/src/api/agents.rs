//! Agent sessions: the warden's own loop, started, watched and steered from outside.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use warden_agent::Agents;
use warden_protocol::{AgentAction, ForkAgent, Rewind, Say, StartAgent};

use super::*;

pub(super) type Sessions = Arc<Agents>;

pub(super) async fn list_agents(
    State(agents): State<Sessions>,
    Query(NoQuery {}): Query<NoQuery>,
) -> Response {
    Json(agents.list()).into_response()
}

pub(super) async fn start_agent(
    State(agents): State<Sessions>,
    by: Option<Extension<Caller>>,
    Body(request): Body<StartAgent>,
) -> Result<Response, ApiError> {
    let info = agents.start(request, &caller(by)).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

pub(super) async fn get_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.get(&id)?).into_response())
}

pub(super) async fn transcript(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.transcript(&id)?).into_response())
}

/// `GET /v1/agents/{id}/wait`: answers once the session is paused or over.
pub(super) async fn wait_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
    Query(NoQuery {}): Query<NoQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.settled(&id).await?).into_response())
}

async fn act(
    agents: Sessions,
    id: String,
    action: AgentAction,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.control(&id, action, &caller(by)).await?).into_response())
}

pub(super) async fn pause_agent(
    State(a): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    act(a, id, AgentAction::Pause, by).await
}

pub(super) async fn resume_agent(
    State(a): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    act(a, id, AgentAction::Resume, by).await
}

pub(super) async fn step_agent(
    State(a): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    act(a, id, AgentAction::Step, by).await
}

pub(super) async fn stop_agent(
    State(a): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    act(a, id, AgentAction::Stop, by).await
}

pub(super) async fn say_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
    Body(say): Body<Say>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.say(&id, &say.text, &caller(by)).await?).into_response())
}

pub(super) async fn rewind_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
    Body(rewind): Body<Rewind>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.rewind(&id, rewind.turn, &caller(by)).await?).into_response())
}

pub(super) async fn fork_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
    Body(fork): Body<ForkAgent>,
) -> Result<Response, ApiError> {
    let info = agents.fork(&id, fork, &caller(by)).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

pub(super) async fn rerun_agent(
    State(agents): State<Sessions>,
    Path(id): Path<String>,
    by: Option<Extension<Caller>>,
) -> Result<Response, ApiError> {
    Ok(Json(agents.rerun(&id, &caller(by)).await?).into_response())
}
