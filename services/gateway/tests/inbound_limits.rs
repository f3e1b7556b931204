//! Limits on what clients send, before and after authentication:
//!
//! - sockets are counted when accepted, WebSockets included after their upgrade: one address
//!   over `max_connections_per_address` is closed unanswered while another address gets in,
//!   and over `max_connections` plus the headroom every socket is (within the headroom, a
//!   handshake still gets its 503);
//! - a client over `bytes_per_second` is slowed down (the gateway stops reading it), not
//!   refused, and a client beside it is not;
//! - with a small `max_inbound_bytes_in_flight`, clients sending large frames at once all get
//!   them through, never more than the budget in flight at once, and a frame larger than the
//!   whole budget goes through alone.
//!
//! Against real NATS (JetStream) and PostgreSQL.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use aip_testkit::frames::{self, device_register};
use aip_testkit::{Backend, Options, Stack};
use common::{Ws, registered, until_online};
use proto_schemas::Subjects;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// How long a test waits for something that should happen at once.
const WAIT: Duration = Duration::from_secs(10);

fn options() -> Options {
    Options {
        sessions: false,
        gateways: 0,
        ..Options::default()
    }
}

/// A TCP connection to `addr` from `source` (any loopback address works on Linux).
async fn connect_from(source: &str, addr: SocketAddr) -> TcpStream {
    let source: IpAddr = source.parse().expect("an address");
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(source, 0))
        .expect("bind the client's address");
    socket.connect(addr).await.expect("connect")
}

/// Whether `GET /healthz` on a new connection from `source` is answered, or the connection
/// closed without a byte.
async fn health_answered(source: &str, addr: SocketAddr) -> bool {
    let mut stream = connect_from(source, addr).await;
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .expect("an answer or a close");
    if read.is_err() {
        assert!(answer.is_empty(), "reset after a partial answer");
        return false;
    }
    if answer.is_empty() {
        return false;
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    true
}

/// A WebSocket handshake to `addr` from `source`; true if the gateway upgraded it.
async fn websocket_from(
    source: &str,
    addr: SocketAddr,
) -> Option<tokio_tungstenite::WebSocketStream<TcpStream>> {
    let stream = connect_from(source, addr).await;
    tokio_tungstenite::client_async(format!("ws://{addr}/ws"), stream)
        .await
        .ok()
        .map(|(ws, _)| ws)
}

/// Waits until `check` holds (places are given back when the gateway notices a close).
async fn until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + WAIT;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_count_against_the_per_address_limit_at_accept() {
    let stack = Stack::start(Backend::NatsPostgres, options())
        .await
        .expect("stack");
    let gateway = common::custom_gateway(&stack, |s| {
        s.gateway.max_connections_per_address = 2;
    })
    .await;
    let addr = gateway.addr;
    let url = gateway.ws_url();

    // Two WebSockets from 127.0.0.1, upgraded: their sockets still count.
    let mut first = registered(&url, &device_register("first", "windows")).await;
    let second = registered(&url, &device_register("second", "windows")).await;
    until_online(&stack, "second").await;
    assert!(
        !health_answered("127.0.0.1", addr).await,
        "a third socket from 127.0.0.1 is closed before any answer"
    );
    assert!(
        websocket_from("127.0.0.1", addr).await.is_none(),
        "so is a third WebSocket handshake"
    );

    // Another address gets in: probes and WebSockets.
    assert!(health_answered("127.0.0.2", addr).await);
    let other = websocket_from("127.0.0.2", addr).await;
    assert!(other.is_some(), "a WebSocket from 127.0.0.2");
    first.heartbeat("first", "device").await;

    // One of the two closes: its place is given back.
    second.close().await;
    until("a place for 127.0.0.1 after one closed", || {
        health_answered("127.0.0.1", addr)
    })
    .await;
    let mut again = registered(&url, &device_register("second", "windows")).await;
    again.heartbeat("second", "device").await;
    assert!(!health_answered("127.0.0.1", addr).await, "full again");

    gateway.stop().await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_over_max_connections_and_the_headroom_are_closed_at_accept() {
    let stack = Stack::start(Backend::NatsPostgres, options())
        .await
        .expect("stack");
    let gateway = common::custom_gateway(&stack, |s| {
        s.gateway.max_connections = 1;
        s.gateway.max_connections_per_address = 0;
    })
    .await;
    let addr = gateway.addr;
    let url = gateway.ws_url();
    let mut only = registered(&url, &device_register("only", "windows")).await;

    // Within the headroom, a second WebSocket is told why it cannot have one.
    let full = Ws::refused(&url).await;
    assert_eq!(full.status, 503, "{full:?}");

    // Sockets that send nothing fill the rest of the headroom (from several addresses)...
    let headroom = aip_gateway::settings::ACCEPT_HEADROOM;
    let mut silent = Vec::new();
    for i in 0..headroom {
        silent.push(connect_from(&format!("127.0.1.{}", 1 + i % 200), addr).await);
    }
    // ... and then every new socket is closed unanswered, from any address.
    until("the silent sockets accepted", || async {
        !health_answered("127.0.0.3", addr).await
    })
    .await;
    assert!(!health_answered("127.0.0.4", addr).await);
    only.heartbeat("only", "device").await;

    silent.pop();
    until("a place after a silent socket closed", || {
        health_answered("127.0.0.3", addr)
    })
    .await;

    gateway.stop().await;
    stack.stop().await;
}

/// A heartbeat of `id` carrying `padding` bytes in its metadata.
fn padded_heartbeat(id: &str, padding: usize) -> String {
    let mut frame = frames::heartbeat(id, "device");
    frame["metadata"]["padding"] = Value::String("x".repeat(padding));
    frame.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_the_byte_rate_is_slowed_down_not_refused() {
    let stack = Stack::start(Backend::NatsPostgres, options())
        .await
        .expect("stack");
    const RATE: u64 = 1024 * 1024;
    let gateway = common::custom_gateway(&stack, |s| s.gateway.bytes_per_second = RATE).await;
    let url = gateway.ws_url();
    let mut polite = registered(&url, &device_register("polite", "windows")).await;
    let mut flood = registered(&url, &device_register("flood", "windows")).await;

    // 8 frames of 512 KiB: 4 MiB at 1 MiB/s with a 2 MiB burst. The last one can only be
    // read once 1.5 s of debt are paid, whatever the speed of the network.
    const FRAMES: usize = 8;
    let frame = padded_heartbeat("flood", 512 * 1024);
    let started = Instant::now();
    let flooding = tokio::spawn(async move {
        for _ in 0..FRAMES {
            flood.send_text(&frame).await;
        }
        let mut answers = Vec::new();
        for _ in 0..FRAMES {
            answers.push(flood.recv().await.expect("every frame answered"));
        }
        (flood, answers, started.elapsed())
    });

    // Meanwhile a client beside it is answered at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        let asked = Instant::now();
        polite.heartbeat("polite", "device").await;
        assert!(
            // Far under the 1.4 s or more the flood waits: not held up with it.
            asked.elapsed() < Duration::from_millis(1_000),
            "the polite client waited {:?}",
            asked.elapsed()
        );
    }

    let (mut flood, answers, elapsed) = flooding.await.expect("the flood's task");
    for answer in &answers {
        common::assert_heartbeat_answer(answer);
    }
    assert!(
        elapsed >= Duration::from_millis(1_400),
        "4 MiB at 1 MiB/s (2 MiB burst) took only {elapsed:?}: not slowed down"
    );
    assert!(
        elapsed < Duration::from_secs(15),
        "slowed down far more than the rate asks: {elapsed:?}"
    );
    // Still connected, and once the debt is paid, answered at once again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    flood.heartbeat("flood", "device").await;

    gateway.stop().await;
    stack.stop().await;
}

/// A COMMAND_RESULTS frame of `id` with one result of `padding` bytes.
fn large_result(id: &str, n: usize, padding: usize) -> String {
    frames::client(json!({
        "type": "command_results", "status": "continue", "client_type": "device", "client_id": id,
        "session_id": format!("session-{id}"), "prev_response_id": format!("response-{n}"),
        "request_id": uuid::Uuid::new_v4().to_string(),
        "action_results": [{
            "status": "success", "namespace": "test", "call_id": format!("call-{n}"),
            "result": { "output": "y".repeat(padding) }
        }]
    }))
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_of_many_clients_all_get_through_within_the_inbound_budget() {
    let stack = Stack::start(Backend::NatsPostgres, options())
        .await
        .expect("stack");
    // The session service is not running: the test makes the frames stream it would.
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    stack
        .bus
        .ensure_stream(aip_bus::StreamSpec::new(
            subjects.frames_stream(),
            vec![subjects.frames_all()],
        ))
        .await
        .expect("frames stream");

    const BUDGET: usize = 4 * 1024 * 1024;
    let mut settings = stack.gateway_settings();
    settings.gateway.max_inbound_bytes_in_flight = BUDGET;
    settings.gateway.bytes_per_second = 0;
    let app = aip_gateway::Application::build(settings, stack.bus.clone())
        .await
        .expect("gateway");
    let budget = app.inbound_budget();
    let url = format!("ws://{}/ws", app.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(app.run_until(async {
        let _ = stopped.await;
    }));

    // Six clients, three frames of 1.5 MiB each, all at once: 27 MiB against a 4 MiB budget.
    const CLIENTS: usize = 6;
    const FRAMES: usize = 3;
    const FRAME: usize = 1536 * 1024;
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let id = format!("big-{c}");
        clients.push((
            id.clone(),
            registered(&url, &device_register(&id, "linux")).await,
        ));
    }
    let sent = send_all(clients, FRAMES, FRAME).await;
    let peak = budget.peak();
    assert!(
        peak <= BUDGET,
        "peak {peak} bytes in flight, over the budget"
    );
    assert!(peak > FRAME, "frames were in flight together: peak {peak}");
    assert!(budget.waits() > 0, "frames waited for room");
    assert_eq!(budget.in_flight(), 0, "all given back");

    // A frame larger than the whole budget waits until it is alone, then goes through.
    let oversized = vec![sent.into_iter().next().expect("a client")];
    let sent_again = send_all(oversized, 1, BUDGET + 1024 * 1024).await;
    assert!(budget.peak() > BUDGET, "the oversized frame was in flight");
    assert_eq!(budget.in_flight(), 0, "all given back");

    // Every frame is in the stream.
    let expected = CLIENTS * FRAMES + 1;
    let stored = stored_frames(&stack, &subjects, expected).await;
    assert_eq!(stored, expected, "frames stored");

    for (_, ws) in sent_again {
        ws.close().await;
    }
    let _ = stop.send(());
    served.await.expect("joined").expect("served");
    stack.stop().await;
}

/// Each client sends `frames` COMMAND_RESULTS of `size` bytes at once with the others, then
/// a heartbeat. Frames are handled in order, so the heartbeat's answer comes after every frame
/// before it was stored (a frame not stored would have been answered with an ERROR first).
async fn send_all(clients: Vec<(String, Ws)>, frames: usize, size: usize) -> Vec<(String, Ws)> {
    let mut senders = Vec::new();
    for (id, mut ws) in clients {
        senders.push(tokio::spawn(async move {
            for n in 0..frames {
                ws.send_text(&large_result(&id, n, size)).await;
            }
            ws.send(&frames::heartbeat(&id, "device")).await;
            let answer = ws.recv().await.expect("an answer");
            common::assert_heartbeat_answer(&answer);
            (id, ws)
        }));
    }
    let mut done = Vec::new();
    for sender in senders {
        let client = tokio::time::timeout(Duration::from_secs(60), sender)
            .await
            .expect("every client's frames through: no deadlock")
            .expect("the sender");
        done.push(client);
    }
    done
}

/// Reads the frames stream until `expected` COMMAND_RESULTS frames came (or a while passed);
/// how many did.
async fn stored_frames(stack: &Stack, subjects: &Subjects, expected: usize) -> usize {
    use futures::StreamExt;
    let mut consumer = stack
        .bus
        .consume(subjects.frames_stream(), "test-reader".to_owned(), 1000)
        .await
        .expect("a consumer");
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while seen < expected {
        match tokio::time::timeout_at(deadline, consumer.next()).await {
            Ok(Some(Ok(delivery))) => {
                if delivery.message.subject.contains(".big-") {
                    seen += 1;
                }
                let _ = delivery.ack().await;
            }
            Ok(Some(Err(e))) => panic!("reading the frames stream: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    seen
}
