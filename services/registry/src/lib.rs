//! # aip-registry: who is connected, with what, and where
//!
//! The registry owns the agents: identity, client type, capabilities, tools, system info,
//! status (available, busy, offline), the gateway and connection holding each one, and when
//! it was last seen. It answers on the bus ([`bus_api`]):
//!
//! - `registry.register`: UFO's checks in UFO's order (a constellation's target must be a live
//!   device; a live id is not registered twice, except taken over by the same credential);
//! - `registry.unregister`, `registry.get`, `registry.lookup` (available, live agents with the
//!   capabilities asked for, least loaded first);
//! - `registry.agents`: seed 004's agent management, asked by the session service for a
//!   TaskRequest saying "register me as an agent" (agents reached at an address, kept in a
//!   table of their own) or "find an agent" (those and the available devices);
//!
//! takes gateways' presence batches ([`presence`]) and marks offline what stopped being live
//! ([`reaper`]). Its REST API ([`http`]) serves UFO's `/api/clients` and `/api/health` and
//! its own `/api/agents`.
//!
//! Layers: [`registry::Registry`] holds the rules; [`store::AgentStore`] the tables, on
//! PostgreSQL or SQLite; the bus is any [`aip_bus::Bus`]. [`Application`] puts them together.

pub mod bus_api;
pub mod group_commit;
pub mod http;
pub mod notices;
pub mod presence;
pub mod python_repr;
pub mod reaper;
pub mod registry;
pub mod settings;
pub mod startup;
pub mod store;

pub use aip_runtime::StartError;
pub use registry::Registry;
pub use settings::{RegistrySettings, Settings};
pub use startup::{Application, RunError};
pub use store::AgentStore;
