//! The OpenAPI document against the router that really serves the API, and
//! the example manifests against the document's schemas.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

const METHODS: [&str; 9] = [
    "get", "head", "delete", "options", "patch", "post", "put", "trace", "connect",
];

/// The routes the API router answers: path -> methods.
///
/// axum has no call that lists a router's routes, but its `Debug` output
/// prints them: `node: Node { paths: {RouteId(N): "/path", ..} }` and, per
/// route, `RouteId(N): MethodRouter(MethodRouter { get: BoxedHandler,
/// delete: None, .. })`. This reads both, and fails loudly when it finds
/// neither, so an axum release that prints them differently breaks this
/// test instead of letting it pass with nothing to compare.
fn served_routes() -> BTreeMap<String, BTreeSet<String>> {
    let debug = format!("{:?}", crate::api::routes());
    let section = |start: &str, end: &str| -> String {
        let from = debug
            .find(start)
            .unwrap_or_else(|| panic!("{start:?} not in the router's Debug output: {debug}"));
        let rest = &debug[from + start.len()..];
        let to = rest
            .find(end)
            .unwrap_or_else(|| panic!("{end:?} not after {start:?} in: {debug}"));
        rest[..to].to_string()
    };
    // The first PathRouter is the routes'; the fallback router comes after.
    let paths_text = section("node: Node { paths: {", "fallback_router:");
    let routes_text = section("path_router: PathRouter { routes: {", "}, node: Node");

    // `RouteId(N): "/path"`, the paths quoted (they hold braces and commas).
    let mut paths: BTreeMap<u64, String> = BTreeMap::new();
    for entry in paths_text.split("RouteId(").skip(1) {
        let (id, rest) = entry
            .split_once("): \"")
            .unwrap_or_else(|| panic!("unexpected path entry {entry:?}"));
        let (path, _) = rest
            .split_once('"')
            .unwrap_or_else(|| panic!("unterminated path in {entry:?}"));
        let id: u64 = id.parse().unwrap_or_else(|_| panic!("route id {id:?}"));
        paths.insert(id, path.to_string());
    }

    let mut routes = BTreeMap::new();
    for entry in routes_text.split("RouteId(").filter(|e| !e.is_empty()) {
        let (id, rest) = entry
            .split_once("): MethodRouter(MethodRouter { ")
            .unwrap_or_else(|| panic!("route entry is not a method router: {entry:?}"));
        let id: u64 = id.parse().unwrap_or_else(|_| panic!("route id {id:?}"));
        let fields = rest.split_once(" })").map(|(f, _)| f).unwrap_or(rest);
        let mut methods = BTreeSet::new();
        for field in fields.split(", ") {
            let Some((name, value)) = field.split_once(": ") else {
                continue;
            };
            if METHODS.contains(&name) && value != "None" {
                methods.insert(name.to_string());
            }
        }
        let path = paths
            .get(&id)
            .unwrap_or_else(|| panic!("route {id} has no path in: {debug}"))
            .clone();
        assert!(!methods.is_empty(), "{path}: no method found in {entry:?}");
        routes.insert(path, methods);
    }
    assert!(
        routes.get("/v1/health").is_some_and(|m| m.contains("get")),
        "the parse of the router found no GET /v1/health: {routes:?}"
    );
    routes
}

fn document_json() -> Value {
    serde_json::to_value(super::document()).expect("the document serialises")
}

fn documented_routes(doc: &Value) -> BTreeMap<String, BTreeSet<String>> {
    doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .map(|(path, item)| {
            let methods = item
                .as_object()
                .expect("path item")
                .keys()
                .filter(|k| METHODS.contains(&k.as_str()))
                .cloned()
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

#[test]
fn every_route_the_router_answers_is_in_the_document_and_no_other() {
    let served = served_routes();
    assert!(
        served.len() >= 14,
        "only {} routes read from the router: {served:?}",
        served.len()
    );
    let doc = document_json();
    let documented = documented_routes(&doc);
    for (path, methods) in &served {
        assert_eq!(
            documented.get(path),
            Some(methods),
            "{path} {methods:?} is served but documented as {:?}: add it to the #[openapi(paths(..))] list in api/openapi.rs",
            documented.get(path)
        );
    }
    for (path, methods) in &documented {
        assert_eq!(
            served.get(path),
            Some(methods),
            "{path} {methods:?} is documented but the router serves {:?}",
            served.get(path)
        );
    }
}

#[test]
fn the_document_is_openapi_3_1_with_a_description_for_every_answer() {
    let doc = document_json();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["info"]["title"], "hearth HTTP API");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("item") {
            if !METHODS.contains(&method.as_str()) {
                continue;
            }
            let responses = op["responses"].as_object().expect("responses");
            assert!(!responses.is_empty(), "{method} {path}: no responses");
            for (status, r) in responses {
                // Required by OpenAPI 3.1 (Response Object).
                assert!(
                    r["description"].is_string(),
                    "{method} {path} {status}: no description"
                );
            }
            // Every path parameter is declared.
            for segment in path.split('/') {
                if let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    let declared = op["parameters"].as_array().is_some_and(|ps| {
                        ps.iter().any(|p| p["name"] == name && p["in"] == "path")
                    });
                    assert!(
                        declared,
                        "{method} {path}: parameter {name} is not declared"
                    );
                }
            }
        }
    }
    // The object schema names every kind, told apart by `kind`.
    let mapping = &doc["components"]["schemas"]["Object"]["discriminator"]["mapping"];
    for kind in hearth_api::Kind::ALL {
        assert_eq!(
            mapping[kind.as_str()],
            format!("#/components/schemas/{kind}"),
            "{kind} in the discriminator"
        );
        assert_eq!(
            doc["components"]["schemas"][kind.as_str()]["properties"]["kind"]["enum"],
            json!([kind.as_str()])
        );
    }
}

/// A validator for one schema of the document (`#/components/schemas/NAME`).
pub fn validator(doc: &Value, name: &str) -> jsonschema::Validator {
    let schema = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": format!("#/components/schemas/{name}"),
        "components": doc["components"],
    });
    jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("schema {name}: {e}"))
}

fn errors(v: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    v.iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("repo root")
        .to_path_buf()
}

/// Every document of examples/*.yaml and examples/debian/*.yaml, as JSON.
fn example_documents() -> Vec<(String, Value, PathBuf)> {
    let mut out = Vec::new();
    for dir in ["examples", "examples/debian"] {
        let dir = repo_root().join(dir);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read example");
            let origin = file.display().to_string();
            for raw in hearth_api::raw_documents(&text, &origin)
                .unwrap_or_else(|e| panic!("{origin}: {e}"))
            {
                out.push((format!("{origin}, {}", raw.label), raw.value, dir.clone()));
            }
        }
    }
    out
}

#[test]
fn example_manifests_validate_against_the_object_schema() {
    let doc = document_json();
    let objects = validator(&doc, "Object");
    let docs = example_documents();
    let kinds: BTreeSet<String> = docs
        .iter()
        .map(|(_, v, _)| v["kind"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(docs.len() >= 6, "only {} example documents", docs.len());
    for kind in [
        "VirtualMachine",
        "VirtualDisk",
        "VirtualImage",
        "VirtualNetwork",
    ] {
        assert!(kinds.contains(kind), "no {kind} among the examples");
    }
    for (label, value, dir) in &docs {
        let errs = errors(&objects, value);
        assert!(errs.is_empty(), "{label}: {errs:#?}\n{value:#}");
        // And hearth reads it as the same kind (paths resolved as the CLI does).
        let mut resolved = value.clone();
        hearth_api::resolve_relative_paths(&mut resolved, dir);
        let parsed = hearth_api::object_from_value(resolved, label)
            .unwrap_or_else(|e| panic!("{label}: hearth refuses it: {e}"));
        assert_eq!(Some(parsed.kind().as_str()), value["kind"].as_str());
    }
}

#[test]
fn what_hearth_refuses_the_schema_refuses_too() {
    let doc = document_json();
    let objects = validator(&doc, "Object");
    let vm = example_documents()
        .into_iter()
        .find(|(_, v, _)| v["kind"] == "VirtualMachine")
        .map(|(_, v, _)| v)
        .expect("a VirtualMachine example");
    let disk = json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                      "metadata": {"name": "d"}, "spec": {"size": "1Gi", "source": {"blank": {}}}});
    let with = |base: &Value, pointer: &str, value: Option<Value>| {
        let mut v = base.clone();
        let (parent, key) = pointer.rsplit_once('/').expect("pointer");
        let slot = v.pointer_mut(parent).expect("parent");
        match value {
            Some(x) => slot[key] = x,
            None => {
                slot.as_object_mut().expect("object").remove(key);
            }
        }
        v
    };
    let bad = [
        (
            "an unknown spec field",
            with(&vm, "/spec/colour", Some(json!("red"))),
        ),
        (
            "an unknown kind",
            with(&vm, "/kind", Some(json!("VirtualMachin"))),
        ),
        (
            "a wrong apiVersion",
            with(&vm, "/apiVersion", Some(json!("v1"))),
        ),
        ("no metadata.name", with(&vm, "/metadata/name", None)),
        (
            "a quantity with a bad suffix",
            with(&vm, "/spec/memory", Some(json!("12XB"))),
        ),
        (
            "a negative cpu count",
            with(&vm, "/spec/cpus", Some(json!(-1))),
        ),
        (
            "an unknown run policy",
            with(&vm, "/spec/runPolicy", Some(json!("Sometimes"))),
        ),
        (
            "two disk sources",
            with(
                &disk,
                "/spec/source",
                Some(json!({"blank": {}, "image": "/x.qcow2"})),
            ),
        ),
        (
            "a disk source with an extra key",
            with(
                &disk,
                "/spec/source",
                Some(json!({"snapshot": "s", "also": 1})),
            ),
        ),
        ("a disk without a source", with(&disk, "/spec/source", None)),
    ];
    assert!(
        errors(&objects, &disk).is_empty(),
        "{:?}",
        errors(&objects, &disk)
    );
    for (what, value) in bad {
        assert!(
            !objects.is_valid(&value),
            "the schema accepts {what}: {value:#}"
        );
        assert!(
            hearth_api::object_from_value(value.clone(), what).is_err(),
            "hearth accepts {what}, the schema does not: {value:#}"
        );
    }
}
