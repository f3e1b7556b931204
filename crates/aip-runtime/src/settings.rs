//! Layered configuration.
//!
//! Every service has a typed `Settings` struct with defaults. Values come, later overriding
//! earlier, from: the struct's `Default`, an optional TOML or JSON file, and environment
//! variables `AIP_<SECTION>__<KEY>` (double underscore between levels; e.g.
//! `AIP_GATEWAY__LISTEN=0.0.0.0:5000`, `AIP_NATS_URL=nats://nats:4222`).

use std::collections::HashMap;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserializer, Serialize};

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The file, the environment or a value was wrong.
    #[error("invalid configuration{}: {source}", file.as_deref().map(|f| format!(" (file {f})")).unwrap_or_default())]
    Invalid {
        /// The config file, if one was given.
        file: Option<String>,
        /// What was wrong.
        source: config::ConfigError,
    },
    /// A value was syntactically fine but not acceptable.
    #[error("invalid configuration: {0}")]
    Rejected(String),
}

/// Loads `T` from its defaults, then `file` (if given; it must exist), then `AIP_…` variables.
pub fn load<T>(file: Option<&Path>) -> Result<T, SettingsError>
where
    T: Default + Serialize + DeserializeOwned,
{
    load_with(file, None)
}

/// As [`load`], with `environment` in place of the process's variables: tests check variable
/// names without changing the process's environment.
pub fn load_from<T>(
    file: Option<&Path>,
    environment: HashMap<String, String>,
) -> Result<T, SettingsError>
where
    T: Default + Serialize + DeserializeOwned,
{
    load_with(file, Some(environment))
}

fn load_with<T>(
    file: Option<&Path>,
    environment: Option<HashMap<String, String>>,
) -> Result<T, SettingsError>
where
    T: Default + Serialize + DeserializeOwned,
{
    let wrap = |source| SettingsError::Invalid {
        file: file.map(|f| f.display().to_string()),
        source,
    };
    let defaults = config::Config::try_from(&T::default()).map_err(wrap)?;
    let mut builder = config::Config::builder().add_source(defaults);
    if let Some(path) = file {
        builder = builder.add_source(config::File::from(path).required(true));
    }
    builder = builder.add_source(
        config::Environment::with_prefix("AIP")
            .prefix_separator("_")
            .separator("__")
            .try_parsing(true)
            .source(environment),
    );
    builder
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(wrap)
}

/// Accepts `["a", "b"]` or `"a,b"` (environment variables carry one string, which the
/// configuration loader may already have turned into a number or a boolean).
pub fn string_or_list<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    struct Keys;

    impl<'de> serde::de::Visitor<'de> for Keys {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of keys or one comma-separated string")
        }

        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok(s.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
                .collect())
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(vec![v.to_string()])
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(vec![v.to_string()])
        }

        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(vec![v.to_string()])
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut keys = Vec::new();
            while let Some(key) = seq.next_element::<String>()? {
                if key.trim().is_empty() {
                    // An empty API key would make an empty header a key; an empty origin means
                    // nothing. Refused rather than dropped, so the mistake is seen.
                    return Err(serde::de::Error::custom(
                        "an empty entry in the list; remove it",
                    ));
                }
                keys.push(key.trim().to_owned());
            }
            Ok(keys)
        }
    }

    deserializer.deserialize_any(Keys)
}
