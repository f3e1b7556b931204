//! `aip-gateway`: the WebSocket gateway as a process. Runs until SIGINT/SIGTERM through
//! [`aip_runtime::runner`].

fn main() -> anyhow::Result<()> {
    aip_runtime::runner::main::<aip_gateway::Application>(
        "AIP WebSocket gateway: clients connect to /ws; frames travel over NATS.",
    )
}
