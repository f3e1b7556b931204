//! Blob chunks are read by direct get, which answers with the chunk's bytes; when a direct get
//! fails, the bus reads through the stream API, whose answer is the chunk in base64.
//!
//! A NATS restart makes direct gets fail for a while (the server is gone, then its JetStream
//! is not ready). They used to stay off for the life of the process; now they are tried again
//! once the connection is made again. Shown with a NATS user that may send direct gets but not
//! the stream API's message gets: a read fails while the server is down, and after the server
//! is back, reads work again only if direct gets are used again.
//!
//! A user who may not send direct gets got no answer to them: every read waited for the
//! request's timeout (5 s), then once a minute again. The server says so at once, as a
//! permissions violation; now that ends the wait, and direct gets stay off until the
//! connection is made again.

use std::sync::Arc;
use std::time::Duration;

use aip_bus::{BlobStore, Bus, NatsBus, NatsSettings};
use aip_testkit::OwnNatsServer;
use proto_schemas::Subjects;

/// A server configuration with one user, `reader`, who may publish anything but `denied`.
fn reader_denied(denied: &str) -> String {
    format!(
        r#"
authorization {{
  users = [
    {{
      user: "reader"
      password: "reader-secret"
      permissions: {{
        publish: {{ allow: [">"], deny: ["{denied}"] }}
        subscribe: {{ allow: [">"] }}
      }}
    }}
  ]
}}
"#
    )
}

/// Connected to `server` as `reader`, with a blob stream of a fresh prefix and a body of three
/// chunks (of the server's default 1 MiB) stored in it.
struct Reader {
    nats: NatsBus,
    bus: Arc<dyn Bus>,
    blobs: BlobStore,
    message: aip_bus::Message,
    body: bytes::Bytes,
}

impl Reader {
    async fn connect(server: &OwnNatsServer) -> Reader {
        let access = NatsSettings {
            nats_user: Some("reader".into()),
            nats_password: Some("reader-secret".into()),
            ..NatsSettings::default()
        };
        let nats = NatsBus::connect_with(&server.url, "aip-bus-direct-gets", &access)
            .await
            .expect("connect");
        let bus: Arc<dyn Bus> = Arc::new(nats.clone());
        let subjects =
            Subjects::new(&format!("t{}", uuid::Uuid::new_v4().simple())).expect("prefix");
        let blobs = BlobStore::for_subjects(&subjects);
        bus.ensure_stream(blobs.stream_spec(-1))
            .await
            .expect("blob stream");
        let body = aip_testkit::blobs::patterned(5 << 19, 253);
        let message =
            aip_testkit::blobs::stored(bus.as_ref(), &blobs, subjects.frames_all(), body.clone())
                .await;
        Reader {
            nats,
            bus,
            blobs,
            message,
            body,
        }
    }

    async fn read(&self) -> Result<bytes::Bytes, aip_bus::BusError> {
        self.blobs
            .payload_of(self.bus.as_ref(), &self.message)
            .await
    }
}

#[tokio::test]
async fn direct_gets_are_used_again_after_a_nats_restart() {
    // Everything but the stream API's message gets.
    let denied = reader_denied("$JS.API.STREAM.MSG.GET.>");
    let mut server = OwnNatsServer::start("direct-gets", &denied, |_| {}, &[]).await;
    let reader = Reader::connect(&server).await;
    let (nats, body) = (&reader.nats, &reader.body);
    let read = || reader.read();

    let before = read().await.expect("read back by direct get");
    assert!(before == *body, "the body comes back whole");

    // Down: the read fails (its direct gets and then the stream API's gets time out).
    server.kill();
    let during = tokio::time::timeout(Duration::from_secs(60), read())
        .await
        .expect("a read while the server is down ends");
    assert!(
        during.is_err(),
        "a read while the server is down cannot succeed"
    );

    // Back, with its stream: reads work again, which only direct gets can do for this user.
    server.start_again().await;
    aip_testkit::wait_until("the client to connect again", || async {
        nats.client().connection_state() == async_nats::connection::State::Connected
    })
    .await;
    // A read may meet the server's JetStream not ready yet; the stream API never works for
    // this user.
    let after = aip_testkit::eventually_within(
        Duration::from_secs(90),
        "a blob read after the restart",
        || async {
            match tokio::time::timeout(Duration::from_secs(20), read()).await {
                Ok(Ok(read)) => Some(read),
                Ok(Err(e)) => {
                    eprintln!("read after the restart: {e}");
                    None
                }
                Err(_) => None,
            }
        },
    )
    .await;
    let after = match after {
        Ok(after) => after,
        Err(e) => panic!("{e}; server log:\n{}", server.log_text()),
    };
    assert!(
        after == *body,
        "the body comes back whole after the restart"
    );
}

#[tokio::test]
async fn a_user_refused_direct_gets_reads_through_the_stream_api_without_waiting() {
    let denied = reader_denied("$JS.API.DIRECT.GET.>");
    let server = OwnNatsServer::start("no-direct-gets", &denied, |_| {}, &[]).await;
    let reader = Reader::connect(&server).await;
    let (body, read) = (&reader.body, || reader.read());

    // Not a figure of speed: the bound is the direct get's request timeout (5 s), which a
    // read waited for before the refusal was heard.
    for attempt in ["first", "second"] {
        let got = tokio::time::timeout(Duration::from_secs(4), read())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the {attempt} read waited for the request timeout; server log:\n{}",
                    server.log_text()
                )
            })
            .expect("read through the stream API");
        assert!(got == *body, "the body comes back whole");
    }
    assert!(
        server.log_text().contains("Publish Violation"),
        "the server refused a direct get: {}",
        server.log_text()
    );
}
