//! One client, from REGISTER to the end of its connection.
//!
//! [`serve`] takes a connection through three phases: waiting for REGISTER within the
//! deadline; registered, with frames both ways until something ends it; finishing, where the
//! session service and the registry are told and the closing handshake completes. What each
//! client frame does is in [`crate::handlers`], one module per frame type; reading and
//! writing frames is [`Connection`]'s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aip_bus::RecentIds;
use proto_schemas::{ClientMessage, ErrorCode, FrameError, server};

use crate::AppState;
use crate::auth::Principal;
use crate::connection::{Connection, Inbound, OutboundLimits, ReadError, WriteError, close};
use crate::handlers;
use crate::identity::Identity;
use crate::inbound::InFlight;
use crate::presence::Liveness;
use crate::rate::FrameRate;

/// How many delivery ids a connection remembers to drop duplicates: a sender that crashed
/// re-sends at most the frames it had in flight, far fewer than this.
const RECENT_DELIVERY_IDS: usize = 1024;

/// Pings per liveness window: a client that answers pings but has nothing to send must
/// show life several times per window, or one late pong would take it for dead.
const PINGS_PER_LIVENESS_WINDOW: u32 = 3;

/// Liveness checks per window: a silent client is closed at most a quarter window late.
const LIVENESS_CHECKS_PER_WINDOW: u32 = 4;

/// The answer to a binary frame, before and after registration.
pub(crate) const BINARY_FRAMES_UNSUPPORTED: &str =
    "binary frames are not supported: send each AIP frame as JSON in a text frame";

/// The first frame, parsed (or why it is not a valid AIP frame).
type FirstFrame = Result<Box<ClientMessage>, FrameError>;

/// Why a connection ended. The text goes to the logs, the registry and the session
/// service (`reason` of the unregistration and of the closed-connection event).
#[derive(Debug, thiserror::Error)]
pub(crate) enum End {
    #[error("gateway shutting down")]
    ShuttingDown,
    #[error("no register frame within {ms} ms of connecting")]
    RegisterDeadline { ms: u64 },
    #[error("closed before registering")]
    ClosedBeforeRegistering,
    #[error("{BINARY_FRAMES_UNSUPPORTED}")]
    BinaryBeforeRegistering,
    /// The text sent to the client in the ERROR frame.
    #[error("{0}")]
    RegistrationRefused(String),
    #[error("client closed the connection")]
    ClientClosed,
    #[error("{0}")]
    Read(ReadError),
    #[error("{0}")]
    Write(#[from] WriteError),
    #[error("delivery subscription ended")]
    DeliveriesEnded,
    /// The text of the close frame.
    #[error("liveness timeout: {0}")]
    Silent(String),
    #[error("replaced by a newer connection")]
    Replaced,
    #[error("rate limit exceeded persistently")]
    RateLimited,
}

/// What the gateway holds for one client: its socket and what it remembers about it.
pub(crate) struct Client {
    pub(crate) state: Arc<AppState>,
    pub(crate) connection: Connection,
    /// Unique per socket; the registry and the session service tell connections of the
    /// same client apart by it. A UUIDv7, whose text sorts by creation time: the session
    /// service takes the newer of two connections of a client as its route.
    pub(crate) connection_id: String,
    /// Who authenticated the socket: decides which identities it may register.
    pub(crate) principal: Principal,
    /// Set once the registry confirmed the registration; from then on, the connection's
    /// end is reported to the registry, and to the session service if it may know the
    /// connection ([`Client::sessions_may_know`]).
    pub(crate) identity: Option<Arc<Identity>>,
    pub(crate) rate: FrameRate,
    /// Frames put into the frames stream so far; numbers their `Nats-Msg-Id`.
    pub(crate) frames_forwarded: u64,
    /// The size of the frame being handled, as the client sent it: room to set aside for its
    /// event, whose encoding is about as long (a 90 MiB frame's buffer does not grow by
    /// doubling, copying and faulting in each larger copy).
    pub(crate) frame_bytes: usize,
    /// Whether a delivery was queued for the connection (known once its inbox is closed).
    addressed: bool,
    /// Ids of recent deliveries, so a frame re-sent after a sender's crash is written once.
    pub(crate) recent_deliveries: RecentIds,
    /// The traces of the commands written, so their results join them.
    pub(crate) command_traces: crate::traces::CommandTraces,
    /// The connection's place under the connection limit.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// What registration sets up for the registered phase.
pub(crate) struct Registration {
    /// What is published for this client; opened before the registration is confirmed, so
    /// nothing published right after it is lost.
    pub(crate) deliveries: crate::deliveries::Inbox,
    /// Touched on every sign of life, read by the presence batches.
    pub(crate) liveness: Arc<Liveness>,
}

/// Serves one upgraded WebSocket until it ends.
///
/// Not an `async fn`: the future an open connection holds for its whole life would keep room
/// for the arguments beside the client built from them (the socket alone is 368 bytes). Here
/// the client is built first, and the future owns only it. `slot` is the connection's place
/// under the gateway's connection limit, given back when the client is dropped.
pub fn serve(
    socket: crate::upgrade::Socket,
    state: Arc<AppState>,
    principal: Principal,
    slot: tokio::sync::OwnedSemaphorePermit,
) -> impl std::future::Future<Output = ()> + Send {
    let settings = &state.settings.gateway;
    let client = Client {
        connection: Connection::new(
            socket,
            OutboundLimits {
                frames: settings.outbound_queue,
                bytes: settings.outbound_queue_bytes,
                gateway: state.outbound.clone(),
            },
            settings.max_frame_bytes,
            settings.bytes_per_second,
        ),
        connection_id: uuid::Uuid::now_v7().to_string(),
        principal,
        identity: None,
        rate: FrameRate::new(settings.frames_per_second),
        frames_forwarded: 0,
        frame_bytes: 0,
        addressed: false,
        recent_deliveries: RecentIds::new(RECENT_DELIVERY_IDS),
        command_traces: Default::default(),
        state,
        _slot: slot,
    };
    client.serve()
}

impl Client {
    /// The connection from its first frame to its end.
    async fn serve(mut self) {
        metrics::counter!("aip_gateway_connections_total").increment(1);
        let open = metrics::gauge!("aip_gateway_connections");
        open.increment(1.0);
        // Boxed: awaited in place, its 1.2 KiB were held twice by this future.
        let end = Box::pin(self.run()).await;
        open.decrement(1.0);
        // Runs once per connection: boxed, so that the future each open connection holds does
        // not reserve room for it (memory per idle connection).
        Box::pin(self.finish(end)).await;
    }

    async fn run(&mut self) -> End {
        let (first, bytes) = match self.await_register().await {
            Ok(first) => first,
            Err(end) => return end,
        };
        let in_flight = match self.admit_inbound(bytes).await {
            Ok(in_flight) => in_flight,
            Err(end) => return end,
        };
        // Boxed, here and for each frame and delivery in `registered`: the future of an idle
        // connection then holds only the loop, not room for the largest step it may take.
        let registered = Box::pin(handlers::register::handle(self, first)).await;
        drop(in_flight);
        match registered {
            Ok(registration) => self.registered(registration).await,
            Err(end) => end,
        }
    }

    /// Room in the gateway's budget of inbound bytes for a frame of `bytes` just read,
    /// waiting for it (and reading nothing more meanwhile) unless the gateway shuts down.
    async fn admit_inbound(&self, bytes: usize) -> Result<InFlight, End> {
        let budget = self.state.inbound.clone();
        tokio::select! {
            in_flight = budget.admit(bytes) => Ok(in_flight),
            () = self.state.shutdown.cancelled() => Err(self.shutting_down()),
        }
    }

    /// The first frame, within the registration deadline. Pings and pongs before it are
    /// answered by the connection; they are skipped here without moving the deadline
    /// (a client that only pings is still closed at the deadline).
    async fn await_register(&mut self) -> Result<(FirstFrame, usize), End> {
        let timeout_ms = self.state.settings.gateway.register_timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let shutdown = self.state.shutdown.clone();
        loop {
            let read = tokio::select! {
                read = tokio::time::timeout_at(deadline, self.connection.read()) => read,
                () = shutdown.cancelled() => return Err(self.shutting_down()),
            };
            let inbound = match read {
                Err(_elapsed) => {
                    let end = End::RegisterDeadline { ms: timeout_ms };
                    self.connection.write_last(
                        &server::error(ErrorCode::RegistrationFailed, end.to_string()),
                        close::POLICY,
                        "registration deadline passed",
                    );
                    return Err(end);
                }
                Ok(Err(e)) => return Err(self.read_failed(e)),
                Ok(Ok(None)) => return Err(End::ClosedBeforeRegistering),
                Ok(Ok(Some(inbound))) => inbound,
            };
            match inbound {
                Inbound::Frame { frame, bytes } => return Ok((frame, bytes)),
                Inbound::Binary => {
                    self.connection.write_last(
                        &server::error(ErrorCode::ProtocolError, BINARY_FRAMES_UNSUPPORTED),
                        close::PROTOCOL,
                        "binary frame",
                    );
                    return Err(End::BinaryBeforeRegistering);
                }
                Inbound::Control => {}
            }
        }
    }

    /// Registered: frames both ways until something ends the connection.
    async fn registered(&mut self, registration: Registration) -> End {
        let Registration {
            mut deliveries,
            liveness,
        } = registration;
        let end = self.serve_registered(&deliveries, &liveness).await;
        // Before the end is reported: a delivery from now on finds the connection gone.
        self.addressed = deliveries.close();
        end
    }

    /// Whether the session service may know this connection, and so must hear of its end:
    /// it sent a frame on, or was sent one ([`crate::events`]).
    fn sessions_may_know(&self) -> bool {
        self.frames_forwarded > 0 || self.addressed
    }

    async fn serve_registered(
        &mut self,
        deliveries: &crate::deliveries::Inbox,
        liveness: &Liveness,
    ) -> End {
        let settings = &self.state.settings.gateway;
        let liveness_timeout = Duration::from_millis(settings.liveness_timeout_ms);
        let ping_every = Duration::from_millis(settings.ping_interval_ms)
            .min(liveness_timeout / PINGS_PER_LIVENESS_WINDOW);
        // One timer for both (each timer is an allocation an idle connection holds): it ticks
        // at the shorter period and checks liveness every tick; it pings at a tick when the
        // next tick would be later than the ping period, so pings are never further apart
        // than configured (with the defaults, every tick is a ping).
        let tick_every = ping_every.min(liveness_timeout / LIVENESS_CHECKS_PER_WINDOW);
        let mut tick = tokio::time::interval(tick_every);
        tick.tick().await;
        let mut last_ping = Instant::now();
        let mut last_activity = Instant::now();
        let shutdown = self.state.shutdown.clone();
        loop {
            let step = tokio::select! {
                read = self.connection.read() => {
                    let alive = read.is_ok();
                    if alive {
                        liveness.touch();
                    }
                    let step = Box::pin(self.on_read(read)).await;
                    // After the frame is handled: the connection may have waited for the
                    // inbound budget meanwhile, without reading (or hearing) the client.
                    if alive {
                        last_activity = Instant::now();
                    }
                    step
                }
                delivery = deliveries.next() => match delivery {
                    Some(message) => Box::pin(handlers::delivery::handle(self, message)).await,
                    None => {
                        self.connection.close(close::TRY_AGAIN, "message bus connection lost; reconnect");
                        Err(End::DeliveriesEnded)
                    }
                },
                _ = tick.tick() => {
                    let pinged = if last_ping.elapsed() + tick_every > ping_every {
                        last_ping = Instant::now();
                        self.connection.ping()
                    } else {
                        Ok(())
                    };
                    if let Err(e) = pinged {
                        Err(End::from(e))
                    } else if self.connection.reading_paused() {
                        // Over its byte rate: the client sent, the gateway is not reading.
                        last_activity = Instant::now();
                        liveness.touch();
                        Ok(())
                    } else if last_activity.elapsed() > liveness_timeout {
                        let text = format!("no frames or pongs for {} ms", liveness_timeout.as_millis());
                        self.connection.close(close::GOING_AWAY, &text);
                        Err(End::Silent(text))
                    } else {
                        Ok(())
                    }
                }
                () = shutdown.cancelled() => Err(self.shutting_down()),
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    async fn on_read(&mut self, read: Result<Option<Inbound>, ReadError>) -> Result<(), End> {
        match read {
            Err(e) => Err(self.read_failed(e)),
            Ok(None) => Err(End::ClientClosed),
            Ok(Some(Inbound::Frame { frame, bytes })) => {
                let _in_flight = self.admit_inbound(bytes).await?;
                let started = std::time::Instant::now();
                self.frame_bytes = bytes;
                let handled = handlers::dispatch(self, frame).await;
                if bytes >= LARGE_FRAME_BYTES {
                    tracing::debug!(
                        bytes,
                        handle_us = started.elapsed().as_micros() as u64,
                        "large frame handled"
                    );
                }
                handled
            }
            Ok(Some(Inbound::Binary)) => Ok(self.connection.write(&server::error(
                ErrorCode::ProtocolError,
                BINARY_FRAMES_UNSUPPORTED,
            ))?),
            Ok(Some(Inbound::Control)) => Ok(()),
        }
    }

    fn read_failed(&mut self, e: ReadError) -> End {
        match &e {
            ReadError::TooLarge { .. } => {
                let text = e.to_string();
                self.connection.write_last(
                    &server::error(ErrorCode::FrameTooLarge, &text),
                    close::TOO_BIG,
                    &text,
                );
            }
            ReadError::Violation { code, reason } => self.connection.close(*code, reason),
            ReadError::Failed(_) => {}
        }
        End::Read(e)
    }

    fn shutting_down(&self) -> End {
        self.connection
            .close(close::GOING_AWAY, "server shutting down; reconnect");
        End::ShuttingDown
    }

    /// After the connection ended: forgets it, tells the session service and the registry,
    /// and finishes the closing handshake.
    async fn finish(self, end: End) {
        let reason = end.to_string();
        tracing::debug!(connection = %self.connection_id, %reason, "connection ended");
        if let Some(identity) = &self.identity {
            self.state.presence.remove(&self.connection_id);
            // Before the registry hears of it: from now on, device info comes from the registry.
            self.state
                .devices
                .remove(&identity.client_id, &self.connection_id);
            if self.sessions_may_know() {
                crate::events::announce_closed(&self.state, identity, &self.connection_id, &reason)
                    .await;
            } else {
                metrics::counter!("aip_gateway_connection_ends_unannounced_total").increment(1);
            }
            handlers::register::unregister(&self.state, identity, &self.connection_id, &reason)
                .await;
        }
        // When the gateway shuts down, the close frame is sent but answers are not awaited.
        let await_answer = !self.state.shutdown.is_cancelled();
        self.connection.finish(await_answer).await;
    }
}

/// Frames from this size on are logged (at DEBUG) with the time they took to handle.
pub(crate) const LARGE_FRAME_BYTES: usize = 1 << 20;
