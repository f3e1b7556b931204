//! `aip-registry`: the agent registry service (NATS + PostgreSQL) as a process. Runs until SIGINT/SIGTERM through
//! [`aip_runtime::runner`].

fn main() -> anyhow::Result<()> {
    aip_runtime::runner::main::<aip_registry::Application>(
        "The agent registry of the aip broker: agents, capabilities, liveness.",
    )
}
