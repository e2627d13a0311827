//! A manifest file's bytes, as the manifest directory reads them: bytes to
//! documents to validated objects, or an error a person can act on. Never a
//! panic, never a hang (libFuzzer's `-timeout`), and what it returns holds:
//! - at least one object, at most the limit, none twice;
//! - each object printed as YAML (`hearth get -o yaml`) reads back as itself;
//! - an error's line and column, when it has them, are inside the file (or
//!   on the line after its last, where libyaml puts the end of the stream).

#![no_main]

use std::collections::HashSet;
use std::path::Path;

use hearth_api::limits::MAX_DOCUMENTS;
use hearth_api::manifest::parse_manifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_manifest(data, Path::new("/srv/manifests")) {
        Ok(objects) => {
            assert!(!objects.is_empty() && objects.len() <= MAX_DOCUMENTS);
            let mut seen = HashSet::new();
            for object in &objects {
                assert!(seen.insert((object.kind(), object.name().to_string())));
                // As the CLI prints what the API answers: JSON, as YAML.
                let json = serde_json::to_value(object).expect("an object prints");
                let yaml = serde_yaml_ng::to_string(&json).expect("JSON prints as YAML");
                let back = parse_manifest(yaml.as_bytes(), Path::new("/"))
                    .unwrap_or_else(|e| panic!("{yaml}: {e}"));
                assert_eq!(back.len(), 1);
                assert_eq!(&back[0], object, "{yaml}");
            }
        }
        Err(e) => {
            if let Some((line, column)) = e.location {
                assert!(
                    line >= 1 && line <= line_breaks(data) + 2 && column >= 1,
                    "{e}"
                );
            }
            assert!(!e.message.is_empty());
        }
    }
});

/// Line breaks as YAML counts them (CR, LF, and NEL, LS and PS), CR LF as
/// two: a bound on the number of lines, whichever a location counts.
fn line_breaks(data: &[u8]) -> usize {
    let ascii = data.iter().filter(|&&b| b == b'\n' || b == b'\r').count();
    let unicode = String::from_utf8_lossy(data)
        .chars()
        .filter(|c| matches!(c, '\u{85}' | '\u{2028}' | '\u{2029}'))
        .count();
    ascii + unicode
}
