//! The database driver turns Nagle's algorithm off on its TCP connections (README,
//! "Configuration"). With it on, as in sqlx 0.9.0, every statement larger than one TCP
//! segment waits for the server's delayed ACK, and PostgreSQL over TCP runs eight times
//! slower than over its Unix socket. This test looks at the socket option itself, on the
//! connections the pool opened, so a driver upgrade that drops it fails here.
//!
//! Needs `DATABASE_URL` to reach PostgreSQL over TCP (as in CI: `postgres://…@127.0.0.1:5432/…`).

use std::collections::HashSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use aip_store::Sql;
use aip_store::testing::TestDatabase;
use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
use sqlx::postgres::PgConnectOptions;

/// For every TCP connection of this process to one of `servers`: its local address and whether
/// `TCP_NODELAY` is set. Each socket is duplicated with `pidfd_getfd` (safe, unlike borrowing a
/// raw descriptor).
fn nodelay_to(servers: &HashSet<SocketAddr>) -> Vec<(SocketAddr, bool)> {
    let me = pidfd_open(getpid(), PidfdFlags::empty()).expect("pidfd_open");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("list /proc/self/fd") {
        let entry = entry.expect("read /proc/self/fd");
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"));
        let Ok(raw) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if !is_socket {
            continue;
        }
        let Ok(fd) = pidfd_getfd(&me, raw, PidfdGetfdFlags::empty()) else {
            continue; // closed meanwhile
        };
        let socket = socket2::SockRef::from(&fd);
        let peer = socket.peer_addr().ok().and_then(|a| a.as_socket());
        if peer.is_some_and(|peer| servers.contains(&peer)) {
            let local = socket.local_addr().ok().and_then(|a| a.as_socket());
            let nodelay = socket.tcp_nodelay().expect("getsockopt TCP_NODELAY");
            found.push((local.expect("a TCP socket's local address"), nodelay));
        }
    }
    found
}

#[tokio::test]
async fn postgres_connections_over_tcp_never_wait_on_nagle() {
    let test_db = TestDatabase::postgres()
        .await
        .expect("PostgreSQL must be running (DATABASE_URL)");
    let options = PgConnectOptions::from_str(test_db.url()).expect("a PostgreSQL URL");
    let host = options.get_host().to_owned();
    assert!(
        !host.starts_with('/') && options.get_socket().is_none(),
        "this test needs DATABASE_URL over TCP, not a Unix socket: {}",
        test_db.url()
    );
    let servers: HashSet<SocketAddr> = (host.as_str(), options.get_port())
        .to_socket_addrs()
        .expect("resolve the database host")
        .collect();

    let db = test_db.connect().await.expect("connect");
    // A statement larger than a loopback segment (64 KB), the size that used to stall.
    let big = "x".repeat(200_000);
    let echoed: (i32,) = db
        .query(&Sql::same("SELECT length($1::text)"))
        .bind(&big)
        .fetch_one()
        .await
        .expect("a large statement");
    assert_eq!(echoed.0, 200_000);

    // The check itself can fail: a plain socket to the same server has the option off.
    let plain = std::net::TcpStream::connect(servers.iter().next().expect("an address"))
        .expect("a plain connection to PostgreSQL");
    let plain_addr = plain.local_addr().expect("its local address");
    let found = nodelay_to(&servers);
    assert_eq!(
        found.iter().find(|(local, _)| *local == plain_addr),
        Some(&(plain_addr, false)),
        "a plain socket is seen, with TCP_NODELAY off"
    );
    let pool: Vec<bool> = found
        .iter()
        .filter(|(local, _)| *local != plain_addr)
        .map(|(_, on)| *on)
        .collect();
    assert!(
        !pool.is_empty(),
        "the pool holds no TCP connection to {servers:?}"
    );
    assert!(
        pool.iter().all(|on| *on),
        "TCP_NODELAY is off on {} of {} of the pool's connections to PostgreSQL",
        pool.iter().filter(|on| !**on).count(),
        pool.len()
    );
    drop(plain);
    db.close().await;
    test_db.cleanup().await;
}
