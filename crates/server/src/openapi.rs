//! The API's OpenAPI document (`docs/openapi.json`, served at `/openapi.json`). Its paths are
//! written by hand; its schemas are generated from the wire types themselves (the protocol's,
//! and the workspace's diff and apply report), and a test fails when the committed document's
//! schemas differ from what the types generate, or a path names a schema that is not there.
//! `WARDEN_WRITE_OPENAPI=1 cargo test -p warden-server openapi` writes the generated schemas
//! into the committed document.

use schemars::generate::{Contract, SchemaSettings};
use serde_json::{Map, Value};

/// The schemas of every type the API takes or gives, by name, with references between them
/// pointing at `#/components/schemas/`.
pub fn schemas() -> Map<String, Value> {
    // What the API reads is described as it is read (defaults may be left out), what it
    // writes as it is written.
    let mut requests = generator(Contract::Deserialize);
    requests.subschema_for::<warden_protocol::CreateCell>();
    requests.subschema_for::<warden_protocol::ExecSpec>();
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
    fn openapi_schemas_are_the_ones_the_types_generate() {
        let mut doc: Value = serde_json::from_str(crate::api::OPENAPI).unwrap();
        let generated = Value::Object(schemas());
        if std::env::var_os("WARDEN_WRITE_OPENAPI").is_some() {
            doc["components"]["schemas"] = generated.clone();
            std::fs::write(
                COMMITTED,
                serde_json::to_string_pretty(&doc).unwrap() + "\n",
            )
            .unwrap();
        }
        assert!(
            doc["components"]["schemas"] == generated,
            "docs/openapi.json's schemas differ from what the wire types generate; write them \
             with `WARDEN_WRITE_OPENAPI=1 cargo test -p warden-server openapi`"
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
