//! The version stamp of subject payloads.

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The payload version this build speaks. Every subject payload carries `"version": 1`;
/// a payload with another version is refused with a message naming both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct V1;

impl V1 {
    /// The number on the wire.
    pub const NUMBER: u64 = 1;
}

impl Serialize for V1 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(Self::NUMBER)
    }
}

impl<'de> Deserialize<'de> for V1 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        if n == Self::NUMBER {
            Ok(V1)
        } else {
            Err(serde::de::Error::custom(format!(
                "unsupported payload version {n}; this build speaks version {}",
                Self::NUMBER
            )))
        }
    }
}

impl JsonSchema for V1 {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PayloadVersion".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Payload version; this build speaks 1.",
            "const": 1,
            "type": "integer"
        })
    }
}

impl utoipa::PartialSchema for V1 {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Integer)
            .description(Some("Payload version; this build speaks 1."))
            .enum_values(Some([Self::NUMBER]))
            .into()
    }
}

impl utoipa::ToSchema for V1 {
    fn name() -> std::borrow::Cow<'static, str> {
        "PayloadVersion".into()
    }
}
