//! Client-provided ids turned into NATS subject tokens and back.
//!
//! Any string must encode to exactly one valid token that decodes to the same string, and
//! decoding must never panic: tokens also arrive from subjects on the bus.

#![no_main]

use libfuzzer_sys::fuzz_target;
use proto_schemas::Subjects;
use proto_schemas::subjects::{decode_token, encode_token, is_valid_token};

fuzz_target!(|data: &[u8]| {
    // Every string, including the lossy reading of bytes that are not UTF-8.
    let id = String::from_utf8_lossy(data);
    let token = encode_token(&id);
    assert!(is_valid_token(&token), "{token:?} is not a valid token");
    assert!(
        token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'~'),
        "{token:?} holds a byte outside the encoding's alphabet"
    );
    assert_eq!(decode_token(&token).as_deref(), Some(&*id), "round trip");

    // A subject built from the id has the id as exactly one token after `frames`.
    let subjects = Subjects::default();
    let subject = subjects.frames(&id);
    let tail = subject
        .strip_prefix(&format!("{}.frames.", subjects.prefix()))
        .expect("the subject starts with its prefix");
    assert_eq!(tail, token, "the id is one token");

    // Arbitrary text as a token, as read back from a subject: decodes only if canonical.
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some(decoded) = decode_token(text) {
            assert_eq!(
                encode_token(&decoded),
                text,
                "a non-canonical token decoded"
            );
        }
        // A prefix is accepted only if every token of every subject under it stays valid.
        if let Ok(subjects) = Subjects::new(text) {
            assert!(
                subjects.prefix().split('.').all(is_valid_token),
                "prefix {text:?} accepted with an invalid token"
            );
        }
    }
});
