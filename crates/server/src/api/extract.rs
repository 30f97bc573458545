//! What handlers take and give: JSON bodies, paths and queries whose rejections are API
//! errors, and the API's error answer.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use warden_harness::HarnessError;

/// An error as the API answers it: a status and `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// The failure's name, where the core said it.
    pub(crate) reason: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            reason: None,
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl From<HarnessError> for ApiError {
    fn from(err: HarnessError) -> Self {
        let status = StatusCode::from_u16(err.kind.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self {
            status,
            message: err.message,
            reason: Some(err.reason),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use warden_protocol::ErrorCode;
        let code = match self.status {
            StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
            StatusCode::FORBIDDEN => ErrorCode::Forbidden,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => ErrorCode::NotFound,
            StatusCode::CONFLICT => ErrorCode::Conflict,
            StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
            StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Unavailable,
            status if status.is_server_error() => ErrorCode::Internal,
            _ => ErrorCode::BadRequest,
        };
        let body = warden_protocol::ErrorBody {
            // What the request sent, echoed in backticks, cut to a sane length.
            error: warden_protocol::text::clip_quoted(&self.message).into_owned(),
            code,
            hint: None,
            reason: self.reason.map(str::to_owned),
        };
        (self.status, Json(body)).into_response()
    }
}

/// A JSON body whose rejections (malformed, wrong type, too large) are API errors too. Any
/// content type is read as JSON, so `curl -d '{...}'` works without a header.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|rejection| ApiError {
                reason: None,
                status: rejection.status(),
                message: format!("request body: {}", rejection.body_text()),
            })?;
        if bytes.starts_with(b"\xEF\xBB\xBF") {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "request body: begins with a UTF-8 byte-order mark (EF BB BF); \
                 send the JSON without it",
            ));
        }
        let mut json = serde_json::Deserializer::from_slice(&bytes);
        let value = serde_path_to_error::deserialize(&mut json).map_err(|err| {
            let status = match err.inner().classify() {
                serde_json::error::Category::Data => StatusCode::UNPROCESSABLE_ENTITY,
                _ => StatusCode::BAD_REQUEST,
            };
            let path = err.path().to_string();
            // `.` is the whole body; `?` a place the parser had not named yet (the body ended,
            // or broke, before its first field): neither is a field to point at.
            let message = if path == "." || path == "?" {
                format!("request body: {}", err.inner())
            } else {
                format!("request body: {path}: {}", err.inner())
            };
            ApiError {
                reason: None,
                status,
                message,
            }
        })?;
        // Nothing may follow the JSON value.
        json.end().map_err(|err| ApiError {
            reason: None,
            status: StatusCode::BAD_REQUEST,
            message: format!("request body: {err}"),
        })?;
        Ok(Self(value))
    }
}

/// Path parameters whose rejections are API errors.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError {
                reason: None,
                status: rejection.status(),
                message: format!("path: {}", rejection.body_text()),
            }),
        }
    }
}

/// The query of an endpoint that takes no parameters: any parameter is refused by name
/// rather than silently ignored, as the endpoints that take some do.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// Query parameters whose rejections are API errors.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        // The query's decoder would put U+FFFD in place of bytes that are not UTF-8, and a
        // path or name with one would then be looked up as some other text.
        if let Some(name) = parts.uri.query().and_then(not_utf8) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "query: parameter `{name}` is not UTF-8 once percent-decoded; \
                     percent-encode the UTF-8 bytes of the text (`é` is `%C3%A9`)"
                ),
            ));
        }
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError {
                reason: None,
                status: rejection.status(),
                message: format!("query: {}", rejection.body_text()),
            }),
        }
    }
}

/// The name (as sent) of the first of a query's parameters whose name or value is not UTF-8
/// once percent-decoded (the pair decoded whole: `=` and `+` are ASCII, and break a sequence
/// where they stand as much as decoding name and value apart, or `+` as a space, would).
fn not_utf8(query: &str) -> Option<&str> {
    query.split('&').find_map(|pair| {
        let name = pair.split('=').next().unwrap_or(pair);
        percent_encoding::percent_decode_str(pair)
            .decode_utf8()
            .is_err()
            .then_some(name)
    })
}

/// An upload's body (a file's content, an archive), taken as `Result<Bytes, BytesRejection>` so
/// that a refusal is an API error like every other: one over `limit` is a JSON `too-large` that
/// says the limit and `instead` (what to do), not the text axum would answer.
pub(super) fn upload_body(
    body: Result<axum::body::Bytes, BytesRejection>,
    limit: usize,
    instead: &str,
) -> Result<axum::body::Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!(
                "the upload is larger than the {} MiB an upload may be; {instead}",
                limit / (1024 * 1024)
            )
        } else {
            format!("request body: {}", rejection.body_text())
        };
        ApiError::new(status, message)
    })
}
