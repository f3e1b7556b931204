//! `aip-sessions`: the session service as a process. Runs until SIGINT/SIGTERM through
//! [`aip_runtime::runner`].

fn main() -> anyhow::Result<()> {
    aip_runtime::runner::main::<aip_sessions::Application>(
        "AIP session service: durable tasks, command routing, results over REST.",
    )
}
