//! One client connection: REGISTER, then frames in both directions until it ends.
//!
//! The socket is split: a writer task drains a bounded outbound queue into the socket; the
//! connection task reads frames, answers what the gateway answers itself (heartbeats, device
//! info, identity errors) and forwards the rest. Whatever arrives on the client's delivery
//! subject is put on the outbound queue. A client that lets the queue fill up is disconnected.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aip_bus::{BusError, Headers, Message as BusMessage, names};
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use futures::{SinkExt, StreamExt};
use proto_schemas::registry::{
    AgentStatus, GetAgent, GetAgentReply, RegisterAgent, RegisterReply, UnregisterAgent,
    UnregisterReply,
};
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent, InboundFrame};
use proto_schemas::{
    ClientMessage, ClientMessageType, ClientType, ErrorCode, Extension, Platform, ServerMessage,
    TaskStatus, V1, parse_client_frame, register_details, server,
};
use tokio::sync::mpsc;

use crate::AppState;
use crate::auth::Principal;
use crate::rate::RateLimiter;
use crate::replies;

/// WebSocket close codes used by the gateway.
pub mod close {
    /// Normal closure (after a refused registration, as UFO does).
    pub const NORMAL: u16 = 1000;
    /// Going away: the gateway shuts down; reconnect elsewhere.
    pub const GOING_AWAY: u16 = 1001;
    /// Protocol error.
    pub const PROTOCOL: u16 = 1002;
    /// Policy violation: identity, slow consumer, rate.
    pub const POLICY: u16 = 1008;
    /// A frame over the size limit.
    pub const TOO_BIG: u16 = 1009;
    /// Internal error or a dependency unavailable; try again later.
    pub const TRY_AGAIN: u16 = 1013;
}

/// What the writer task is asked to write.
enum Outbound {
    Frame(Utf8Bytes),
    Ping,
    Close(u16, String),
}

/// Why a connection ended, for logs and the registry.
#[derive(Debug)]
struct Ended {
    reason: String,
}

/// The identity pinned to a registered connection.
#[derive(Debug, Clone)]
struct Identity {
    client_id: String,
    client_type: ClientType,
    /// For a constellation: the device it registered for (limits device-info requests).
    target_id: Option<String>,
    platform: Platform,
    extensions: Vec<Extension>,
}

/// Serves one upgraded WebSocket until it ends.
pub async fn serve(socket: WebSocket, state: Arc<AppState>, principal: Principal) {
    let connection_id = uuid::Uuid::now_v7().to_string();
    let (mut sink, mut stream) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Outbound>(state.settings.gateway.outbound_queue);

    // Writes what is queued, one flush (one write to the socket) for all frames queued at once.
    let writer = tokio::spawn(async move {
        'queue: while let Some(first) = out_rx.recv().await {
            let mut next = Some(first);
            while let Some(item) = next {
                let fed = match item {
                    Outbound::Frame(text) => sink.feed(Message::Text(text)).await,
                    Outbound::Ping => sink.feed(Message::Ping(Default::default())).await,
                    Outbound::Close(code, reason) => {
                        let frame = CloseFrame {
                            code,
                            reason: Utf8Bytes::from(reason),
                        };
                        let _ = sink.send(Message::Close(Some(frame))).await;
                        break 'queue;
                    }
                };
                if fed.is_err() {
                    break 'queue;
                }
                next = out_rx.try_recv().ok();
            }
            if sink.flush().await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });

    let mut conn = Connection {
        state: state.clone(),
        connection_id,
        principal,
        out: out_tx,
        identity: None,
        frames_forwarded: 0,
        recent_deliveries: aip_bus::RecentIds::new(1024),
        limiter: RateLimiter::new(state.settings.gateway.frames_per_second),
        refused_in_a_row: 0,
        input_left_unread: false,
    };
    let ended = conn.run(&mut stream).await;
    // Runs once per connection: boxed, so that the future each open connection holds does not
    // reserve room for it (memory per idle connection).
    Box::pin(finish(conn, ended, stream, writer)).await;
}

/// After the connection ended: forgets it, tells the session service and the registry, and
/// finishes the closing handshake.
async fn finish(
    conn: Connection,
    ended: Ended,
    mut stream: FrameStream,
    mut writer: tokio::task::JoinHandle<()>,
) {
    let state = conn.state.clone();
    tracing::debug!(connection = %conn.connection_id, reason = %ended.reason, "connection ended");
    if let Some(identity) = &conn.identity {
        state.presence.remove(&conn.connection_id);
        // Before the registry hears of it: from now on, device info comes from the registry.
        state
            .devices
            .remove(&identity.client_id, &conn.connection_id);
        conn.announce_closed(identity, &ended.reason).await;
        conn.unregister(identity, &ended.reason).await;
    }
    let input_left_unread = conn.input_left_unread;
    drop(conn);
    // The closing handshake: read (and discard) until the client answers the close frame or
    // goes away, while the writer sends what is queued and the close. Dropping the socket
    // with unread input would reset the connection and lose the last frames (the ERROR
    // saying why); a client that does not finish within CLOSE_GRACE (one that stopped
    // reading, say) is dropped anyway, so it cannot keep its connection slot. When the
    // gateway shuts down, the close frame is sent but answers are not awaited.
    let shutting_down = state.shutdown.is_cancelled();
    let drain = async {
        if shutting_down {
            return;
        }
        while let Some(Ok(message)) = stream.next().await {
            if let Message::Close(_) = message {
                break;
            }
        }
    };
    if tokio::time::timeout(CLOSE_GRACE, futures::future::join(drain, &mut writer))
        .await
        .is_err()
    {
        writer.abort();
    } else if input_left_unread {
        // Part of a frame over the limit is still unread, so dropping the socket resets the
        // connection, and a reset overtakes the ERROR and close frame on their way to the
        // client: hold the socket a moment for them to arrive.
        tokio::time::sleep(CLOSE_GRACE / 4).await;
    }
}

/// How long an ended connection may take to finish the closing handshake.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

struct Connection {
    state: Arc<AppState>,
    connection_id: String,
    principal: Principal,
    out: mpsc::Sender<Outbound>,
    identity: Option<Arc<Identity>>,
    /// Frames put into the frames stream so far; numbers their `Nats-Msg-Id`.
    frames_forwarded: u64,
    /// Ids of recent deliveries, so a frame re-sent after a sender's crash is written once.
    recent_deliveries: aip_bus::RecentIds,
    limiter: RateLimiter,
    refused_in_a_row: u32,
    /// The rest of an oversized frame is left unread (the socket cannot be drained).
    input_left_unread: bool,
}

type FrameStream = futures::stream::SplitStream<WebSocket>;

impl Connection {
    async fn run(&mut self, stream: &mut FrameStream) -> Ended {
        let settings = self.state.settings.gateway.clone();
        let shutdown = self.state.shutdown.clone();

        // 1. REGISTER within the deadline. Pings and pongs before it are answered by the
        // WebSocket layer; they are skipped here without moving the deadline (a client that
        // only pings is still closed at the deadline).
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(settings.register_timeout_ms);
        let bytes = loop {
            let next = tokio::select! {
                r = tokio::time::timeout_at(deadline, stream.next()) => r,
                () = shutdown.cancelled() => {
                    self.close(close::GOING_AWAY, "server shutting down; reconnect");
                    return Ended { reason: "gateway shutting down".into() };
                }
            };
            let message = match next {
                Err(_) => {
                    let text = format!(
                        "no register frame within {} ms of connecting",
                        settings.register_timeout_ms
                    );
                    self.send(server::error(ErrorCode::RegistrationFailed, &text));
                    self.close(close::POLICY, "registration deadline passed");
                    return Ended { reason: text };
                }
                Ok(None) => {
                    return Ended {
                        reason: "closed before registering".into(),
                    };
                }
                Ok(Some(Err(e))) => return self.read_failed(e),
                Ok(Some(Ok(message))) => message,
            };
            match message {
                Message::Text(text) => break text,
                Message::Binary(_) => {
                    let text = "binary frames are not supported: send each AIP frame as JSON in a text frame";
                    self.send(server::error(ErrorCode::ProtocolError, text));
                    self.close(close::PROTOCOL, "binary frame");
                    return Ended {
                        reason: text.into(),
                    };
                }
                Message::Close(_) => {
                    return Ended {
                        reason: "closed before registering".into(),
                    };
                }
                Message::Ping(_) | Message::Pong(_) => {}
            }
        };
        // Boxed, here and for each frame and delivery below: the future of an idle connection
        // then holds only the loop, not room for the largest step it may take.
        let (mut deliveries, liveness) = match Box::pin(self.register(bytes.as_str())).await {
            Ok(ok) => ok,
            Err(ended) => return ended,
        };

        // 2. Registered: frames both ways until the end.
        let liveness_timeout = Duration::from_millis(settings.liveness_timeout_ms);
        let mut last_activity = Instant::now();
        // Ping at least three times per liveness window, or a client that answers pings but
        // has nothing to send would be taken for dead.
        let ping_every = Duration::from_millis(settings.ping_interval_ms).min(liveness_timeout / 3);
        let mut ping = tokio::time::interval(ping_every);
        ping.tick().await;
        let mut check = tokio::time::interval(liveness_timeout / 4);
        check.tick().await;
        loop {
            tokio::select! {
                incoming = stream.next() => {
                    let message = match incoming {
                        None => return Ended { reason: "client closed the connection".into() },
                        Some(Err(e)) => return self.read_failed(e),
                        Some(Ok(message)) => message,
                    };
                    last_activity = Instant::now();
                    liveness.touch();
                    match message {
                        Message::Text(text) => {
                            if let Some(ended) = Box::pin(self.on_frame(text.as_str())).await {
                                return ended;
                            }
                        }
                        Message::Binary(_) => {
                            self.send(server::error(
                                ErrorCode::ProtocolError,
                                "binary frames are not supported: send each AIP frame as JSON in a text frame",
                            ));
                        }
                        Message::Close(_) => return Ended { reason: "client closed the connection".into() },
                        Message::Ping(_) | Message::Pong(_) => {}
                    }
                }
                delivery = deliveries.next() => {
                    match delivery {
                        Some(message) => {
                            if let Some(ended) = Box::pin(self.on_delivery(message)).await {
                                return ended;
                            }
                        }
                        None => {
                            self.close(close::TRY_AGAIN, "message bus connection lost; reconnect");
                            return Ended { reason: "delivery subscription ended".into() };
                        }
                    }
                }
                _ = ping.tick() => {
                    if self.out.try_send(Outbound::Ping).is_err() {
                        return self.too_slow();
                    }
                }
                _ = check.tick() => {
                    if last_activity.elapsed() > liveness_timeout {
                        let text = format!("no frames or pongs for {} ms", liveness_timeout.as_millis());
                        self.close(close::GOING_AWAY, &text);
                        return Ended { reason: format!("liveness timeout: {text}") };
                    }
                }
                () = shutdown.cancelled() => {
                    self.close(close::GOING_AWAY, "server shutting down; reconnect");
                    return Ended { reason: "gateway shutting down".into() };
                }
            }
        }
    }

    fn read_failed(&mut self, e: axum::Error) -> Ended {
        let text = e.to_string();
        if text.contains("Space limit exceeded")
            || text.contains("too long")
            || text.contains("too big")
        {
            let limit = self.state.settings.gateway.max_frame_bytes;
            let reason = format!("frame larger than the limit of {limit} bytes");
            self.send(server::error(ErrorCode::FrameTooLarge, &reason));
            self.close(close::TOO_BIG, &reason);
            self.input_left_unread = true;
            return Ended { reason };
        }
        Ended {
            reason: format!("read failed: {text}"),
        }
    }

    /// Queues a frame for the client. A full queue means the client is not reading: it is
    /// disconnected by the caller's next check; here the frame is counted as refused.
    fn send(&self, message: ServerMessage) -> bool {
        match serde_json::to_string(&message) {
            Ok(text) => self.send_text(text),
            Err(e) => {
                tracing::error!("server frame not serialisable: {e}");
                true
            }
        }
    }

    /// Queues a frame already serialised, as [`Self::send`].
    fn send_text(&self, text: String) -> bool {
        self.out
            .try_send(Outbound::Frame(Utf8Bytes::from(text)))
            .is_ok()
    }

    fn close(&self, code: u16, reason: &str) {
        // A close must get through even when the queue is full: wait briefly for room.
        let out = self.out.clone();
        let reason = reason.to_owned();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                out.send(Outbound::Close(code, reason)),
            )
            .await;
        });
    }

    fn too_slow(&self) -> Ended {
        let reason = format!(
            "outbound queue full ({} frames): the client does not read fast enough",
            self.state.settings.gateway.outbound_queue
        );
        self.close(close::POLICY, "too slow: outbound queue full");
        Ended { reason }
    }

    async fn register(
        &mut self,
        text: &str,
    ) -> Result<(aip_bus::Subscription, Arc<crate::presence::Liveness>), Ended> {
        let refuse = |this: &Self, code: ErrorCode, text: String, close_code: u16| {
            this.send(server::error(code, &text));
            this.close(close_code, "registration refused");
            Ended { reason: text }
        };
        let frame = match parse_client_frame(text.as_bytes()) {
            Ok(frame) => frame,
            Err(e) => {
                return Err(refuse(
                    self,
                    e.code,
                    format!("registration refused: {e}"),
                    close::PROTOCOL,
                ));
            }
        };
        if frame.kind != ClientMessageType::Register {
            let text = format!("the first frame must be `register`, got `{}`", frame.kind);
            return Err(refuse(
                self,
                ErrorCode::ProtocolError,
                text,
                close::PROTOCOL,
            ));
        }
        let details = match register_details(&frame) {
            Ok(d) => d,
            Err(e) => {
                return Err(refuse(
                    self,
                    e.code,
                    format!("registration refused: {e}"),
                    close::PROTOCOL,
                ));
            }
        };
        let client_id = frame.client_id.clone().unwrap_or_default();
        let client_type = frame.client_type_or_default();
        if !self.principal.may_register(&client_id, client_type) {
            let text = format!(
                "credential `{}` may not register as {} `{client_id}`",
                self.principal.name,
                client_type.as_str()
            );
            return Err(refuse(self, ErrorCode::Forbidden, text, close::POLICY));
        }
        let target_id = frame.target_id.clone().filter(|t| !t.is_empty());
        // A device's system info, for the device-info requests this gateway answers itself
        // (see `crate::devices`); `None`: requests about this client go to the registry.
        let local_info = if client_type == ClientType::Device {
            let raw = details
                .system_info
                .as_ref()
                .map(serde_json::value::to_raw_value);
            match raw.transpose() {
                Ok(info) => Some(info),
                Err(e) => {
                    tracing::error!(client = %client_id, "system_info not serialisable: {e}");
                    None
                }
            }
        } else {
            None
        };
        let request = RegisterAgent {
            version: V1,
            agent_id: client_id.clone(),
            client_type,
            gateway_id: self.state.gateway_id.clone(),
            connection_id: self.connection_id.clone(),
            principal: self.principal.name.clone(),
            platform: details.platform,
            target_id: if client_type == ClientType::Constellation {
                target_id.clone()
            } else {
                None
            },
            capabilities: details.capabilities,
            tools: details.tools,
            system_info: details.system_info,
            metadata: frame.metadata.clone().map(serde_json::Value::Object),
            extensions: details.extensions.clone(),
        };
        // Subscribe before confirming, so nothing published right after registration is lost.
        let subject = self.state.subjects.deliver(&client_id);
        let deliveries = match self.state.bus.subscribe(subject).await {
            Ok(s) => s,
            Err(e) => {
                return Err(refuse(
                    self,
                    ErrorCode::Unavailable,
                    format!("registration failed: {e}"),
                    close::TRY_AGAIN,
                ));
            }
        };
        let reply: RegisterReply = match self
            .request(self.state.subjects.registry_register(), &request)
            .await
        {
            Ok(reply) => reply,
            Err(text) => return Err(refuse(self, ErrorCode::Unavailable, text, close::TRY_AGAIN)),
        };
        let registered = match reply.into_result() {
            Ok(r) => r,
            Err(body) => return Err(refuse(self, body.error_code, body.detail, close::NORMAL)),
        };
        if let Some(old) = registered.replaced_connection {
            let headers = Headers::new()
                .with(names::CONTROL, "disconnect")
                .with(names::CONNECTION, old);
            let subject = self.state.subjects.deliver(&client_id);
            if let Err(e) = self
                .state
                .bus
                .publish(subject, headers, Default::default())
                .await
            {
                tracing::warn!(client = %client_id, "could not tell the stale connection to close: {e}");
            }
        }
        if let Some(info) = local_info {
            self.state
                .devices
                .insert(&client_id, &self.connection_id, info);
        }
        self.send(server::registered(&details.extensions));
        let liveness = self.state.presence.insert(&self.connection_id, &client_id);
        tracing::info!(client = %client_id, kind = client_type.as_str(), connection = %self.connection_id, "registered");
        self.identity = Some(Arc::new(Identity {
            client_id,
            client_type,
            target_id,
            platform: details.platform,
            extensions: details.extensions,
        }));
        Ok((deliveries, liveness))
    }

    /// Sends a request to another service; an error is text for the client.
    async fn request<Req: serde::Serialize, Rep: serde::de::DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
    ) -> Result<Rep, String> {
        let payload = serde_json::to_vec(body).map_err(|e| format!("internal error: {e}"))?;
        let timeout = Duration::from_millis(self.state.settings.gateway.request_timeout_ms);
        match self
            .state
            .bus
            .request(subject, Headers::new(), payload.into(), timeout)
            .await
        {
            Ok(reply) => serde_json::from_slice(&reply.payload)
                .map_err(|e| format!("invalid reply from a service: {e}")),
            Err(BusError::NoResponders { .. }) => {
                Err("the agent registry is not running: try again later".to_owned())
            }
            Err(e) => Err(format!("the agent registry did not answer: {e}")),
        }
    }

    async fn unregister(&self, identity: &Identity, reason: &str) {
        let request = UnregisterAgent {
            version: V1,
            agent_id: identity.client_id.clone(),
            connection_id: self.connection_id.clone(),
            reason: reason.to_owned(),
        };
        if let Err(e) = self
            .request::<_, UnregisterReply>(self.state.subjects.registry_unregister(), &request)
            .await
        {
            // The registry also learns it from the missing presence, within its window.
            tracing::warn!(client = %identity.client_id, "unregister not confirmed: {e}");
        }
    }

    /// Something published on this client's delivery subject.
    async fn on_delivery(&mut self, message: BusMessage) -> Option<Ended> {
        if message.headers.get(names::CONTROL) == Some("disconnect") {
            if message.headers.get(names::CONNECTION) == Some(self.connection_id.as_str()) {
                self.close(
                    close::POLICY,
                    "replaced by a newer connection of the same client",
                );
                return Some(Ended {
                    reason: "replaced by a newer connection".into(),
                });
            }
            return None;
        }
        if let Some(id) = message.headers.get(names::MSG_ID) {
            if !self.recent_deliveries.first_time(id) {
                tracing::debug!(id, "duplicate delivery dropped");
                return None;
            }
        }
        let payload = match aip_bus::payload_of(self.state.bus.as_ref(), &message).await {
            Ok(payload) => payload,
            Err(e) => {
                tracing::error!(subject = %message.subject, "a large frame for this client could not be read back: {e}");
                self.send(server::error(
                    ErrorCode::Internal,
                    format!("a frame for you was lost in transit: {e}"),
                ));
                return None;
            }
        };
        let text = match String::from_utf8(payload.to_vec()) {
            Ok(text) => text,
            Err(_) => {
                tracing::error!(subject = %message.subject, "delivery is not UTF-8 JSON; dropped");
                return None;
            }
        };
        if self
            .out
            .try_send(Outbound::Frame(Utf8Bytes::from(text)))
            .is_err()
        {
            return Some(self.too_slow());
        }
        None
    }

    /// One text frame from a registered client.
    async fn on_frame(&mut self, text: &str) -> Option<Ended> {
        if !self.limiter.allow() {
            self.refused_in_a_row += 1;
            let limit = self.state.settings.gateway.frames_per_second;
            self.send(server::error(
                ErrorCode::RateLimited,
                format!("frame refused: more than {limit} frames per second; slow down"),
            ));
            if self.refused_in_a_row > limit.max(10) {
                self.close(close::POLICY, "rate limit exceeded persistently");
                return Some(Ended {
                    reason: "rate limit exceeded persistently".into(),
                });
            }
            return None;
        }
        self.refused_in_a_row = 0;
        let frame = match parse_client_frame(text.as_bytes()) {
            Ok(frame) => frame,
            Err(e) => {
                self.send(server::error(e.code, e.to_string()));
                return None;
            }
        };
        let Some(identity) = self.identity.clone() else {
            return None;
        };
        if let Some(claimed) = frame.client_id.as_deref() {
            if !claimed.is_empty() && claimed != identity.client_id {
                self.send(server::error(
                    ErrorCode::Forbidden,
                    "client_id does not match the registered connection",
                ));
                return None;
            }
        }
        if frame.kind != ClientMessageType::Heartbeat {
            if let Some(claimed) = frame.client_type {
                if claimed != identity.client_type {
                    self.send(server::error(
                        ErrorCode::Forbidden,
                        "client_type does not match the registered connection",
                    ));
                    return None;
                }
            }
        }
        match frame.kind {
            ClientMessageType::Heartbeat => {
                if !self.send(server::heartbeat()) {
                    return Some(self.too_slow());
                }
            }
            ClientMessageType::DeviceInfoRequest => self.device_info(&identity, &frame).await,
            ClientMessageType::Register => {
                self.send(server::error(
                    ErrorCode::ProtocolError,
                    "Unknown message type: register (already registered)",
                ));
            }
            ClientMessageType::Error => {
                let text = frame
                    .error
                    .clone()
                    .unwrap_or_else(|| "client reported an error".to_owned());
                self.send(server::error(ErrorCode::ProtocolError, text));
            }
            ClientMessageType::DeviceInfoResponse => {}
            _ => self.forward(&identity, frame).await,
        }
        None
    }

    /// A constellation asks for a device's system information: answered from this gateway's
    /// own devices ([`crate::devices`]) when the device is one of them, else by the registry.
    async fn device_info(&self, identity: &Identity, frame: &ClientMessage) {
        let request_id = frame.request_id.as_deref();
        if identity.client_type != ClientType::Constellation {
            self.send(server::error(
                ErrorCode::Forbidden,
                "DEVICE_INFO_REQUEST is permitted only for constellation clients",
            ));
            return;
        }
        let target = frame.target_id.clone().unwrap_or_default();
        if let Some(bound) = &identity.target_id {
            if *bound != target {
                self.send(server::error(
                    ErrorCode::Forbidden,
                    "Not authorized to request device info for this device",
                ));
                return;
            }
        }
        if let Some(device) = self.state.devices.get(&target) {
            match &device.system_info {
                Some(info) => self.send_text(replies::device_info(request_id, info)),
                None => self.send(server::device_info_error(
                    request_id,
                    format!("Device {target} has no system info"),
                    ErrorCode::DeviceNotFound,
                )),
            };
            return;
        }
        let request = GetAgent {
            version: V1,
            agent_id: target.clone(),
        };
        let reply = match self
            .request::<_, GetAgentReply>(self.state.subjects.registry_get(), &request)
            .await
        {
            Ok(reply) => reply,
            Err(text) => {
                self.send(server::device_info_error(
                    request_id,
                    text,
                    ErrorCode::Unavailable,
                ));
                return;
            }
        };
        match reply.into_result() {
            Ok(agent)
                if agent.status != AgentStatus::Offline
                    && agent.client_type == ClientType::Device =>
            {
                match agent.system_info {
                    Some(info) => self.send(server::device_info(request_id, info)),
                    None => self.send(server::device_info_error(
                        request_id,
                        format!("Device {target} has no system info"),
                        ErrorCode::DeviceNotFound,
                    )),
                };
            }
            _ => {
                self.send(server::device_info_error(
                    request_id,
                    format!("Device {target} not found or no system info available"),
                    ErrorCode::DeviceNotFound,
                ));
            }
        }
    }

    /// Frames handled by the session service go into the frames stream, stored before this
    /// returns. If that fails, the client is told at once (and a task gets its `task_end`).
    async fn forward(&mut self, identity: &Identity, frame: ClientMessage) {
        self.frames_forwarded += 1;
        let msg_id = format!("{}:{}", self.connection_id, self.frames_forwarded);
        let kind = frame.kind;
        let session_id = frame.session_id.clone();
        let event = GatewayEvent::Frame(InboundFrame {
            version: V1,
            gateway_id: self.state.gateway_id.clone(),
            connection_id: self.connection_id.clone(),
            client_id: identity.client_id.clone(),
            client_type: identity.client_type,
            platform: identity.platform,
            extensions: identity.extensions.clone(),
            received_at: server::timestamp_now(),
            frame,
        });
        let Err(text) = self
            .publish_event(&identity.client_id, &event, msg_id)
            .await
        else {
            return;
        };
        let text = format!("`{kind}` frame not accepted: {text}");
        match (kind, session_id) {
            (ClientMessageType::Task, Some(session_id)) => {
                self.send(server::session_error(
                    ErrorCode::Unavailable,
                    &text,
                    &session_id,
                ));
                let end_id = server::new_id();
                self.send(server::task_end(
                    &session_id,
                    TaskStatus::Failed,
                    None,
                    Some(text),
                    &end_id,
                ));
            }
            (_, Some(session_id)) => {
                self.send(server::session_error(
                    ErrorCode::Unavailable,
                    text,
                    &session_id,
                ));
            }
            (_, None) => {
                self.send(server::error(ErrorCode::Unavailable, text));
            }
        }
    }

    async fn publish_event(
        &self,
        client_id: &str,
        event: &GatewayEvent,
        msg_id: String,
    ) -> Result<(), String> {
        let body = serde_json::to_vec(event).map_err(|e| format!("internal error: {e}"))?;
        let headers = Headers::new().with(names::MSG_ID, msg_id);
        let subject = self.state.subjects.frames(client_id);
        let published = self.state.blobs.publish_durable(
            self.state.bus.as_ref(),
            subject,
            headers,
            body.into(),
        );
        match published.await {
            Ok(()) => Ok(()),
            Err(BusError::NoStream { .. }) => Err(
                "the session service has not started (no frames stream); try again later"
                    .to_owned(),
            ),
            Err(e) => Err(format!("the message bus did not store it: {e}")),
        }
    }

    /// Tells the session service that this client is gone, so its sessions end.
    async fn announce_closed(&self, identity: &Identity, reason: &str) {
        let event = GatewayEvent::Closed(ConnectionClosed {
            version: V1,
            gateway_id: self.state.gateway_id.clone(),
            connection_id: self.connection_id.clone(),
            client_id: identity.client_id.clone(),
            client_type: identity.client_type,
            reason: reason.to_owned(),
        });
        let msg_id = format!("{}:closed", self.connection_id);
        if let Err(e) = self
            .publish_event(&identity.client_id, &event, msg_id)
            .await
        {
            tracing::warn!(client = %identity.client_id, "session service not told of the disconnect: {e}");
        }
    }
}
