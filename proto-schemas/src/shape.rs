//! What a frame's JSON looks like, read without building it in memory.
//!
//! A JSON document parsed into values takes many times its size: `[0,0,0,…]` spends two bytes
//! per element on the wire and 32 in memory, so a 100 MiB frame could take gigabytes. Before a
//! large frame is parsed, [`count_values`] walks it once, allocating nothing, and refuses one
//! with more than [`MAX_FRAME_VALUES`] values; what a parse then holds is bounded by that count
//! and the frame's own bytes. [`head`] reads only a frame's `type` and `status`, for the error
//! of a frame that does not parse.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Most JSON values (objects, arrays, strings, numbers, booleans, nulls) in one frame. A
/// screenshot or a file is one string however large; a UI tree of 100,000 elements is well
/// under a million values. At roughly 100 bytes per parsed value, a frame at the limit takes
/// about 100 MB in memory besides its own bytes.
pub const MAX_FRAME_VALUES: usize = 1 << 20;

/// Frames up to this size are parsed without counting: even at the worst ratio (16 bytes in
/// memory per byte of JSON) they stay small.
pub const COUNT_FROM_BYTES: usize = 64 * 1024;

/// Why [`count_values`] stopped.
#[derive(Debug)]
pub enum CountError {
    /// More than the limit.
    TooMany {
        /// The limit.
        limit: usize,
    },
    /// Not one valid JSON document (the parse that follows says how).
    Invalid,
}

/// The number of JSON values in `bytes`, or [`CountError::TooMany`] as soon as it passes
/// `limit`.
pub fn count_values(bytes: &[u8], limit: usize) -> Result<usize, CountError> {
    let mut count = 0usize;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let counted = Counter {
        count: &mut count,
        limit,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end());
    match counted {
        Ok(()) => Ok(count),
        Err(_) if count > limit => Err(CountError::TooMany { limit }),
        Err(_) => Err(CountError::Invalid),
    }
}

/// Counts the values of one JSON value, failing once `count` passes `limit`.
struct Counter<'c> {
    count: &'c mut usize,
    limit: usize,
}

impl Counter<'_> {
    fn one<E: de::Error>(&mut self) -> Result<(), E> {
        *self.count += 1;
        if *self.count > self.limit {
            return Err(E::custom("too many values"));
        }
        Ok(())
    }

    fn again(&mut self) -> Counter<'_> {
        Counter {
            count: self.count,
            limit: self.limit,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Counter<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Counter<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(mut self, _: bool) -> Result<(), E> {
        self.one()
    }

    fn visit_i64<E: de::Error>(mut self, _: i64) -> Result<(), E> {
        self.one()
    }

    fn visit_u64<E: de::Error>(mut self, _: u64) -> Result<(), E> {
        self.one()
    }

    fn visit_f64<E: de::Error>(mut self, _: f64) -> Result<(), E> {
        self.one()
    }

    fn visit_str<E: de::Error>(mut self, _: &str) -> Result<(), E> {
        self.one()
    }

    fn visit_unit<E: de::Error>(mut self) -> Result<(), E> {
        self.one()
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.one()?;
        while seq.next_element_seed(self.again())?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.one()?;
        while map.next_key::<IgnoredAny>()?.is_some() {
            // The key and its value: a member costs a string besides its value.
            self.one()?;
            map.next_value_seed(self.again())?;
        }
        Ok(())
    }
}

/// A member of a frame's head: what the error of a frame that does not parse quotes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Member {
    /// `null`.
    Null,
    /// A string.
    Text(String),
    /// Anything else, by its kind (`a number`, `an array`, …).
    Other(&'static str),
}

/// A frame's top level, read without the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// An object, with its `type` and `status` when present.
    Object {
        /// `type`.
        kind: Option<Member>,
        /// `status`.
        status: Option<Member>,
    },
    /// Not an object: its kind.
    Other(&'static str),
}

/// Reads a frame's head; the error is serde_json's (the frame is not valid JSON).
pub fn head(bytes: &[u8]) -> Result<Head, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let head = de.deserialize_any(HeadVisitor)?;
    de.end()?;
    Ok(head)
}

struct HeadVisitor;

impl<'de> Visitor<'de> for HeadVisitor {
    type Value = Head;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Head, E> {
        Ok(Head::Other("a boolean"))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Head, E> {
        Ok(Head::Other("a number"))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Head, E> {
        Ok(Head::Other("a number"))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Head, E> {
        Ok(Head::Other("a number"))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Head, E> {
        Ok(Head::Other("a string"))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Head, E> {
        Ok(Head::Other("null"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Head, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Head::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
        let mut kind = None;
        let mut status = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "type" if kind.is_none() => kind = Some(map.next_value_seed(MemberSeed)?),
                "status" if status.is_none() => status = Some(map.next_value_seed(MemberSeed)?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Head::Object { kind, status })
    }
}

/// Reads one member as a [`Member`], skipping the insides of arrays and objects.
struct MemberSeed;

impl<'de> DeserializeSeed<'de> for MemberSeed {
    type Value = Member;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Member, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MemberSeed {
    type Value = Member;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Member, E> {
        Ok(Member::Other("a boolean"))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Member, E> {
        Ok(Member::Other("a number"))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Member, E> {
        Ok(Member::Other("a number"))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Member, E> {
        Ok(Member::Other("a number"))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Member, E> {
        Ok(Member::Text(text.to_owned()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Member, E> {
        Ok(Member::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Member, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Member::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Member, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Member::Other("an object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_counted_and_bounded() {
        assert_eq!(count_values(b"1", 10).ok(), Some(1));
        // The array, its three elements (the last an object), the object's key and its value.
        assert_eq!(count_values(br#"[1,"a",{"k":null}]"#, 10).ok(), Some(6));
        assert!(matches!(
            count_values(b"[0,0,0,0,0,0]", 5),
            Err(CountError::TooMany { limit: 5 })
        ));
        assert!(matches!(count_values(b"[0,", 5), Err(CountError::Invalid)));
        assert!(matches!(count_values(b"1 2", 5), Err(CountError::Invalid)));
    }

    #[test]
    fn a_head_is_read_without_the_rest() {
        let head = head(br#"{"payload":[1,2,{"x":[]}],"status":7,"type":"task"}"#).expect("json");
        assert_eq!(
            head,
            Head::Object {
                kind: Some(Member::Text("task".to_owned())),
                status: Some(Member::Other("a number")),
            }
        );
        assert_eq!(super::head(b"[1]").expect("json"), Head::Other("an array"));
        assert!(super::head(b"{").is_err());
    }
}
