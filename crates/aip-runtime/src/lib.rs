//! # aip-runtime: what every aip binary shares
//!
//! - [`api_keys`]: REST API keys (`X-API-Key` or `Authorization: Bearer`);
//! - [`settings`]: layered configuration (embedded defaults, optional file, `AIP_…` environment);
//! - [`telemetry`]: tracing initialised in one place;
//! - [`shutdown`]: SIGINT/SIGTERM as a future, for graceful drain;
//! - [`install_crypto_provider`]: rustls' ring provider, installed once at start-up.

pub mod api_keys;
pub mod settings;
pub mod shutdown;
pub mod telemetry;

/// Installs rustls' ring crypto provider for the process. Call once at the start of `main`
/// (and of test harnesses) before any TLS client is built; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
