//! Connection limits before authentication: a listener closes a socket over its per-address
//! or total limit as soon as it accepts it, before reading anything (no HTTP answer), and
//! gives the place back when a connection closes. Every listener of the services and of
//! `aip dev` serves this way.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use aip_runtime::listener::{ConnectionLimits, serve_http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// How long a test waits for something that should happen at once.
const WAIT: Duration = Duration::from_secs(5);

/// A server with `limits`, stopped when dropped.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Server {
    async fn start(limits: ConnectionLimits) -> Server {
        aip_runtime::install_crypto_provider();
        aip_runtime::metrics::install();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_http(listener, router, limits, async {
            let _ = stopped.await;
        }));
        Server {
            addr,
            stop: Some(stop),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Connects to `addr` from `source` (any loopback address works on Linux).
async fn connect_from(source: &str, addr: SocketAddr) -> TcpStream {
    let source: IpAddr = source.parse().expect("an address");
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(source, 0))
        .expect("bind the client's address");
    socket.connect(addr).await.expect("connect")
}

/// What one request on `stream` (kept alive) got.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// `200 ok`: the connection is served and stays open.
    Served,
    /// The connection was closed (or reset) without a byte of answer.
    ClosedUnanswered,
}

async fn request(stream: &mut TcpStream) -> Answer {
    let sent = stream
        .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        .await;
    if sent.is_err() {
        return Answer::ClosedUnanswered;
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let read = tokio::time::timeout(WAIT, stream.read(&mut buf))
            .await
            .expect("an answer or a close within the wait");
        match read {
            Ok(0) | Err(_) => {
                assert!(
                    answer.is_empty(),
                    "closed after a partial answer: {:?}",
                    String::from_utf8_lossy(&answer)
                );
                return Answer::ClosedUnanswered;
            }
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&answer);
        if text.starts_with("HTTP/1.1 200") && text.ends_with("\r\n\r\nok") {
            return Answer::Served;
        }
    }
}

/// Opens a connection from `source` and sends a request on it.
async fn open(source: &str, addr: SocketAddr) -> (TcpStream, Answer) {
    let mut stream = connect_from(source, addr).await;
    let answer = request(&mut stream).await;
    (stream, answer)
}

/// Opens connections from `source` until one is served (the server gives places back when
/// it notices a close, a moment after it).
async fn served_eventually(source: &str, addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + WAIT;
    loop {
        let (stream, answer) = open(source, addr).await;
        if answer == Answer::Served {
            return stream;
        }
        assert!(Instant::now() < deadline, "no place came free for {source}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_source_over_its_limit_is_closed_unanswered_and_others_get_in() {
    let server = Server::start(ConnectionLimits {
        total: 0,
        per_address: 3,
    })
    .await;
    let addr = server.addr;

    let mut held = Vec::new();
    for _ in 0..3 {
        let (stream, answer) = open("127.0.0.1", addr).await;
        assert_eq!(answer, Answer::Served);
        held.push(stream);
    }
    let (_, answer) = open("127.0.0.1", addr).await;
    assert_eq!(
        answer,
        Answer::ClosedUnanswered,
        "the fourth from 127.0.0.1"
    );

    // Another address is not affected; the ones held are still served.
    let (_other, answer) = open("127.0.0.2", addr).await;
    assert_eq!(answer, Answer::Served, "127.0.0.2 gets in");
    for stream in &mut held {
        assert_eq!(request(stream).await, Answer::Served, "held ones stay open");
    }

    // One of the three closes: its place is given back.
    drop(held.pop());
    held.push(served_eventually("127.0.0.1", addr).await);
    let (_, answer) = open("127.0.0.1", addr).await;
    assert_eq!(answer, Answer::ClosedUnanswered, "full again");

    // Refusals are counted.
    let metrics = aip_runtime::metrics::install()
        .expect("a recorder")
        .render();
    assert!(
        metrics.lines().any(
            |l| l.starts_with("aip_listener_connections_refused_total{reason=\"per_address\"}")
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn over_the_total_every_source_is_closed_unanswered_until_one_closes() {
    let server = Server::start(ConnectionLimits {
        total: 2,
        per_address: 0,
    })
    .await;
    let addr = server.addr;

    let (mut first, answer) = open("127.0.0.1", addr).await;
    assert_eq!(answer, Answer::Served);
    let (second, answer) = open("127.0.0.2", addr).await;
    assert_eq!(answer, Answer::Served);
    for source in ["127.0.0.1", "127.0.0.3"] {
        let (_, answer) = open(source, addr).await;
        assert_eq!(answer, Answer::ClosedUnanswered, "{source} over the total");
    }
    assert_eq!(request(&mut first).await, Answer::Served, "still open");

    drop(second);
    let _third = served_eventually("127.0.0.3", addr).await;
    let (_, answer) = open("127.0.0.4", addr).await;
    assert_eq!(answer, Answer::ClosedUnanswered, "full again");
}

#[tokio::test]
async fn a_socket_that_never_sends_holds_its_place_until_it_closes() {
    // The place is taken at accept, not when a request arrives: a client cannot open more
    // sockets than the limit by sending nothing on them.
    let server = Server::start(ConnectionLimits {
        total: 0,
        per_address: 2,
    })
    .await;
    let addr = server.addr;
    let silent = [
        connect_from("127.0.0.5", addr).await,
        connect_from("127.0.0.5", addr).await,
    ];
    let (_, answer) = open("127.0.0.5", addr).await;
    assert_eq!(answer, Answer::ClosedUnanswered);
    drop(silent);
    let _served = served_eventually("127.0.0.5", addr).await;
}
