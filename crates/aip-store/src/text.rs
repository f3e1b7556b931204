//! Text as the databases can store it.
//!
//! PostgreSQL's text and jsonb cannot hold NUL (U+0000); a statement with one fails, and with
//! it the whole transaction, which under group commit holds other clients' changes too.
//! Whatever a client sends, stored text has NUL replaced by [`NUL_REPLACEMENT`], on both
//! databases alike.

use serde_json::Value;

/// The character neither PostgreSQL text nor jsonb can hold.
pub const NUL: char = '\0';
/// What a NUL is stored as.
pub const NUL_REPLACEMENT: &str = "\u{FFFD}";

/// `text` as it can be stored.
pub fn storable_text(text: &str) -> String {
    if text.contains(NUL) {
        text.replace(NUL, NUL_REPLACEMENT)
    } else {
        text.to_owned()
    }
}

/// `value` made storable: NUL in any string or key becomes [`NUL_REPLACEMENT`].
pub fn storable(value: &mut Value) {
    match value {
        Value::String(text) if text.contains(NUL) => {
            *text = text.replace(NUL, NUL_REPLACEMENT);
        }
        Value::Array(items) => items.iter_mut().for_each(storable),
        Value::Object(object) => {
            if object.keys().any(|k| k.contains(NUL)) {
                let entries = std::mem::take(object);
                for (key, mut item) in entries {
                    storable(&mut item);
                    object.insert(key.replace(NUL, NUL_REPLACEMENT), item);
                }
            } else {
                object.values_mut().for_each(storable);
            }
        }
        _ => {}
    }
}

/// Whether `value` takes `limit` bytes or more as JSON, found without encoding a large value:
/// its strings' own lengths are summed first (the encoding is never shorter), and only a value
/// shorter than `limit` that way is encoded to count its escapes. (Encoding even part of one
/// 90 MiB string scans all of it for characters to escape before writing any.)
pub fn json_len_reaches(value: &Value, limit: usize) -> bool {
    unescaped_len(value, limit) >= limit || encoded_len_reaches(value, limit)
}

/// [`json_len_reaches`] for an array of `items`, without making it a `Value`.
pub fn items_json_len_reaches(items: &[Value], limit: usize) -> bool {
    unescaped_items_len(items, limit) >= limit || encoded_len_reaches(items, limit)
}

/// `value`'s JSON text, if it takes `limit` bytes or more and holds no escaped NUL (text that
/// is stored as it is, see [`json_text`]). The buffer is sized from the strings' lengths up
/// front: a 90 MiB value grown by doubling was copied at each step and every fresh page
/// faulted in, which took longer than the encoding itself.
pub fn large_json_text(value: &Value, limit: usize) -> Option<Vec<u8>> {
    let at_least = unescaped_len(value, usize::MAX);
    if at_least < limit && !encoded_len_reaches(value, limit) {
        return None;
    }
    // Room for a few escapes too.
    let mut text = Vec::with_capacity(at_least + at_least / 64 + 64);
    // A `Value` always encodes.
    serde_json::to_writer(&mut text, value).ok()?;
    memchr::memmem::find(&text, b"\\u0000")
        .is_none()
        .then_some(text)
}

/// Whether encoding `value` writes `limit` bytes or more (the encoding stops there).
fn encoded_len_reaches<T: serde::Serialize + ?Sized>(value: &T, limit: usize) -> bool {
    struct Counter {
        counted: usize,
        limit: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.counted += bytes.len();
            if self.counted >= self.limit {
                // Enough counted: ends the encoding.
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter { counted: 0, limit };
    let _ = serde_json::to_writer(&mut counter, value);
    counter.counted >= limit
}

/// The length of `value`'s JSON text without its strings' escapes (a lower bound of it),
/// counted up to `limit`.
fn unescaped_len(value: &Value, limit: usize) -> usize {
    match value {
        Value::Null | Value::Bool(_) => 4,
        Value::Number(_) => 1,
        Value::String(text) => text.len() + 2,
        Value::Array(items) => unescaped_items_len(items, limit),
        Value::Object(fields) if fields.is_empty() => 2,
        Value::Object(fields) => {
            // `{`, then each `"key":value` and the `,` or `}` after it.
            let mut len = 1;
            for (key, item) in fields {
                len += key.len() + 4 + unescaped_len(item, limit.saturating_sub(len));
                if len >= limit {
                    break;
                }
            }
            len
        }
    }
}

/// [`unescaped_len`] of an array of `items`.
fn unescaped_items_len(items: &[Value], limit: usize) -> usize {
    if items.is_empty() {
        return 2;
    }
    // `[`, then each item and the `,` or `]` after it.
    let mut len = 1;
    for item in items {
        len += unescaped_len(item, limit.saturating_sub(len)) + 1;
        if len >= limit {
            break;
        }
    }
    len
}

/// `value` as storable JSON text. (serde_json writes NUL as the escape `\u0000`, which jsonb
/// refuses; only then is the value walked.)
pub fn json_text<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let text = serde_json::to_string(value)?;
    if !text.contains("\\u0000") {
        return Ok(text);
    }
    let mut value = serde_json::to_value(value)?;
    storable(&mut value);
    serde_json::to_string(&value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_values_json_length_is_told_against_a_limit() {
        let text = |n: usize| Value::String("a".repeat(n));
        // The encoding of a 10-byte string is 12 bytes.
        assert!(json_len_reaches(&text(10), 12));
        assert!(!json_len_reaches(&text(10), 13));
        // Escapes count: 10 quotes encode as 20 bytes and two more.
        assert!(json_len_reaches(&Value::String("\"".repeat(10)), 22));
        assert!(!json_len_reaches(&Value::String("\"".repeat(10)), 23));
        let nested = json!({ "results": [{ "png": "x".repeat(1000) }, null, 1.5] });
        let encoded = serde_json::to_string(&nested).expect("json").len();
        assert!(json_len_reaches(&nested, encoded));
        assert!(!json_len_reaches(&nested, encoded + 1));
        // A huge string is told at once.
        assert!(json_len_reaches(&text(50 << 20), 1 << 20));
    }

    #[test]
    fn nul_is_replaced_everywhere_and_nothing_else_changes() {
        assert_eq!(storable_text("a\0b"), "a\u{FFFD}b");
        assert_eq!(storable_text("plain"), "plain");
        let mut value = json!({ "k\0": ["v\0", 1, { "x": "\0" }], "n": null });
        storable(&mut value);
        assert_eq!(
            value,
            json!({ "k\u{FFFD}": ["v\u{FFFD}", 1, { "x": "\u{FFFD}" }], "n": null })
        );
        let text = json_text(&json!({ "a": "x\0" })).expect("encodes");
        assert!(!text.contains("\\u0000"), "{text}");
        let literal = json_text(&json!({ "a": "\\u0000" })).expect("encodes");
        assert_eq!(
            literal, r#"{"a":"\\u0000"}"#,
            "a backslash text is left alone"
        );
    }
}
