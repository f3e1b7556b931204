//! Tracing, initialised in one function.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt;

/// How log lines are written (`AIP_LOG_FORMAT=pretty|json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines (development).
    #[default]
    Pretty,
    /// One JSON object per line (production).
    Json,
}

/// Installs the global subscriber. The filter comes from `RUST_LOG` when set, else
/// `default_filter` (e.g. `info`). Calling it twice is harmless.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let result = match format {
        LogFormat::Pretty => fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .compact()
            .try_init(),
        LogFormat::Json => fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .json()
            .try_init(),
    };
    drop(result);
}
