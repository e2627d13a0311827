//! One manifest file's bytes to objects, or an error a person can act on,
//! with a line and column wherever one can be found. Pure: bytes in. The
//! manifest directory (hearth-engine's `manifest` module) reads files with it.
//!
//! Every way a file can be unusable is an error here, never "no objects":
//! an empty file, a file of comments only, binary data, a YAML syntax error,
//! an unknown field, a missing name, a text over one of the [`limits`]. The
//! directory keeps the last good state of a file that fails, so none of
//! these can ever delete anything.
//!
//! [`limits`]: crate::limits

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use crate::object::{Object, ParseError, object_from_value, raw_documents, resolve_relative_paths};

/// Why a file's content cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileError {
    /// 1-based line and column, when known.
    pub location: Option<(usize, usize)>,
    pub message: String,
}

impl FileError {
    pub fn new(message: impl Into<String>) -> FileError {
        FileError {
            location: None,
            message: message.into(),
        }
    }

    pub fn at(location: (usize, usize), message: impl Into<String>) -> FileError {
        FileError {
            location: Some(location),
            message: message.into(),
        }
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.location {
            Some((line, column)) => write!(f, "line {line}, column {column}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Parses a manifest file: one or more YAML or JSON documents, `{"items":
/// [...]}` lists expanded. Relative host paths resolve against `base` (the
/// manifest directory), as `hearth apply -f` does. All or nothing: one bad
/// document makes the whole file an error.
pub fn parse_manifest(bytes: &[u8], base: &Path) -> Result<Vec<Object>, FileError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(FileError::new(
            "the file is empty (an empty file is never taken as a deletion: remove the file to delete its objects)",
        ));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        FileError::at(
            line_column(bytes, e.valid_up_to()),
            "not UTF-8 text (binary data?)",
        )
    })?;
    let raws = raw_documents(text, "").map_err(|e| match e {
        ParseError::Syntax {
            line,
            column,
            message,
            ..
        } if line > 0 => FileError::at((line, column), message),
        ParseError::Syntax { message, .. } => FileError::new(message),
        ParseError::Limit { error, .. } => FileError {
            location: error.location,
            message: error.message,
        },
        ParseError::Invalid { error, .. } => FileError {
            location: locate(text, None, &error.field),
            message: format!("{}: {}: {}", error.object, error.field, error.message),
        },
    })?;
    // Only once the text is known to be within the limits.
    let docs = document_spans(text);
    let mut out: Vec<Object> = Vec::new();
    let mut seen = HashSet::new();
    for mut raw in raws {
        let span = docs.get(raw.document).copied();
        resolve_relative_paths(&mut raw.value, base);
        let obj = object_from_value(raw.value, &raw.label).map_err(|e| FileError {
            location: locate(text, span, &e.field),
            message: e.to_string(),
        })?;
        if !seen.insert((obj.kind(), obj.name().to_string())) {
            return Err(FileError {
                location: locate(text, span, "metadata.name"),
                message: format!("{} is declared twice in this file", obj.display_name()),
            });
        }
        out.push(obj);
    }
    if out.is_empty() {
        return Err(FileError::new(
            "the file declares no objects (only comments or empty documents); it is never taken as a deletion: remove the file to delete its objects",
        ));
    }
    Ok(out)
}

/// 1-based line and column of byte `offset`.
fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let column = before.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
    (line, column)
}

/// Line ranges `[start, end)` (0-based) of the YAML documents in `text`,
/// split at `---` lines. A heuristic that matches what the YAML parser counts
/// for ordinary files; it only serves to point at a line.
fn document_spans(text: &str) -> Vec<(usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut spans = Vec::new();
    let mut start = 0;
    for (i, line) in lines.iter().enumerate() {
        if *line == "---" || line.starts_with("--- ") {
            spans.push((start, i));
            start = i + 1;
        }
    }
    spans.push((start, lines.len()));
    // Comments or nothing before the first `---` are not a document.
    if let Some(&(s, e)) = spans.first()
        && spans.len() > 1
        && lines[s..e].iter().all(|l| {
            let t = l.trim();
            t.is_empty() || t.starts_with('#')
        })
    {
        spans.remove(0);
    }
    spans
}

/// Finds where a field path such as `spec.disks[1].virtualDiskName` is in a
/// document: each key is searched after the previous one, so the deepest key
/// found is where the error is (or where the missing field belongs). Falls
/// back to the document's first line. A hint for people, not a YAML parser:
/// it understands block and flow style and quoted keys.
fn locate(text: &str, span: Option<(usize, usize)>, field: &str) -> Option<(usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let (start, end) = span.unwrap_or((0, lines.len()));
    let end = end.min(lines.len());
    if start >= end {
        return None;
    }
    let keys = field
        .split('.')
        .map(|k| k.split('[').next().unwrap_or(k))
        .filter(|k| !k.is_empty() && !k.starts_with('('));
    let mut pos = (start, 0usize);
    let mut found = None;
    'keys: for key in keys {
        for (line_no, line) in lines.iter().enumerate().take(end).skip(pos.0) {
            let from = if line_no == pos.0 { pos.1 } else { 0 };
            if let Some(col) = find_key(line, key, from) {
                pos = (line_no, col + key.len());
                found = Some((line_no + 1, col + 1));
                continue 'keys;
            }
        }
        break;
    }
    found.or(Some((start + 1, 1)))
}

/// Byte column of `key` used as a mapping key in `line`, at or after `from`.
fn find_key(line: &str, key: &str, from: usize) -> Option<usize> {
    let bytes = line.as_bytes();
    let mut search = from;
    while search <= line.len() {
        let idx = search + line.get(search..)?.find(key)?;
        let before_ok = idx == 0
            || matches!(
                bytes[idx - 1],
                b' ' | b'\t' | b'{' | b',' | b'"' | b'\'' | b'-'
            );
        let mut after = idx + key.len();
        if matches!(bytes.get(after), Some(b'"' | b'\'')) {
            after += 1;
        }
        while matches!(bytes.get(after), Some(b' ' | b'\t')) {
            after += 1;
        }
        if before_ok && bytes.get(after) == Some(&b':') {
            // Point at the opening quote of a quoted key.
            let col = if idx > 0 && matches!(bytes[idx - 1], b'"' | b'\'') {
                idx - 1
            } else {
                idx
            };
            return Some(col);
        }
        search = idx + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "/srv/manifests";

    fn vm(extra: &str) -> String {
        format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata:\n  name: demo\nspec:\n  memory: 256Mi\n{extra}  boot:\n    kernel: boot/vmlinuz\n"
        )
    }

    fn err(text: &[u8]) -> FileError {
        parse_manifest(text, Path::new(BASE)).expect_err("must not parse")
    }

    #[test]
    fn a_valid_file_resolves_relative_paths_against_the_directory() {
        let objs = parse_manifest(vm("").as_bytes(), Path::new(BASE)).expect("parses");
        let Object::VirtualMachine(v) = &objs[0] else {
            panic!("not a VM")
        };
        assert_eq!(
            v.spec.boot.as_ref().expect("boot").kernel,
            Some(Path::new("/srv/manifests/boot/vmlinuz").to_path_buf())
        );
    }

    #[test]
    fn empty_whitespace_and_comment_only_files_are_errors_not_empty_lists() {
        assert!(err(b"").message.contains("empty"));
        assert!(err(b"  \n\n\t").message.contains("empty"));
        assert!(err(b"# nothing here\n---\n").message.contains("no objects"));
    }

    #[test]
    fn binary_garbage_is_an_error_with_a_location() {
        let e = err(b"apiVersion: x\n\xff\xfe\x00garbage");
        assert_eq!(e.location, Some((2, 1)), "{e}");
        assert!(e.message.contains("UTF-8"), "{e}");
        let e = err(b"\x00\x01\x02\x03 binary \x7f");
        assert!(e.location.is_some(), "{e}");
    }

    #[test]
    fn syntax_errors_carry_line_and_column_once() {
        let e = err(b"apiVersion: hearth.dev/v1alpha1\nkind: [VirtualMachine\n");
        let (line, column) = e.location.expect("location");
        assert!(line >= 2, "{e}");
        let text = e.to_string();
        let own = format!("line {line} column {column}");
        assert!(!text.contains(&own), "the location is said once: {text}");
    }

    #[test]
    fn an_unknown_field_points_at_its_line() {
        let e = err(vm("  gpus: 2\n").as_bytes());
        assert_eq!(e.location, Some((7, 3)), "{e}");
        assert!(e.message.contains("spec.gpus"), "{e}");
    }

    #[test]
    fn a_missing_name_points_at_metadata() {
        let text = vm("").replace("  name: demo\n", "  labels: {}\n");
        let e = err(text.as_bytes());
        assert!(e.message.contains("metadata"), "{e}");
        assert_eq!(e.location.map(|l| l.0), Some(3), "{e}");
    }

    #[test]
    fn errors_in_a_later_document_point_into_that_document() {
        let text = format!(
            "{}---\n{}",
            vm(""),
            vm("  cpus: 0\n").replace("demo", "two")
        );
        let e = err(text.as_bytes());
        assert!(e.message.contains("spec.cpus"), "{e}");
        assert_eq!(e.location, Some((16, 3)), "{e}");
    }

    #[test]
    fn json_and_flow_style_keys_are_found() {
        let json = r#"{"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
 "metadata": {"name": "j"},
 "spec": {"boot": {"kernel": "/k"}, "bogus": 1}}"#;
        let e = err(json.as_bytes());
        assert_eq!(e.location, Some((3, 37)), "{e}");
    }

    #[test]
    fn the_same_object_twice_in_one_file_is_an_error() {
        let text = format!("{}---\n{}", vm(""), vm(""));
        assert!(err(text.as_bytes()).message.contains("declared twice"));
    }

    #[test]
    fn a_text_over_a_limit_is_an_error_with_its_location() {
        let e = err(format!("kind: VirtualDisk\nspec: {}", "{a: ".repeat(100_000)).as_bytes());
        assert_eq!(e.location, Some((2, 6 + 4 * 31 + 1)), "{e}");
        assert!(e.message.contains("nested more than 32 levels"), "{e}");
        let e = err(vm("")
            .repeat(1001)
            .replace("apiVersion", "---\napiVersion")
            .as_bytes());
        assert!(e.message.contains("more than 1000 documents"), "{e}");
        let e = err(&vec![b'#'; crate::limits::MAX_MANIFEST_BYTES + 1]);
        assert_eq!(e.location, None);
        assert!(e.message.contains("larger than the 4194304 bytes"), "{e}");
    }

    #[test]
    fn locate_handles_quotes_and_falls_back_to_the_document_start() {
        assert_eq!(find_key("  \"spec\": {", "spec", 0), Some(2));
        assert_eq!(find_key("  specs: 1", "spec", 0), None);
        assert_eq!(find_key("{a: 1, b: 2}", "b", 0), Some(7));
        assert_eq!(locate("a: 1\n", None, "nothing.here"), Some((1, 1)));
    }
}
