//! # aip-runtime: what every aip binary shares
//!
//! - [`api_error`]: the one REST error, extractors that refuse with it, shared OpenAPI parts;
//! - [`service`]: what every service's settings share, checked once, and [`StartError`];
//! - [`runner`]: the one `main` of every service binary (serve, `migrate`, `probe`, `--check`);
//! - [`check`]: which environment variables a binary reads, and the ones it would ignore;
//! - [`listener`]: a service's own listener, or none when `aip dev` embeds it;
//! - [`health`]: `/healthz` and `/readyz`, one body shape everywhere;
//! - [`api_keys`]: REST API keys (`X-API-Key` or `Authorization: Bearer`) and the callers
//!   they name, operators or limited principals;
//! - [`patterns`]: id patterns (exact, or a prefix ending in `*`) of credentials and principals;
//! - [`settings`]: layered configuration (embedded defaults, optional file, `AIP_…` environment);
//! - [`telemetry`]: tracing initialised in one place;
//! - [`shutdown`]: SIGINT/SIGTERM as a future, for graceful drain;
//! - [`install_crypto_provider`]: rustls' ring provider, installed once at start-up;
//! - the process's memory allocator (jemalloc), for every binary and test that links this.

pub mod api_error;
pub mod api_keys;
pub mod check;
pub mod health;
pub mod listener;
pub mod metrics;
pub mod origin;
pub mod patterns;
pub mod runner;
pub mod service;
pub mod settings;
pub mod shutdown;
pub mod telemetry;

pub use service::{ServiceName, ServiceSettings, StartError};

/// Every aip process allocates with jemalloc. Measured under the task load, glibc's malloc was
/// the largest single cost of the session service (`malloc_consolidate`, `_int_free`), and it
/// keeps freed memory: after a 90 MiB result a service stayed at several hundred MiB. jemalloc
/// is faster for many small short-lived allocations, and its background thread returns freed
/// pages to the system within about a second also in a process that has gone idle (its
/// configuration is set at build time, in `.cargo/config.toml`). mimalloc was tried first: as
/// fast, but it returns pages only when the thread that freed them allocates again, so an idle
/// gateway kept 600 MiB after a 90 MiB result.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Installs rustls' ring crypto provider for the process. Call once at the start of `main`
/// (and of test harnesses) before any TLS client is built; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
