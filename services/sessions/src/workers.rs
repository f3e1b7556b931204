//! The background work of a session service replica: consuming the frames stream, planning,
//! answering task submissions over NATS, and the sweepers that resume what a crash left.

use std::time::Duration;

use tracing::Instrument;

use aip_bus::{Headers, Retention, StreamSpec, Trimmed, names};
use futures::StreamExt;
use proto_schemas::flow::{
    ClarificationResponse, HandoffRequest, InvalidAgentRequest, SubmitOutcome, TaskRequest,
    TaskResponse,
};
use proto_schemas::registry::{AgentAction, ManageAgents, Reply};
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent, TaskAccepted, TaskView};
use proto_schemas::{ErrorBody, ErrorCode, V1};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::callbacks::{CallbackTarget, Callbacks};
use crate::engine::{
    ConnectionEnd, Engine, EngineError, Failure, NewTask, Op, Placement, Plan, Requester, TaskFrame,
};
use crate::machine::{Answer, Answerer, Refusal};
use crate::outbox::Stored;
use crate::planners::Planners;
use crate::settling::{Shared, Source};
use crate::store::now_ms;
use aip_bus::Delivery;
use proto_schemas::ClientMessageType;
use proto_schemas::sessions::InboundFrame;

/// The queue group of the session service's request subjects, shared by every replica. (The
/// durable consumer on the frames stream is named after the prefix:
/// [`proto_schemas::Subjects::sessions_consumer`].)
pub const CONSUMER: &str = "aip-sessions";

/// Creates the frames stream the gateways publish into, and the blob stream, with the size
/// caps of `nats` (a full stream refuses new messages instead of dropping stored ones). The
/// frames stream is a work queue: a frame leaves it when the leader acknowledges it.
pub async fn ensure_frames_stream(
    engine: &Engine,
    nats: &aip_bus::NatsSettings,
) -> Result<(), aip_bus::BusError> {
    let subjects = engine.subjects();
    engine
        .bus()
        .ensure_stream(engine.blobs().stream_spec(nats.nats_blobs_max_bytes))
        .await?;
    let mut frames = StreamSpec::new(subjects.frames_stream(), vec![subjects.frames_all()]);
    frames.max_bytes = nats.nats_frames_max_bytes;
    frames.retention = Retention::WorkQueue;
    engine.bus().ensure_stream(frames).await
}

/// Consumes the frames stream until `stop` (the end of this replica's leadership). Frames
/// are taken in chunks of whatever has arrived: a chunk is read and prepared together (its
/// `task` frames' registry lookups run concurrently, the ids they claim are checked in one
/// query) and handed to the applier in stream order. Each frame is acked once the batch
/// holding its change has committed, or nak'ed for redelivery when that batch failed. At most
/// `max_in_flight` stream messages are unacked at once (a `frames_many` is one message).
pub async fn consume_frames(
    engine: Engine,
    max_in_flight: usize,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let stream = engine.subjects().frames_stream();
    release_held_frames(&engine, &stream).await;
    loop {
        let deliveries = match engine
            .bus()
            .consume(
                stream.clone(),
                engine.subjects().sessions_consumer(),
                max_in_flight,
            )
            .await
        {
            Ok(deliveries) => deliveries,
            Err(e) => {
                tracing::error!(
                    "cannot consume the frames stream (retrying in {CONSUMER_RETRY:?}): {e}"
                );
                tokio::select! {
                    () = tokio::time::sleep(CONSUMER_RETRY) => continue,
                    () = stop.cancelled() => return,
                }
            }
        };
        match run_consumer(&engine, deliveries, &stop, &tracker).await {
            ConsumerEnd::Stopped => return,
            ConsumerEnd::Lost(why) => {
                tracing::error!(
                    "the frames consumer is lost ({why}); consuming again in {CONSUMER_RETRY:?}"
                );
                tokio::select! {
                    () = tokio::time::sleep(CONSUMER_RETRY) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    }
}

/// At the start of a term: the frames a previous leader was given and never acknowledged (it
/// died or froze) are delivered again now, instead of after the consumer's ack wait. Frames
/// this one already applied are recognised by their ids. A failure only costs that wait.
async fn release_held_frames(engine: &Engine, stream: &str) {
    match engine
        .bus()
        .release_pending(stream.to_owned(), engine.subjects().sessions_consumer())
        .await
    {
        Ok(0) => {}
        Ok(held) => tracing::info!(
            held,
            "frames a previous leader held are delivered again now"
        ),
        Err(e) => {
            tracing::warn!("frames a previous leader held wait for their redelivery timer: {e}")
        }
    }
}

/// How long to wait before consuming the frames stream again after a failure.
const CONSUMER_RETRY: Duration = Duration::from_secs(1);

/// Chunks in a row with nothing but receive errors after which the consumer is taken for lost
/// (deleted, or its server restarted without it) and created again. A single error (a missed
/// heartbeat while NATS restarts) is not enough.
const LOST_AFTER_ERROR_CHUNKS: u32 = 20;

/// Why a consumer stopped delivering.
enum ConsumerEnd {
    /// This replica stops leading or stops altogether.
    Stopped,
    /// The stream of deliveries ended or keeps failing.
    Lost(&'static str),
}

/// Hands every delivery to the applier, in stream order, until `stop` or the consumer is lost.
async fn run_consumer(
    engine: &Engine,
    deliveries: aip_bus::DurableSubscription,
    stop: &CancellationToken,
    tracker: &TaskTracker,
) -> ConsumerEnd {
    let prepare_engine = engine.clone();
    let mut chunks = deliveries
        .ready_chunks(CHUNK)
        .map(move |chunk| prepare_chunk(prepare_engine.clone(), chunk))
        .buffered(PIPELINE);
    let mut failing_chunks = 0;
    loop {
        let next = tokio::select! {
            next = chunks.next() => next,
            () = stop.cancelled() => return ConsumerEnd::Stopped,
        };
        let Some((chunk, errors)) = next else {
            return ConsumerEnd::Lost("the stream of deliveries ended");
        };
        if chunk.is_empty() && errors > 0 {
            failing_chunks += 1;
            if failing_chunks >= LOST_AFTER_ERROR_CHUNKS {
                return ConsumerEnd::Lost("every receive fails");
            }
            continue;
        }
        failing_chunks = 0;
        for (source, msg_id, event, task, handoff, span) in chunk {
            let (reply, done) = tokio::sync::oneshot::channel();
            let (op, inbound) = match event {
                Inbound::Frame(mut inbound) => {
                    // What a refusal needs is kept; the frame itself goes to the applier, not
                    // copied (its results can be a 90 MiB screenshot).
                    let action_results = inbound.frame.action_results.take();
                    let result = inbound.frame.result.take();
                    let kept = inbound.clone();
                    inbound.frame.action_results = action_results;
                    inbound.frame.result = result;
                    let op = Op::Frame {
                        inbound: Box::new(inbound),
                        msg_id: msg_id.clone(),
                        task: task.map(Box::new),
                        handoff,
                        reply,
                    };
                    (op, Some(kept))
                }
                Inbound::Ends(ends) => (
                    Op::Closed {
                        ends: ends.into_iter().map(ConnectionEnd::from).collect(),
                        reply,
                    },
                    None,
                ),
            };
            if !engine.send_op(op).instrument(span).await {
                return ConsumerEnd::Stopped;
            }
            engine.frames.received();
            tracker.spawn(settle(engine.clone(), source, msg_id, inbound, done));
        }
    }
}

/// The agents the registry offers for a `handoff` frame.
type HandoffCandidates = Result<Vec<proto_schemas::registry::AgentRecord>, ErrorBody>;

/// What an event read from the frames stream asks of the applier.
#[expect(
    clippy::large_enum_variant,
    reason = "one per stream message, moved a few times: a box would cost an allocation per frame"
)]
enum Inbound {
    /// A client's frame (alone, or one of a `frames_many`).
    Frame(InboundFrame),
    /// Connections' ends, in order (a `closed` or a `closed_many`).
    Ends(Vec<ConnectionClosed>),
}

/// One event read from the frames stream: where it came from (to settle it), its message
/// id, and the span it is handled in.
struct ReadEvent {
    source: Source,
    msg_id: String,
    event: Inbound,
    span: tracing::Span,
}

/// One event, read and prepared (a `task` frame's task, a `handoff` frame's candidates).
type PreparedEvent = (
    Source,
    String,
    Inbound,
    Option<TaskFrame>,
    Option<HandoffCandidates>,
    tracing::Span,
);

/// Reads and prepares a chunk of stream messages: bodies and events concurrently, then the
/// chunk's `task` frames together. Also returns how many receives failed.
async fn prepare_chunk(
    engine: Engine,
    chunk: Vec<Result<Delivery, aip_bus::BusError>>,
) -> (Vec<PreparedEvent>, u32) {
    let mut errors = 0;
    let read = futures::future::join_all(chunk.into_iter().filter_map(|d| match d {
        Ok(d) => Some(read_event(&engine, d)),
        Err(e) => {
            tracing::warn!("frames stream: {e}");
            errors += 1;
            None
        }
    }))
    .await;
    let events: Vec<ReadEvent> = read.into_iter().flatten().collect();
    // As soon as an end is read: the chunks prepared after this one ask the registry again.
    // A frame says where its client is now.
    for ReadEvent { event, span, .. } in &events {
        match event {
            Inbound::Ends(ends) => {
                for closed in ends {
                    forget_connection(&engine, closed);
                }
            }
            Inbound::Frame(f) => {
                let routes = engine.routes();
                routes.heard(&f.client_id, &f.gateway_id, &f.connection_id);
                engine.target_heard(&f.client_id, &f.connection_id);
                if f.delivery_batches {
                    routes.reads_batches(&f.gateway_id);
                }
                if let Some(id) = &f.frame.session_id {
                    aip_bus::trace::record_session(span, id);
                }
            }
        }
    }
    let task_frames: Vec<&InboundFrame> = events
        .iter()
        .filter_map(|ReadEvent { event, .. }| match event {
            Inbound::Frame(f) if f.frame.kind == ClientMessageType::Task => Some(f),
            _ => None,
        })
        .collect();
    // The chunk's registry lookups run in the span of its first task frame.
    let first_task_span = events
        .iter()
        .find(|ReadEvent { event, .. }| {
            matches!(event, Inbound::Frame(f) if f.frame.kind == ClientMessageType::Task)
        })
        .map_or_else(tracing::Span::none, |read| read.span.clone());
    let started = std::time::Instant::now();
    let mut prepared = engine
        .prepare_frames(&task_frames)
        .instrument(first_task_span)
        .await
        .into_iter();
    tracing::debug!(
        frames = events.len(),
        tasks = task_frames.len(),
        prepare_us = started.elapsed().as_micros() as u64,
        "chunk prepared"
    );
    // A handoff frame's candidates, looked up now (they are rare: one at a time).
    let mut handoffs = Vec::new();
    for ReadEvent { event, .. } in &events {
        handoffs.push(match event {
            Inbound::Frame(f) if f.frame.kind == ClientMessageType::Handoff => Some(
                engine
                    .handoff_candidates(&crate::machine::handoff_placement(f))
                    .await,
            ),
            _ => None,
        });
    }
    let prepared = events
        .into_iter()
        .zip(handoffs)
        .map(|(read, handoff)| {
            let task = match &read.event {
                Inbound::Frame(f) if f.frame.kind == ClientMessageType::Task => prepared.next(),
                _ => None,
            };
            (
                read.source,
                read.msg_id,
                read.event,
                task,
                handoff,
                read.span,
            )
        })
        .collect();
    (prepared, errors)
}

/// A connection's end read: the chunks prepared after this one ask the registry about its
/// client again, and nothing more is routed to that connection.
fn forget_connection(engine: &Engine, closed: &ConnectionClosed) {
    engine.forget_target(&closed.client_id);
    engine
        .routes()
        .closed(&closed.client_id, &closed.connection_id);
}

impl From<ConnectionClosed> for ConnectionEnd {
    fn from(closed: ConnectionClosed) -> Self {
        ConnectionEnd {
            client_id: closed.client_id,
            connection_id: closed.connection_id,
        }
    }
}

/// Chunks prepared at once; they reach the applier in stream order.
const PIPELINE: usize = 16;

/// Stream messages taken into one chunk at most.
const CHUNK: usize = 256;

/// Acks a frame once its change committed (after answering a refused one), or naks it.
async fn settle(
    engine: Engine,
    source: Source,
    msg_id: String,
    inbound: Option<InboundFrame>,
    done: tokio::sync::oneshot::Receiver<Result<(), Failure>>,
) {
    let outcome = done
        .await
        .unwrap_or_else(|_| Err(Failure::Store("the applier stopped".into())));
    let verdict = match outcome {
        Ok(()) => Ok(()),
        // Not applied: kept, whatever the attempt (nothing is lost in a database outage).
        Err(Failure::Store(e) | Failure::Refused(Refusal::Retry(e))) => {
            Err(format!("frame not applied, will retry: {e}"))
        }
        Err(Failure::Refused(refusal)) => match &inbound {
            // A refusal whose database checks keep failing is sent without them rather than
            // holding the frame, and the frames behind it, forever.
            Some(inbound) => engine
                .refuse_frame(
                    inbound,
                    &msg_id,
                    refusal,
                    source.delivered() < REFUSAL_ATTEMPTS,
                )
                .await
                .map_err(|e| format!("refusal not sent, will retry: {e}")),
            None => Ok(()),
        },
    };
    match &verdict {
        Ok(()) => engine.frames.acked(),
        Err(why) => {
            tracing::warn!(attempt = source.delivered(), "{why}");
            engine.frames.released();
        }
    }
    source.settle(verdict, REDELIVERY_DELAY).await;
}

/// Events from this size on are logged (at DEBUG) with the time they took to read.
const LARGE_EVENT_BYTES: usize = 1 << 20;

/// How soon a frame handed back is delivered again.
const REDELIVERY_DELAY: Duration = Duration::from_millis(500);

/// Deliveries of a refused frame after which its refusal is sent without the database checks
/// that keep failing (was it applied before? has its task ended?).
const REFUSAL_ATTEMPTS: u64 = 10;

/// Reads one delivery: its message id, and its event (through the blob store for a large
/// body), each frame of a `frames_many` as its own event. None when it was settled here: an
/// unreadable event is dropped, a body not readable yet is nak'ed.
async fn read_event(engine: &Engine, delivery: Delivery) -> Vec<ReadEvent> {
    let msg_id = delivery
        .message
        .headers
        .get(names::MSG_ID)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{}:{}", delivery.message.subject, uuid::Uuid::new_v4()));
    let started = std::time::Instant::now();
    let payload = match engine
        .blobs()
        .payload_of(engine.bus().as_ref(), &delivery.message)
        .await
    {
        Ok(payload) => payload,
        Err(e @ aip_bus::BusError::BadBlobRef { .. }) => {
            // Not ours or not consistent: reading it again cannot help.
            tracing::error!(subject = %delivery.message.subject, "frame with a refused blob reference, dropped: {e}");
            let _ = delivery.ack().await;
            return Vec::new();
        }
        Err(e) => {
            tracing::warn!(
                attempt = delivery.delivered,
                "large frame not readable yet, will retry: {e}"
            );
            let _ = delivery.nak(Duration::from_secs(1)).await;
            return Vec::new();
        }
    };
    let read = started.elapsed();
    let event = serde_json::from_slice(&payload);
    if payload.len() >= LARGE_EVENT_BYTES {
        tracing::debug!(
            bytes = payload.len(),
            read_us = read.as_micros() as u64,
            decode_us = (started.elapsed() - read).as_micros() as u64,
            "large frame read"
        );
    }
    let event = match event {
        Ok(GatewayEvent::Frame(frame)) => Inbound::Frame(frame),
        Ok(GatewayEvent::Closed(closed)) => Inbound::Ends(vec![closed]),
        Ok(GatewayEvent::ClosedMany(many)) => Inbound::Ends(many.connections),
        Ok(GatewayEvent::FramesMany(many)) if !many.frames.is_empty() => {
            let spans: Vec<tracing::Span> = many
                .frames
                .iter()
                .map(|f| engine.gathered_frame_span(&delivery.message, f.traceparent.as_deref()))
                .collect();
            let shared = std::sync::Arc::new(Shared::new(delivery, many.frames.len()));
            return many
                .frames
                .into_iter()
                .zip(spans)
                .map(|(gathered, span)| ReadEvent {
                    source: Source::Shared(shared.clone()),
                    msg_id: gathered.msg_id,
                    event: Inbound::Frame(gathered.inbound),
                    span,
                })
                .collect();
        }
        Ok(GatewayEvent::FramesMany(_)) => {
            tracing::error!(subject = %delivery.message.subject, "a frames_many event with no frame in the frames stream, dropped");
            let _ = delivery.ack().await;
            return Vec::new();
        }
        Err(e) => {
            tracing::error!(subject = %delivery.message.subject, "unreadable event in the frames stream, dropped: {e}");
            let _ = delivery.ack().await;
            return Vec::new();
        }
    };
    vec![ReadEvent {
        span: engine.frame_span(&delivery.message),
        source: Source::Alone(delivery),
        msg_id,
        event,
    }]
}

/// Every second while leading: re-sends the outbox frames no gateway acknowledged within
/// five seconds (a publish lost in a NATS restart, a gateway that was resubscribing, frames a
/// crash left unsent; gateways drop the copies they already wrote), and drops those older than
/// `outbox_retention_ms` (their client is gone: its connection's end has ended their tasks).
pub async fn run_outbox_sweeper(engine: Engine, stop: CancellationToken) {
    let mut tick = tokio::time::interval(OUTBOX_SWEEP_EVERY);
    let retention = i64::try_from(engine.settings().outbox_retention_ms).unwrap_or(i64::MAX / 4);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let now = now_ms();
        let expired = match engine
            .store
            .expired_outbox(now - retention, OUTBOX_SWEEP_ROWS)
            .await
        {
            Ok(expired) => expired,
            Err(e) => {
                tracing::warn!("outbox sweep failed: {e}");
                continue;
            }
        };
        if !expired.is_empty() {
            tracing::warn!(
                count = expired.len(),
                retention_ms = retention,
                "frames no gateway acknowledged within the retention are dropped"
            );
        }
        let dropped: std::collections::HashSet<String> = expired.iter().cloned().collect();
        engine.mark_dropped(expired);
        let recent = engine.recently_published(OUTBOX_RESEND_AFTER);
        match engine
            .store
            .stale_outbox(
                now - OUTBOX_RESEND_AFTER.as_millis() as i64,
                &recent,
                OUTBOX_SWEEP_ROWS,
            )
            .await
        {
            Ok(rows) => {
                let recent: std::collections::HashSet<&str> =
                    recent.iter().map(String::as_str).collect();
                let mut frames = Vec::new();
                for row in rows {
                    match row {
                        Stored::Alone(frame) if !dropped.contains(&frame.msg_id) => {
                            frames.push(frame)
                        }
                        Stored::Alone(_) => {}
                        Stored::Group { key, .. } if dropped.contains(&key) => {}
                        Stored::Group {
                            key,
                            frames: grouped,
                        } => {
                            let unacknowledged = engine.split_group(&key, grouped);
                            frames.extend(
                                unacknowledged
                                    .into_iter()
                                    .filter(|f| !recent.contains(f.msg_id.as_str())),
                            );
                        }
                    }
                }
                if !frames.is_empty() {
                    engine.publish_frames(frames).await;
                }
            }
            Err(e) => tracing::warn!("outbox sweep failed: {e}"),
        }
    }
}

/// Every second while leading: removes the frames the session service has acknowledged from
/// a frames stream made by an older version, which keeps what was consumed (JetStream's
/// `limits` retention): without this it filled to `nats_frames_max_bytes` within hours of
/// steady traffic (minutes at a few thousand tasks per second) and then refused every client
/// frame until the oldest aged out a day later. A work queue (every stream made now) removes
/// them itself, and the trimmer stops at once.
pub async fn run_frames_trimmer(engine: Engine, stop: CancellationToken) {
    let stream = engine.subjects().frames_stream();
    let consumer = engine.subjects().sessions_consumer();
    let mut tick = tokio::time::interval(FRAMES_TRIM_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        match engine
            .bus()
            .trim_acknowledged(stream.clone(), consumer.clone())
            .await
        {
            Ok(Trimmed::ByItself) => return,
            Ok(Trimmed::Removed(0)) => {}
            Ok(Trimmed::Removed(removed)) => {
                tracing::debug!(removed, "acknowledged frames removed from the stream")
            }
            Ok(Trimmed::Unsafe { server_version }) => {
                tracing::warn!(
                    stream,
                    server_version,
                    "the frames stream keeps consumed frames (made by an older aip) and this \
                     nats-server would lose frames held for another try if it were trimmed: \
                     it is left to fill up to nats_frames_max_bytes. Upgrade nats-server to \
                     2.9.15 or later, or delete the stream while it is empty (nats stream rm) \
                     so that aip-sessions makes it again as a work queue"
                );
                return;
            }
            Err(e) => tracing::warn!("acknowledged frames not removed from the stream: {e}"),
        }
    }
}

/// How often acknowledged frames leave the frames stream.
const FRAMES_TRIM_EVERY: Duration = Duration::from_secs(1);

/// How often the outbox is swept.
const OUTBOX_SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A frame not acknowledged this long after it was committed, and after it was published,
/// is sent again.
const OUTBOX_RESEND_AFTER: Duration = Duration::from_secs(5);
/// Rows one sweep handles at most.
const OUTBOX_SWEEP_ROWS: i64 = 500;

/// Reads this replica's delivery acknowledgements until `stop`: each acknowledged frame leaves
/// the outbox with the next group. Subscribed before anything is published.
pub async fn run_ack_listener(
    engine: Engine,
    mut acks: aip_bus::Subscription,
    stop: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            message = acks.next() => message,
            () = stop.cancelled() => return,
        };
        let Some(message) = message else {
            tracing::error!(
                "the delivery acknowledgement subscription ended; frames are sent again until their retention"
            );
            return;
        };
        match serde_json::from_slice::<proto_schemas::sessions::DeliveryAck>(&message.payload) {
            Ok(ack) => engine.mark_published(ack.msg_ids),
            Err(e) => {
                tracing::warn!(subject = %message.subject, "not a delivery acknowledgement, ignored: {e}")
            }
        }
    }
}

/// Answers `sessions.submit` (a [`TaskRequest`]), `sessions.clarify` (a
/// ClarificationResponse) and `sessions.handoff` (a HandoffRequest) until `stop`.
pub async fn serve_requests(engine: Engine, stop: CancellationToken, tracker: TaskTracker) {
    let subjects = engine.subjects();
    tokio::join!(
        serve(
            engine.clone(),
            subjects.sessions_submit(),
            &stop,
            &tracker,
            submit
        ),
        serve(
            engine.clone(),
            subjects.sessions_clarify(),
            &stop,
            &tracker,
            clarify
        ),
        serve(
            engine.clone(),
            subjects.sessions_handoff(),
            &stop,
            &tracker,
            handoff
        ),
    );
}

/// Serves one request/reply subject in the queue group until `stop`: each request is handled
/// on its own task (tracked, so that shutdown waits for it) and answered with a
/// [`Reply`], its error code also in the `Aip-Error-Code` header.
async fn serve<T, F, Fut>(
    engine: Engine,
    subject: String,
    stop: &CancellationToken,
    tracker: &TaskTracker,
    handle: F,
) where
    T: serde::Serialize + Send + 'static,
    F: Fn(Engine, bytes::Bytes) -> Fut,
    Fut: Future<Output = Reply<T>> + Send + 'static,
{
    let mut requests = match engine
        .bus()
        .queue_subscribe(subject.clone(), CONSUMER.to_owned())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot serve {subject}: {e}");
            return;
        }
    };
    loop {
        let message = tokio::select! {
            m = requests.next() => m,
            () = stop.cancelled() => return,
        };
        let Some(message) = message else { return };
        let reply = handle(engine.clone(), message.payload.clone());
        let engine = engine.clone();
        tracker.spawn(async move {
            let reply = reply.await;
            let mut headers = Headers::new();
            if let Reply::Error(body) = &reply {
                headers.insert(names::ERROR_CODE, body.error_code.as_str());
            }
            match serde_json::to_vec(&reply) {
                Ok(payload) => {
                    if let Err(e) =
                        aip_bus::respond(engine.bus().as_ref(), &message, headers, payload.into())
                            .await
                    {
                        tracing::warn!("could not reply on {}: {e}", message.subject);
                    }
                }
                Err(e) => tracing::error!("a reply could not be encoded, not sent: {e}"),
            }
        });
    }
}

/// The reply to an engine's refusal or database failure.
fn refused(e: EngineError) -> ErrorBody {
    match e {
        EngineError::Refused(body) => body,
        EngineError::Store(e) => ErrorBody::new(ErrorCode::Unavailable, e.to_string()),
    }
}

/// `sessions.submit`: starts the task, or answers seed 004's agent management at once.
async fn submit(engine: Engine, payload: bytes::Bytes) -> Reply<SubmitOutcome> {
    let request = match read_submission(&payload) {
        Ok(request) => request,
        Err(e) => {
            return Reply::Error(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("not a TaskRequest: {e}"),
            ));
        }
    };
    if let Some(action) = request.agent_action() {
        let requested_by = format!("nats:{}", request.originating_agent_id);
        return answer_agent_request(&engine, request.task_id, action, requested_by)
            .await
            .map(SubmitOutcome::Answered)
            .into();
    }
    let new = match new_task_from_request(
        request,
        Requester::Nats,
        engine.planners(),
        engine.callbacks(),
    ) {
        Ok(new) => new,
        Err(body) => return Reply::Error(body),
    };
    engine
        .submit(new)
        .await
        .map(|started| SubmitOutcome::Accepted(accepted(&started.task)))
        .map_err(refused)
        .into()
}

/// Answers a TaskRequest that is seed 004's agent management (see
/// [`TaskRequest::agent_action`]) with its TaskResponse, asking the registry on
/// `registry.agents`; no task is created. `task_id` is the request's, or a new UUID.
///
/// A malformed request, a taken id or no agent found is a `failed` TaskResponse; `Err` only
/// when the broker cannot answer (no registry, no reply in time, an unreadable reply).
pub async fn answer_agent_request(
    engine: &Engine,
    task_id: Option<String>,
    action: Result<AgentAction, InvalidAgentRequest>,
    requested_by: String,
) -> Result<TaskResponse, ErrorBody> {
    let task_id = task_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let action = match action {
        Ok(action) => action,
        Err(invalid) => {
            return Ok(TaskResponse::for_agent_action(
                task_id,
                Err(invalid.to_string()),
            ));
        }
    };
    let request = ManageAgents {
        version: V1,
        requested_by,
        action,
    };
    match engine.registry().manage(&request).await {
        Ok(outcome) => Ok(TaskResponse::for_agent_action(task_id, Ok(outcome))),
        Err(aip_bus::RegistryError::Refused(body)) if TaskResponse::answers_agent_action(&body) => {
            Ok(TaskResponse::for_agent_action(task_id, Err(body.detail)))
        }
        Err(e) => Err(e.into_error_body()),
    }
}

/// `sessions.clarify`: answers the task's open question.
async fn clarify(engine: Engine, payload: bytes::Bytes) -> Reply<TaskView> {
    let response = match serde_json::from_slice::<ClarificationResponse>(&payload) {
        Ok(response) => response,
        Err(e) => {
            return Reply::Error(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("not a ClarificationResponse: {e}"),
            ));
        }
    };
    let answer = Answer {
        clarification_id: response.clarification_id,
        text: response.answer,
        data: response.data,
        by: Answerer::Nats(response.provided_by),
    };
    engine
        .answer_question(&response.task_id, answer)
        .await
        .map(|task| task.view())
        .map_err(refused)
        .into()
}

/// `sessions.handoff`: hands the task to another agent.
async fn handoff(engine: Engine, payload: bytes::Bytes) -> Reply<TaskView> {
    let request = match serde_json::from_slice::<HandoffRequest>(&payload) {
        Ok(request) => request,
        Err(e) => {
            return Reply::Error(ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!("not a HandoffRequest: {e}"),
            ));
        }
    };
    let to = match request.target_id {
        Some(target) => Placement::Target(target),
        None => Placement::Capabilities(request.required_capabilities),
    };
    let by = format!("nats:{}", request.requested_by);
    engine
        .handoff(&request.task_id, to, request.reason, by)
        .await
        .map(|task| task.view())
        .map_err(refused)
        .into()
}

/// A `sessions.submit` payload as a [`TaskRequest`], its text made storable as REST's is
/// (a NUL, which PostgreSQL cannot hold, becomes U+FFFD; a `task_id` with one would otherwise
/// fail the whole batch of changes it is written in).
fn read_submission(payload: &[u8]) -> Result<TaskRequest, serde_json::Error> {
    let mut value: serde_json::Value = serde_json::from_slice(payload)?;
    crate::store::storable(&mut value);
    serde_json::from_value(value)
}

/// The reply to an accepted submission.
pub fn accepted(task: &crate::task::Task) -> TaskAccepted {
    TaskAccepted {
        task_id: task.task_id.clone(),
        task_name: task.task_name.clone(),
        executor_id: task.executor.id.clone(),
        state: task.state(),
    }
}

/// Checks a [`TaskRequest`] (REST or NATS) and turns it into a task to start.
pub fn new_task_from_request(
    request: TaskRequest,
    requester: impl FnOnce(String) -> Requester,
    planners: &Planners,
    callbacks: &Callbacks,
) -> Result<NewTask, ErrorBody> {
    let invalid = |detail: String| ErrorBody::new(ErrorCode::InvalidRequest, detail);
    if request.description.trim().is_empty() {
        return Err(invalid("`description` must not be empty".into()));
    }
    if let Some(name) = &request.task_name
        && !crate::engine::valid_task_name(name)
    {
        return Err(invalid(format!(
            "{} (got {name:?})",
            crate::engine::TASK_NAME_RULE
        )));
    }
    if let Some(id) = &request.task_id
        && (id.is_empty() || id.len() > proto_schemas::MAX_ID_BYTES)
    {
        return Err(invalid(format!(
            "`task_id` must be 1 to {} bytes",
            proto_schemas::MAX_ID_BYTES
        )));
    }
    let callback = match (request.callback_url, request.callback_agent) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "give `callback_url` or `callback_agent`, not both".into(),
            ));
        }
        (Some(url), None) => {
            callbacks.check_url(&url).map_err(invalid)?;
            Some(CallbackTarget::Url(url))
        }
        (None, Some(agent)) => {
            if agent.is_empty() || agent.len() > proto_schemas::MAX_ID_BYTES {
                return Err(invalid(format!(
                    "`callback_agent` must be 1 to {} bytes",
                    proto_schemas::MAX_ID_BYTES
                )));
            }
            Some(CallbackTarget::Agent(agent))
        }
        (None, None) => None,
    };
    let placement = match (&request.target_id, request.required_capabilities.is_empty()) {
        (Some(target), _) => Placement::Target(target.clone()),
        (None, false) => Placement::Capabilities(request.required_capabilities.clone()),
        (None, true) => {
            return Err(invalid(
                "give `target_id` or `required_capabilities`".into(),
            ));
        }
    };
    let plan = match (request.steps, request.driver, request.planner) {
        (Some(_), true, _) => {
            return Err(invalid("give `steps` or `driver: true`, not both".into()));
        }
        (Some(_), _, Some(_)) | (_, true, Some(_)) => {
            return Err(invalid(
                "`planner` is for tasks without `steps` and not driven".into(),
            ));
        }
        (Some(steps), false, None) => Plan::Scripted(steps),
        (None, true, None) => Plan::Driver,
        (None, false, requested) => Plan::Planner(planners.choose(requested)?),
    };
    Ok(NewTask {
        task_id: request.task_id,
        task_name: request.task_name,
        data: request.data,
        priority: request.priority.unwrap_or(0),
        callback_url: callback.map(|c| c.stored()),
        callback_on: request.callback_on,
        timeout_secs: request.timeout_secs,
        ..NewTask::new(
            request.description,
            requester(request.originating_agent_id),
            placement,
            plan,
        )
    })
}
