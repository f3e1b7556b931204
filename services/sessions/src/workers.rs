//! The background work of a session service replica: consuming the frames stream, planning,
//! answering task submissions over NATS, and the sweepers that resume what a crash left.

use std::sync::Arc;
use std::time::Duration;

use aip_bus::{Headers, StreamSpec, names};
use futures::StreamExt;
use proto_schemas::flow::TaskRequest;
use proto_schemas::registry::Reply;
use proto_schemas::sessions::{GatewayEvent, TaskAccepted};
use proto_schemas::{ErrorBody, ErrorCode};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::engine::{Engine, EngineError, NewTask, Placement, Plan, Requester};
use crate::store::now_ms;

/// The durable consumer's name, shared by every replica.
pub const CONSUMER: &str = "aip-sessions";

/// Creates the frames stream the gateways publish into, and the blob stream.
pub async fn ensure_frames_stream(engine: &Engine) -> Result<(), aip_bus::BusError> {
    let subjects = engine.subjects();
    engine
        .bus()
        .ensure_stream(engine.blobs().stream_spec())
        .await?;
    engine
        .bus()
        .ensure_stream(StreamSpec::new(
            subjects.frames_stream(),
            vec![subjects.frames_all()],
        ))
        .await
}

/// Consumes the frames stream until `stop`: each event is applied, then acked; a database
/// failure naks it for redelivery. At most `max_in_flight` events are processed at once.
pub async fn consume_frames(
    engine: Engine,
    max_in_flight: usize,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let stream = engine.subjects().frames_stream();
    let mut deliveries = loop {
        match engine
            .bus()
            .consume(stream.clone(), CONSUMER.to_owned(), max_in_flight * 2)
            .await
        {
            Ok(d) => break d,
            Err(e) => {
                tracing::error!("cannot consume the frames stream (retrying in 1 s): {e}");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    };
    let permits = Arc::new(Semaphore::new(max_in_flight));
    loop {
        let delivery = tokio::select! {
            d = deliveries.next() => d,
            () = stop.cancelled() => return,
        };
        let delivery = match delivery {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                tracing::warn!("frames stream: {e}");
                continue;
            }
            None => {
                tracing::error!("the frames stream ended");
                return;
            }
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let engine = engine.clone();
        tracker.spawn(async move {
            let msg_id = delivery
                .message
                .headers
                .get(names::MSG_ID)
                .map(str::to_owned)
                .unwrap_or_else(|| format!("{}:{}", delivery.message.subject, uuid::Uuid::new_v4()));
            let payload = match aip_bus::payload_of(engine.bus().as_ref(), &delivery.message).await {
                Ok(payload) => payload,
                Err(e) => {
                    tracing::warn!(attempt = delivery.delivered, "large frame not readable yet, will retry: {e}");
                    let _ = delivery.nak(Duration::from_secs(1)).await;
                    return;
                }
            };
            let event: GatewayEvent = match serde_json::from_slice(&payload) {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!(subject = %delivery.message.subject, "unreadable event in the frames stream, dropped: {e}");
                    let _ = delivery.ack().await;
                    return;
                }
            };
            match engine.handle_event(event, &msg_id).await {
                Ok(()) | Err(EngineError::Refused(_)) => {
                    if let Err(e) = delivery.ack().await {
                        tracing::warn!("ack failed (the frame will be redelivered, and skipped): {e}");
                    }
                }
                Err(EngineError::Store(e)) => {
                    tracing::warn!(attempt = delivery.delivered, "frame not applied, will retry: {e}");
                    let _ = delivery.nak(Duration::from_millis(500)).await;
                }
            }
            drop(permit);
        });
    }
}

/// Runs planning requests, at most `concurrency` at once.
pub async fn run_planner(
    engine: Engine,
    mut plans: mpsc::Receiver<String>,
    concurrency: usize,
    tracker: TaskTracker,
) {
    let permits = Arc::new(Semaphore::new(concurrency));
    while let Some(task_id) = plans.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let engine = engine.clone();
        tracker.spawn(async move {
            if let Err(e) = engine.plan(&task_id).await {
                tracing::warn!(task = %task_id, "planning failed, the sweeper retries: {e}");
            }
            drop(permit);
        });
    }
}

/// Deletes published outbox rows in batches.
pub async fn run_outbox_cleaner(engine: Engine, mut done: mpsc::Receiver<i64>) {
    let mut batch = Vec::new();
    while let Some(id) = done.recv().await {
        batch.push(id);
        while let Ok(id) = done.try_recv() {
            batch.push(id);
            if batch.len() >= 1000 {
                break;
            }
        }
        if let Err(e) = engine.store.delete_outbox(&batch).await {
            tracing::warn!("outbox cleanup failed (the rows will be re-sent by the sweeper): {e}");
        }
        batch.clear();
    }
}

/// Every half second: fail expired tasks, plan tasks a crash left unplanned, re-send outbox
/// rows a crash left unsent; every minute, forget old processed-frame ids.
pub async fn run_sweeper(engine: Engine, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut rounds: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        rounds += 1;
        let now = now_ms();
        match engine.store.due_deadlines(now, 200).await {
            Ok(ids) => {
                for id in ids {
                    if let Err(e) = engine.expire(&id).await {
                        tracing::warn!(task = %id, "timeout not applied: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("deadline sweep failed: {e}"),
        }
        match engine.store.due_plans(now - 5_000, 200).await {
            Ok(ids) => {
                for id in ids {
                    if let Err(e) = engine.plan(&id).await {
                        tracing::warn!(task = %id, "planning retry failed: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("planning sweep failed: {e}"),
        }
        match engine.store.stale_outbox(now - 5_000, 500).await {
            Ok(rows) => {
                let mut sent = Vec::new();
                for row in rows {
                    let headers = crate::engine::delivery_headers(row.id);
                    let publish = engine.blobs().publish(
                        engine.bus().as_ref(),
                        row.subject.clone(),
                        headers,
                        row.payload.into(),
                    );
                    match publish.await {
                        Ok(()) => sent.push(row.id),
                        Err(e) => {
                            tracing::warn!(subject = %row.subject, "outbox re-send failed: {e}")
                        }
                    }
                }
                if let Err(e) = engine.store.delete_outbox(&sent).await {
                    tracing::warn!("outbox cleanup failed: {e}");
                }
            }
            Err(e) => tracing::warn!("outbox sweep failed: {e}"),
        }
        if rounds % 120 == 0 {
            if let Err(e) = engine.store.prune_processed(now - 3_600_000).await {
                tracing::warn!("pruning processed frame ids failed: {e}");
            }
        }
    }
}

/// Answers `sessions.submit`: a [`TaskRequest`] over NATS.
pub async fn serve_submissions(engine: Engine, stop: CancellationToken, tracker: TaskTracker) {
    let subject = engine.subjects().sessions_submit();
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
        let engine = engine.clone();
        tracker.spawn(async move {
            let reply: Reply<TaskAccepted> =
                match serde_json::from_slice::<TaskRequest>(&message.payload) {
                    Ok(request) => match new_task_from_request(request, Requester::Nats) {
                        Ok(new) => match engine.submit(new, None).await {
                            Ok(started) => Reply::Ok(accepted(&started.task)),
                            Err(EngineError::Refused(body)) => Reply::Error(body),
                            Err(EngineError::Store(e)) => {
                                Reply::Error(ErrorBody::new(ErrorCode::Unavailable, e.to_string()))
                            }
                        },
                        Err(body) => Reply::Error(body),
                    },
                    Err(e) => Reply::Error(ErrorBody::new(
                        ErrorCode::InvalidRequest,
                        format!("not a TaskRequest: {e}"),
                    )),
                };
            let mut headers = Headers::new();
            if let Reply::Error(body) = &reply {
                headers.insert(names::ERROR_CODE, body.error_code.as_str());
            }
            let payload = serde_json::to_vec(&reply).unwrap_or_default();
            if let Err(e) =
                aip_bus::respond(engine.bus().as_ref(), &message, headers, payload.into()).await
            {
                tracing::warn!("could not answer a submission: {e}");
            }
        });
    }
}

/// The reply to an accepted submission.
pub fn accepted(task: &crate::store::TaskRow) -> TaskAccepted {
    TaskAccepted {
        task_id: task.task_id.clone(),
        task_name: task.task_name.clone(),
        executor_id: task.executor_id.clone().unwrap_or_default(),
        state: task.state(),
    }
}

/// Checks a [`TaskRequest`] (REST or NATS) and turns it into a task to start.
pub fn new_task_from_request(
    request: TaskRequest,
    requester: impl FnOnce(String) -> Requester,
) -> Result<NewTask, ErrorBody> {
    let invalid = |detail: String| ErrorBody::new(ErrorCode::InvalidRequest, detail);
    if request.description.trim().is_empty() {
        return Err(invalid("`description` must not be empty".into()));
    }
    if let Some(name) = &request.task_name {
        if !crate::engine::valid_task_name(name) {
            return Err(invalid(format!(
                "Invalid task_name: must be a non-empty string of characters [A-Za-z0-9._-] and must not start with '.' (got {name:?})"
            )));
        }
    }
    if let Some(id) = &request.task_id {
        if id.is_empty() || id.len() > proto_schemas::MAX_ID_BYTES {
            return Err(invalid(format!(
                "`task_id` must be 1 to {} bytes",
                proto_schemas::MAX_ID_BYTES
            )));
        }
    }
    let placement = match (&request.target_id, request.required_capabilities.is_empty()) {
        (Some(target), _) => Placement::Target(target.clone()),
        (None, false) => Placement::Capabilities(request.required_capabilities.clone()),
        (None, true) => {
            return Err(invalid(
                "give `target_id` or `required_capabilities`".into(),
            ));
        }
    };
    Ok(NewTask {
        task_id: request.task_id,
        task_name: request.task_name,
        request: request.description,
        data: request.data,
        requester: requester(request.originating_agent_id),
        placement,
        plan: match (request.steps, request.driver) {
            (Some(_), true) => {
                return Err(invalid("give `steps` or `driver: true`, not both".into()));
            }
            (Some(steps), false) => Plan::Scripted(steps),
            (None, true) => Plan::Driver,
            (None, false) => Plan::Remote,
        },
        priority: request.priority.unwrap_or(0),
        callback_url: request.callback_url,
        timeout_secs: request.timeout_secs,
        ufo_dispatch: false,
    })
}
