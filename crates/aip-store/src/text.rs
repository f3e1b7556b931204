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
