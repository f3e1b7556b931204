//! Layered configuration.
//!
//! Every service has a typed `Settings` struct with defaults. Values come, later overriding
//! earlier, from: the struct's `Default`, an optional TOML or JSON file, and environment
//! variables `AIP_<SECTION>__<KEY>` (double underscore between levels; e.g.
//! `AIP_GATEWAY__LISTEN=0.0.0.0:5000`, `AIP_NATS_URL=nats://nats:4222`).

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

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
            .try_parsing(true),
    );
    builder
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(wrap)
}
