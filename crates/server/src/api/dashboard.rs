//! The dashboard: one page built into the binary (`crates/server/dashboard`, built into
//! `dist/` by its script), and the session that lets a browser use the API with it.
//!
//! On TCP, the page's first request trades the daemon's token for a session: an HttpOnly,
//! SameSite=Strict cookie, and a CSRF token in the login's answer, which the page keeps in its
//! origin's storage. Every request that rides on the cookie must carry the CSRF token too (in
//! `X-Warden-CSRF`, or in the query's `csrf` for a GET: the events stream, a WebSocket): a
//! browser sends the cookie to every port of the host, so a server on another loopback port
//! receives it. A WebSocket opened with the cookie must also come from the daemon's own origin. Every request that a browser marks as sent from
//! another site, or whose `Origin` is not the daemon's, is refused on both listeners. The unix
//! socket needs no login: whoever can connect to it is the daemon's owner.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use subtle::ConstantTimeEq as _;

use super::ApiError;

const PAGE: &str = include_str!("../../dashboard/dist/index.html");
const SCRIPT: &str = include_str!("../../dashboard/dist/app.js");
const STYLE: &str = include_str!("../../dashboard/dist/app.css");

/// The session cookie's name.
pub const COOKIE: &str = "warden_session";
/// The header that carries the CSRF token.
pub const CSRF_HEADER: &str = "x-warden-csrf";
/// How long a session lasts without a new login.
const SESSION_LIFE: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most (the oldest goes first).
const SESSIONS_MAX: usize = 256;

/// Who may use the API on one listener, and the browser sessions it has handed out.
#[derive(Debug)]
pub struct Gate {
    /// The bearer token (TCP); none on the unix socket.
    token: Option<String>,
    sessions: Mutex<HashMap<String, Session>>,
}

#[derive(Debug, Clone)]
struct Session {
    csrf: String,
    made: Instant,
}

/// How a request proved who sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// The unix socket's owner.
    Unix,
    /// `Authorization: Bearer TOKEN`.
    Token,
    /// The dashboard's session cookie.
    Cookie,
}

impl Gate {
    pub fn new(token: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            token,
            sessions: Mutex::new(HashMap::new()),
        })
    }

    fn session(&self, headers: &HeaderMap) -> Option<(String, Session)> {
        let id = session_cookie(headers)?;
        let mut sessions = self.sessions.lock().ok()?;
        sessions.retain(|_, s| s.made.elapsed() < SESSION_LIFE);
        // Compared in constant time, one by one: the ids are few.
        sessions
            .iter()
            .find(|(known, _)| bool::from(known.as_bytes().ct_eq(id.as_bytes())))
            .map(|(known, s)| (known.clone(), s.clone()))
    }

    fn open_session(&self) -> Result<(String, String), ApiError> {
        let id = random_hex()?;
        let csrf = random_hex()?;
        let mut sessions = self
            .sessions
            .lock()
            .map_err(|_| ApiError::internal("the session table is poisoned"))?;
        if sessions.len() >= SESSIONS_MAX
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.made)
                .map(|(k, _)| k.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            id.clone(),
            Session {
                csrf: csrf.clone(),
                made: Instant::now(),
            },
        );
        Ok((id, csrf))
    }

    /// How `request` proves its sender, or why it is refused. Paths the page needs before a
    /// login (the page, its script and style, the login) pass without proof.
    pub(super) fn check(&self, request: &Request) -> Result<Option<Proof>, ApiError> {
        let headers = request.headers();
        refuse_other_sites(headers)?;
        let Some(token) = &self.token else {
            return Ok(Some(Proof::Unix));
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(given) = bearer {
            return match bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
                true => Ok(Some(Proof::Token)),
                false => Err(unauthorized()),
            };
        }
        // The login checks the token itself (a second one, from a browser that has a session
        // already, starts a new session).
        if request.method() == Method::POST && request.uri().path() == "/ui/login" {
            return Ok(None);
        }
        if let Some((_, session)) = self.session(headers) {
            // The cookie alone proves nothing: a browser sends it to every port of the host
            // (cookies are not kept apart by port), so a server another user runs on another
            // loopback port receives it whenever the browser opens a page there. Every request
            // made with it must also carry the session's CSRF token, which only the daemon's
            // own page holds (the login's answer, kept in that origin's storage): in
            // `X-Warden-CSRF`, or, for what a page cannot add a header to (its events stream,
            // a WebSocket), in the query's `csrf` of a GET.
            let reads = matches!(*request.method(), Method::GET | Method::HEAD);
            let given = headers
                .get(CSRF_HEADER)
                .and_then(|v| v.to_str().ok())
                .or_else(|| reads.then(|| csrf_param(request.uri().query())).flatten())
                .unwrap_or("");
            if !bool::from(given.as_bytes().ct_eq(session.csrf.as_bytes())) {
                // The page and its assets still come (the page then logs in again).
                if is_open_path(request.method(), request.uri().path()) {
                    return Ok(None);
                }
                return Err(ApiError {
                    reason: None,
                    status: StatusCode::FORBIDDEN,
                    message: format!(
                        "a request made with the dashboard's session cookie must carry the session's CSRF token (the login's answer gives it) in {CSRF_HEADER}, or for a GET in the query's `csrf`: a browser sends the cookie to every port of this host, so the cookie alone proves nothing; log in again if the page lost the token"
                    ),
                });
            }
            let upgrade = headers.contains_key(header::UPGRADE);
            // A WebSocket cannot carry the CSRF header: it must say where it comes from (and
            // `refuse_other_sites` above has checked that this is the daemon itself).
            if upgrade && !headers.contains_key(header::ORIGIN) {
                return Err(ApiError {
                    reason: None,
                    status: StatusCode::FORBIDDEN,
                    message:
                        "a WebSocket opened with the dashboard's session cookie must say its Origin"
                            .to_owned(),
                });
            }
            return Ok(Some(Proof::Cookie));
        }
        if is_open_path(request.method(), request.uri().path()) {
            return Ok(None);
        }
        Err(unauthorized())
    }
}

/// The `csrf` parameter of a query (a hex token: nothing to decode).
fn csrf_param(query: Option<&str>) -> Option<&str> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("csrf="))
}

/// `uri` without its query's `csrf` parameter, which the gate has read (the handlers' queries
/// take only their own parameters).
pub(super) fn without_csrf_param(uri: &axum::http::Uri) -> Option<axum::http::Uri> {
    let query = uri.query()?;
    csrf_param(Some(query))?;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("csrf="))
        .collect();
    let path_and_query = match rest.is_empty() {
        true => uri.path().to_owned(),
        false => format!("{}?{}", uri.path(), rest.join("&")),
    };
    path_and_query.parse().ok()
}

/// What the page needs before anyone has logged in.
fn is_open_path(method: &Method, path: &str) -> bool {
    match *method {
        Method::GET | Method::HEAD => {
            matches!(path, "/" | "/ui" | "/ui/" | "/ui/app.js" | "/ui/app.css")
        }
        Method::POST => path == "/ui/login",
        _ => false,
    }
}

pub(super) fn unauthorized() -> ApiError {
    ApiError { reason: None,
        status: StatusCode::UNAUTHORIZED,
        message: "a bearer token is required on TCP (`Authorization: Bearer TOKEN`, the token is in the daemon's runtime directory, file daemon.token; `warden dashboard` prints a link that logs a browser in)".to_owned(),
    }
}

/// Refuses what a browser says comes from another site: `Sec-Fetch-Site: cross-site`, or an
/// `Origin` whose host is not the one the request was sent to.
fn refuse_other_sites(headers: &HeaderMap) -> Result<(), ApiError> {
    let refused = |why: String| ApiError {
        reason: None,
        status: StatusCode::FORBIDDEN,
        message: format!(
            "{why}: the daemon answers only its own pages and non-browser clients (cross-site requests are refused)"
        ),
    };
    if headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() == b"cross-site")
    {
        return Err(refused(
            "the browser marked this request as sent from another site".to_owned(),
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let origin_host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or("");
        if host.is_empty() || origin_host != host {
            return Err(refused(format!(
                "Origin {origin} is not this daemon ({host})"
            )));
        }
    }
    Ok(())
}

fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == COOKIE)
        .map(|c| c.value().to_owned())
}

fn random_hex() -> Result<String, ApiError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| ApiError::internal(format!("making a session: {e}")))?;
    Ok(hex::encode(bytes))
}

/// The dashboard's routes: the page and its assets, login, logout and the session.
pub(super) fn routes(gate: Arc<Gate>) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/", get(page))
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/session", get(session))
        .with_state(gate)
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// The page; without a proof of who asks it still comes (it holds no data, and shows the
/// login), but with 401.
async fn page(proof: Option<axum::extract::Extension<Proof>>) -> Response {
    let status = match proof {
        Some(_) => StatusCode::OK,
        None => StatusCode::UNAUTHORIZED,
    };
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Login {
    token: String,
}

async fn login(
    State(gate): State<Arc<Gate>>,
    super::extract::Body(body): super::extract::Body<Login>,
) -> Result<Response, ApiError> {
    let Some(token) = &gate.token else {
        // The unix socket needs no login; answer as if it had succeeded.
        return Ok(Json(json!({ "csrf": "", "login": false })).into_response());
    };
    if !bool::from(body.token.trim().as_bytes().ct_eq(token.as_bytes())) {
        return Err(ApiError { reason: None,
            status: StatusCode::UNAUTHORIZED,
            message: "that is not the daemon's token (it is in the daemon's runtime directory, file daemon.token)".to_owned(),
        });
    }
    let (id, csrf) = gate.open_session()?;
    let cookie = cookie::Cookie::build((COOKIE, id))
        .http_only(true)
        .same_site(cookie::SameSite::Strict)
        .path("/")
        .max_age(cookie::time::Duration::seconds(
            SESSION_LIFE.as_secs() as i64
        ))
        .build();
    let mut response = Json(json!({ "csrf": csrf, "login": true })).into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&cookie.to_string())
            .map_err(|e| ApiError::internal(format!("making the cookie: {e}")))?,
    );
    Ok(response)
}

async fn logout(State(gate): State<Arc<Gate>>, headers: HeaderMap) -> Response {
    if let Some((id, _)) = gate.session(&headers)
        && let Ok(mut sessions) = gate.sessions.lock()
    {
        sessions.remove(&id);
    }
    let gone = cookie::Cookie::build((COOKIE, ""))
        .http_only(true)
        .same_site(cookie::SameSite::Strict)
        .path("/")
        .max_age(cookie::time::Duration::ZERO)
        .build();
    let mut response = StatusCode::NO_CONTENT.into_response();
    if let Ok(value) = HeaderValue::from_str(&gone.to_string()) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// Who the page is logged in as, and the CSRF token its changes carry.
async fn session(
    State(gate): State<Arc<Gate>>,
    headers: HeaderMap,
    proof: Option<axum::extract::Extension<Proof>>,
) -> Result<Response, ApiError> {
    let proof = proof
        .map(|axum::extract::Extension(p)| p)
        .ok_or_else(unauthorized)?;
    let csrf = match proof {
        Proof::Cookie => gate
            .session(&headers)
            .map(|(_, s)| s.csrf)
            .unwrap_or_default(),
        Proof::Unix | Proof::Token => String::new(),
    };
    let via = match proof {
        Proof::Unix => "unix",
        Proof::Token => "token",
        Proof::Cookie => "cookie",
    };
    Ok(Json(json!({
        "via": via,
        "csrf": csrf,
        "version": env!("CARGO_PKG_VERSION"),
        "usage_every_ms": warden_harness::USAGE_EVERY.as_millis() as u64,
    }))
    .into_response())
}
