//! The client's errors are typed: no daemon is a `Connect` that says what to start, and an
//! error answer of the API is an `ApiError` with its status, message, hint and code.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::io::{Read as _, Write as _};

use warden_client::{Client, ClientError};

#[tokio::test]
async fn no_daemon_is_a_connect_error_that_says_what_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new(dir.path().join("daemon.sock"));
    let err = client
        .json(hyper::Method::GET, "/v1/cells", None)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
    assert!(
        err.to_string().contains("is `warden serve` running?"),
        "{err}"
    );
    assert!(Client::detect(dir.path()).is_none());
}

#[tokio::test]
async fn an_error_answer_carries_the_apis_status_message_and_code() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("daemon.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = [0u8; 4096];
        let _ = stream.read(&mut request).unwrap();
        let body =
            r#"{"error":"no cell `x`","code":"not-found","hint":"list them with warden ps"}"#;
        write!(
            stream,
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let client = Client::new(socket);
    let err = client
        .call::<(), serde_json::Value>(hyper::Method::GET, "/v1/cells/x", None)
        .await
        .unwrap_err();
    let api = err.api().expect("the API's error");
    assert_eq!(api.status, hyper::StatusCode::NOT_FOUND);
    assert_eq!(api.code, Some(warden_protocol::ErrorCode::NotFound));
    assert_eq!(api.message, "no cell `x` (list them with warden ps)");
    server.join().unwrap();
}
