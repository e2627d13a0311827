//! Credentials in URLs (`https://user:password@host/path`): hearthd needs
//! them to download, and shows them nowhere. Events, status, errors, logs
//! and the CLI's output show such a URL with its user information replaced
//! by [`REDACTED`] (`https://***@host/path`).

use std::borrow::Cow;

use serde_json::Value;

/// What a URL's user information is shown as.
pub const REDACTED: &str = "***";

/// `text` with the user information (`user:password@`) of every URL in it
/// replaced by [`REDACTED`]. A URL is anything after `://` up to the next
/// `/`, `?`, `#`, quote, bracket, backslash, white space or control
/// character; its user information is what comes before its last `@`.
pub fn redact_credentials(text: &str) -> Cow<'_, str> {
    let mut out = String::new();
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = text[from..].find("://") {
        let host_start = from + found + 3;
        let authority_len = text[host_start..]
            .find(ends_authority)
            .unwrap_or(text.len() - host_start);
        let authority = &text[host_start..host_start + authority_len];
        if let Some(at) = authority.rfind('@')
            && at > 0
            && &authority[..at] != REDACTED
        {
            out.push_str(&text[copied..host_start]);
            out.push_str(REDACTED);
            copied = host_start + at;
        }
        from = host_start + authority_len;
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

fn ends_authority(c: char) -> bool {
    matches!(
        c,
        '/' | '?' | '#' | '"' | '\'' | '`' | '<' | '>' | '\\' | '[' | ']'
    ) || c.is_whitespace()
        || c.is_control()
}

/// Every string in `value` (not the keys) passed through
/// [`redact_credentials`].
pub fn redact_json(value: &mut Value) {
    match value {
        Value::String(s) => {
            if let Cow::Owned(r) = redact_credentials(s) {
                *s = r;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact_json),
        Value::Object(map) => map.values_mut().for_each(redact_json),
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// Whether `shown` is `stored` as [`redact_credentials`] shows it, and not
/// `stored` itself: a URL read back from hearthd and sent again, which
/// means the stored one.
pub fn is_redacted_form_of(shown: &str, stored: &str) -> bool {
    shown != stored && redact_credentials(stored) == shown
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn user_information_is_replaced_and_the_rest_kept() {
        for (text, want) in [
            (
                "GET https://user:pa55@example.com:8443/x.qcow2?a=b: 404",
                "GET https://***@example.com:8443/x.qcow2?a=b: 404",
            ),
            ("http://token@host/x", "http://***@host/x"),
            (
                "\"ftp://a:b@h\" and http://c:d@h2",
                "\"ftp://***@h\" and http://***@h2",
            ),
            // An @ in the password: everything before the last one.
            ("http://u:p@ss@h/p", "http://***@h/p"),
            // An @ in the path is not user information.
            ("http://h/a@b", "http://h/a@b"),
            ("mailto:a@b and http://h", "mailto:a@b and http://h"),
            ("http://@h/", "http://@h/"),
            ("http://***@h/", "http://***@h/"),
            ("no url at all", "no url at all"),
            ("ends with ://", "ends with ://"),
        ] {
            assert_eq!(redact_credentials(text), want, "{text}");
        }
    }

    #[test]
    fn json_strings_are_redacted_keys_are_not() {
        let mut v = serde_json::json!({
            "spec": {"source": {"http": {"url": "https://u:p@h/x"}}},
            "events": [{"message": "downloading https://u:p@h/x"}],
            "https://k:v@h": 1
        });
        redact_json(&mut v);
        assert_eq!(v["spec"]["source"]["http"]["url"], "https://***@h/x");
        assert_eq!(v["events"][0]["message"], "downloading https://***@h/x");
        assert_eq!(v["https://k:v@h"], 1);
    }

    #[test]
    fn a_redacted_url_is_known_for_the_stored_one() {
        assert!(is_redacted_form_of("https://***@h/x", "https://u:p@h/x"));
        assert!(!is_redacted_form_of("https://u:p@h/x", "https://u:p@h/x"));
        assert!(!is_redacted_form_of("https://***@h/y", "https://u:p@h/x"));
        assert!(!is_redacted_form_of("https://h/x", "https://h/x"));
    }

    proptest! {
        #[test]
        fn no_password_survives_and_redacting_twice_changes_nothing(
            before in "[ -~]{0,20}",
            scheme in "[a-z]{1,6}",
            user in "[a-zA-Z0-9._~-]{0,8}",
            password in "[a-zA-Z0-9._~!$&()*+,;=%-]{12,20}",
            host in "[a-z0-9.-]{1,12}(:[0-9]{1,5})?",
            path in "(/[ -~]{0,20})?",
        ) {
            let text = format!("{before} {scheme}://{user}:{password}@{host}{path}");
            let once = redact_credentials(&text).into_owned();
            prop_assert!(!once.contains(&format!(":{password}@")), "{}", once);
            prop_assert!(once.contains(&format!("{scheme}://***@{host}")), "{}", once);
            prop_assert_eq!(redact_credentials(&once).into_owned(), once.clone());
        }

        #[test]
        fn text_without_user_information_is_unchanged(text in "[^@]{0,60}") {
            prop_assert!(matches!(redact_credentials(&text), Cow::Borrowed(_)));
        }
    }
}
