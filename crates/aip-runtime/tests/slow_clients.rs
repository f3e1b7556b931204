//! A client that sends its request headers slowly, or not at all (slowloris), is disconnected
//! after `HEADER_READ_TIMEOUT` instead of holding a socket forever; everyone else is served
//! meanwhile (issue 21). Every listener of the services and of `aip dev` serves this way.

use std::time::{Duration, Instant};

use aip_runtime::listener::{ConnectionLimits, HEADER_READ_TIMEOUT, serve_http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    aip_runtime::install_crypto_provider();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_http(
        listener,
        router,
        ConnectionLimits::UNLIMITED,
        async {
            let _ = stopped.await;
        },
    ));

    let started = Instant::now();
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n")
        .await
        .expect("partial headers");

    // Others are served while it dawdles.
    let answer = reqwest::get(format!("http://{addr}/"))
        .await
        .expect("served")
        .text()
        .await
        .expect("body");
    assert_eq!(answer, "ok");

    // It dribbles one more header line, then nothing: the deadline is the connection's, not
    // reset by each byte.
    tokio::time::sleep(Duration::from_secs(1)).await;
    slow.write_all(b"X-Slow: 1\r\n").await.expect("a line");
    let mut buf = [0u8; 512];
    let read = tokio::time::timeout(HEADER_READ_TIMEOUT * 2, slow.read(&mut buf))
        .await
        .expect("disconnected before twice the timeout");
    let elapsed = started.elapsed();
    match read {
        Ok(0) | Err(_) => {}
        Ok(n) => {
            // hyper may answer 408 before closing; then the socket closes.
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        }
    }
    assert!(
        elapsed >= HEADER_READ_TIMEOUT - Duration::from_millis(500),
        "closed after {elapsed:?}, before the timeout"
    );

    let _ = stop.send(());
    server.await.expect("joined").expect("served");
}
