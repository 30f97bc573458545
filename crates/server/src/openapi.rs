//! The API's OpenAPI document (`docs/openapi.json`, served at `/openapi.json`), generated:
//! its paths from the route table (`api::routes`: each route's summary, parameters, body and
//! answers), their error answers from the failures of the core's operations each route carries
//! out (every status a route can answer with, each with the `reason`s behind it), and its
//! schemas from the wire types themselves (the protocol's, and the workspace's diff and apply
//! report). Tests fail when the committed document differs from what this generates, when a
//! route of the router is not in the table or the other way round, or when a path names a
//! schema that is not there. `WARDEN_WRITE_OPENAPI=1 cargo test -p warden-server openapi`
//! writes the document.

use schemars::generate::{Contract, SchemaSettings};
use serde_json::{Map, Value, json};

/// The whole document.
pub fn document() -> Value {
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Warden API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The warden daemon's API. On the unix socket (daemon.sock in the runtime directory, owner-only) no token is needed; on TCP (`warden serve --listen`, loopback only) every request needs `Authorization: Bearer TOKEN`. Every request that changes something is journaled before it is carried out. A refusal is an `ErrorBody`: `error` says what failed and why, `code` the kind of failure, `reason` which failure of the operation it is.",
        },
        "security": [{ "bearer": [] }, {}],
        "paths": paths(),
        "components": {
            "schemas": schemas(),
            "securitySchemes": { "bearer": { "scheme": "bearer", "type": "http" } },
        },
    })
}

/// The paths: each route of the table with its error answers.
pub fn paths() -> Map<String, Value> {
    let mut paths = Map::new();
    for route in crate::api::ROUTES {
        let mut operation: Value = match serde_json::from_str(route.operation) {
            Ok(operation) => operation,
            Err(e) => {
                json!({ "summary": format!("(the route table's entry does not parse: {e})") })
            }
        };
        let errors = error_answers(route, &operation);
        if let Some(responses) = operation["responses"].as_object_mut() {
            responses.extend(errors);
        }
        let item = paths
            .entry(route.path.to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(item) = item.as_object_mut() {
            item.insert(route.method.to_owned(), operation);
        }
    }
    paths
}

/// A route's error answers: the failures of its operations, grouped by status, and the API's
/// own (a missing token on TCP; a malformed request; a body over the limit).
fn error_answers(route: &crate::api::Route, operation: &Value) -> Map<String, Value> {
    let body = operation.get("requestBody");
    let json_body = body.is_some_and(|b| b["content"].get("application/json").is_some());
    let takes_input = body.is_some()
        || operation["parameters"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["in"] != "path"));
    let mut by_status: std::collections::BTreeMap<u16, Vec<String>> = Default::default();
    if takes_input {
        by_status.entry(400).or_default().push(
            "no `reason`: the request is malformed (its JSON, a query parameter, a path parameter)"
                .to_owned(),
        );
    }
    for failures in route.failures {
        for failure in *failures {
            let line = format!(
                "`{}`: {}",
                failure.reason,
                failure.about.trim().trim_end_matches('.')
            );
            let lines = by_status.entry(failure.code.http_status()).or_default();
            if !lines.contains(&line) {
                lines.push(line);
            }
        }
    }
    let mut out = Map::new();
    let error = |description: String| {
        json!({
            "description": description,
            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ErrorBody" } } },
        })
    };
    for (status, lines) in by_status {
        let title = match status {
            400 => "Bad request",
            403 => "Refused",
            404 => "Not found",
            409 => "Not in a state for it",
            413 => "Too large",
            503 => "Unavailable: try again",
            _ => "The warden failed",
        };
        out.insert(
            status.to_string(),
            error(format!(
                "{title}; the `reason` says which:\n- {}",
                lines.join("\n- ")
            )),
        );
    }
    out.insert(
        "401".to_owned(),
        error("Missing or wrong bearer token (TCP only)".to_owned()),
    );
    if body.is_some() {
        out.insert(
            "413".to_owned(),
            error("Body larger than the limit (1 MiB JSON, 64 MiB uploads)".to_owned()),
        );
    }
    if json_body {
        out.insert(
            "422".to_owned(),
            error("The JSON is well formed but a field has the wrong type or an unknown value (the message names it)".to_owned()),
        );
    }
    out
}

/// The schemas of every type the API takes or gives, by name, with references between them
/// pointing at `#/components/schemas/`.
pub fn schemas() -> Map<String, Value> {
    // What the API reads is described as it is read (defaults may be left out), what it
    // writes as it is written.
    let mut requests = generator(Contract::Deserialize);
    requests.subschema_for::<warden_protocol::CreateCell>();
    requests.subschema_for::<warden_protocol::ExecSpec>();
    requests.subschema_for::<warden_protocol::RunOnce>();
    requests.subschema_for::<warden_protocol::TtySize>();
    requests.subschema_for::<warden_protocol::SignalBody>();
    requests.subschema_for::<warden_protocol::Answer>();
    requests.subschema_for::<warden_protocol::ApplyRequest>();
    requests.subschema_for::<warden_protocol::StartAgent>();
    requests.subschema_for::<warden_protocol::Say>();
    requests.subschema_for::<warden_protocol::Rewind>();
    requests.subschema_for::<warden_protocol::ForkAgent>();
    requests.subschema_for::<warden_protocol::CheckpointRequest>();
    let mut answers = generator(Contract::Serialize);
    answers.subschema_for::<warden_protocol::CellInfo>();
    answers.subschema_for::<warden_protocol::Started>();
    answers.subschema_for::<warden_protocol::ProcessInfo>();
    answers.subschema_for::<warden_protocol::ExitInfo>();
    answers.subschema_for::<warden_protocol::FileInfo>();
    answers.subschema_for::<warden_protocol::Approval>();
    answers.subschema_for::<warden_protocol::Snapshot>();
    answers.subschema_for::<warden_protocol::ErrorBody>();
    answers.subschema_for::<warden_workspace::Diff>();
    answers.subschema_for::<warden_workspace::ApplyReport>();
    answers.subschema_for::<warden_protocol::AgentInfo>();
    answers.subschema_for::<warden_protocol::Transcript>();
    answers.subschema_for::<warden_protocol::Rerun>();
    answers.subschema_for::<warden_protocol::JournalPage>();
    answers.subschema_for::<warden_protocol::JournalCheck>();
    answers.subschema_for::<warden_protocol::UsageHistory>();
    answers.subschema_for::<warden_protocol::Checkpoint>();
    answers.subschema_for::<warden_protocol::PoolInfo>();
    let mut all = answers.take_definitions(true);
    // A type on both sides keeps its reading form.
    all.extend(requests.take_definitions(true));
    all.sort_keys();
    all
}

fn generator(contract: Contract) -> schemars::SchemaGenerator {
    let mut settings = SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    settings.meta_schema = None;
    settings.contract = contract;
    settings.into_generator()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Every `$ref` in `value`.
    fn references(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    match (key.as_str(), inner) {
                        ("$ref", Value::String(target)) => out.push(target.clone()),
                        _ => references(inner, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|item| references(item, out)),
            _ => {}
        }
    }

    const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");

    #[test]
    fn openapi_document_is_the_one_the_routes_and_types_generate() {
        let generated = document();
        if std::env::var_os("WARDEN_WRITE_OPENAPI").is_some() {
            std::fs::write(
                COMMITTED,
                serde_json::to_string_pretty(&generated).unwrap() + "\n",
            )
            .unwrap();
        }
        let committed: Value = serde_json::from_str(crate::api::OPENAPI).unwrap();
        assert!(
            committed == generated,
            "docs/openapi.json differs from what the route table, the error enums and the wire \
             types generate; write it with `WARDEN_WRITE_OPENAPI=1 cargo test -p warden-server openapi`"
        );
    }

    #[test]
    fn openapi_paths_name_only_schemas_that_exist() {
        let doc: Value = serde_json::from_str(crate::api::OPENAPI).unwrap();
        let mut refs = Vec::new();
        references(&doc, &mut refs);
        assert!(!refs.is_empty());
        for target in refs {
            let name = target
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{target} is not a component schema"));
            assert!(
                doc["components"]["schemas"].get(name).is_some(),
                "{target} is not in the document"
            );
        }
    }

    #[test]
    fn every_route_with_a_json_body_documents_its_422() {
        let doc: Value = serde_json::from_str(crate::api::OPENAPI).unwrap();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let json_body = op["requestBody"]["content"]
                    .get("application/json")
                    .is_some();
                if json_body {
                    assert!(
                        op["responses"].get("422").is_some(),
                        "{method} {path} takes JSON but documents no 422"
                    );
                }
            }
        }
    }
}
