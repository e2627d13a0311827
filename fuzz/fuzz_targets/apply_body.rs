//! An apply request body (`POST /v1/apply`): JSON bytes to validated
//! objects with `hearth_api::apply_request`, the body's JSON and then each
//! item through `object_from_value`, as the API's handler reads it. Never a
//! panic, never a hang; an accepted object validates, and printed as JSON
//! (what the API answers) it reads back as itself.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match hearth_api::apply_request(data) {
        Ok(objects) => {
            for object in &objects {
                object.validate().expect("an accepted object is valid");
            }
            let body = serde_json::json!({ "items": objects }).to_string();
            let back = hearth_api::apply_request(body.as_bytes())
                .unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(back, objects, "{body}");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
