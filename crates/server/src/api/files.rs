//! The files API: reads, writes, archives and listings inside a cell.

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathQuery {
    /// Relative to the cell's files root (its workspace mount).
    #[serde(default)]
    path: String,
}

pub(super) async fn read_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let data = h.read_file(&name, &q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

pub(super) async fn write_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = upload_body(
        body,
        UPLOAD_LIMIT,
        "write a larger file in parts under the limit (`FILE.part0`, `FILE.part1`, ...) and join them in the cell with an exec (`cat FILE.part* > FILE`)",
    )?;
    h.write_file(&name, &q.path, body.to_vec()).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn download(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let data = h.download(&name, &q.path).await?;
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], data).into_response())
}

pub(super) async fn upload(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = upload_body(
        body,
        UPLOAD_LIMIT,
        "split the files into several archives under the limit and upload each to the same path (they unpack side by side)",
    )?;
    h.upload(&name, &q.path, body.to_vec()).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn list_files(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(h.list_files(&name, &q.path).await?).into_response())
}

pub(super) async fn stat_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    Ok(Json(h.stat_file(&name, &q.path).await?).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathBody {
    path: String,
    #[serde(default)]
    recursive: bool,
}

pub(super) async fn mkdir(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PathBody>,
) -> Result<Response, ApiError> {
    h.mkdir(&name, &body.path).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn remove_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<PathBody>,
) -> Result<Response, ApiError> {
    h.remove(&name, &body.path, body.recursive).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MoveBody {
    from: String,
    to: String,
}

pub(super) async fn move_file(
    State(h): State<Shared>,
    Path(name): Path<String>,
    Body(body): Body<MoveBody>,
) -> Result<Response, ApiError> {
    h.rename(&name, &body.from, &body.to).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
