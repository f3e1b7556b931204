//! A burst of connections is queued by the kernel until the listener accepts them, not
//! dropped: a client whose SYN is dropped tries again only after 1 s, then 3 s more, so a
//! gateway whose devices all reconnect at once (after its restart) would take seconds to take
//! them back. Every listener of the services and of `aip dev` is bound by `bind_tcp`.

use std::time::Duration;

use aip_runtime::ServiceName;
use aip_runtime::listener::{LISTEN_BACKLOG, ServiceListener};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// More connections than `TcpListener::bind`'s backlog of 128 holds; fewer than the kernel's
/// cap on any backlog (`net.core.somaxconn`, 4,096 by default) and few enough for a process
/// with the common limit of 1,024 open files.
const BURST: usize = 400;

/// Longer than a dropped SYN's first two retries (1 s, then 3 s): a connection still not
/// established then would only be after the listener accepted some.
const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_burst_of_connections_waits_in_the_backlog_while_nothing_accepts() {
    assert!(BURST < LISTEN_BACKLOG as usize);
    let any_port = "127.0.0.1:0".parse().expect("an address");
    let listener = ServiceListener::bind(ServiceName::Gateway, any_port)
        .await
        .expect("bind");
    let addr = listener.local_addr();

    // Nothing accepts: every handshake has to be completed and held by the kernel.
    let mut connects = JoinSet::new();
    for _ in 0..BURST {
        connects.spawn(tokio::time::timeout(WAIT, TcpStream::connect(addr)));
    }
    let mut established = Vec::new();
    let mut not_established = 0;
    while let Some(joined) = connects.join_next().await {
        match joined.expect("a connect task") {
            Ok(Ok(stream)) => established.push(stream),
            Ok(Err(_)) | Err(_) => not_established += 1,
        }
    }
    assert_eq!(
        not_established, 0,
        "{not_established} of {BURST} connections were not established within {WAIT:?} while \
         the listener accepted nothing: its backlog is too small (`ss -ltn` shows it as Send-Q)"
    );
    drop(listener);
}
