//! The bench's own devices for `devinfo`, `tasks` and `rest`: registered UFO devices that
//! answer every `command` frame at once (one success Result per Command, echoing its
//! parameters), heartbeat every 30 s and count what the broker did to them. Device `i` is on
//! gateway [`crate::target::Target::gateway`]`(i)`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::conn::{Conn, WireError};
use crate::report::DeviceFigures;
use crate::scenario::Ctx;
use crate::wire::{self, Inbound};

/// Seconds between a held device's heartbeats (Galaxy's interval).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);

/// Running devices.
pub(crate) struct Fleet {
    ids: Vec<String>,
    stop: watch::Sender<bool>,
    handles: Vec<JoinHandle<Option<String>>>,
    answered: Arc<AtomicU64>,
}

impl Fleet {
    /// Connects and registers `count` devices (`{prefix}-dev-{i}`, spread over the gateways
    /// round robin); any refusal ends the run with the broker's reason.
    pub async fn start(ctx: &Ctx, count: usize) -> anyhow::Result<Fleet> {
        ctx.progress
            .phase("registering the bench's devices", count as u64);
        let ids: Vec<String> = (0..count)
            .map(|i| format!("{}-dev-{i}", ctx.prefix))
            .collect();
        let (stop, stopped) = watch::channel(false);
        let answered = Arc::new(AtomicU64::new(0));
        let mut connecting = Vec::with_capacity(count);
        for (i, id) in ids.iter().enumerate() {
            let ctx = ctx.clone();
            let id = id.clone();
            connecting.push(tokio::spawn(async move {
                let frame = wire::device_register(&id);
                let gateway = ctx.target.gateway(i);
                let result = Conn::registered(gateway, frame, ctx.timeout, ctx.deadline).await;
                match &result {
                    Ok(_) => ctx.progress.done(),
                    Err(_) => ctx.progress.failed(),
                }
                (id, result)
            }));
        }
        let mut conns = Vec::with_capacity(count);
        let mut first_error: Option<anyhow::Error> = None;
        for handle in connecting {
            match handle.await {
                Ok((_, Ok(conn))) => conns.push(conn),
                Ok((id, Err(e))) => {
                    first_error.get_or_insert_with(|| {
                        anyhow::anyhow!("the bench's device `{id}` could not register: {e}")
                    });
                }
                Err(e) => {
                    first_error.get_or_insert_with(|| anyhow::anyhow!("device task failed: {e}"));
                }
            }
        }
        if let Some(error) = first_error {
            for conn in conns {
                conn.close().await;
            }
            return Err(error);
        }
        let handles = ids
            .iter()
            .zip(conns)
            .map(|(id, conn)| {
                tokio::spawn(serve(id.clone(), conn, stopped.clone(), answered.clone()))
            })
            .collect();
        Ok(Fleet {
            ids,
            stop,
            handles,
            answered,
        })
    }

    /// The devices' ids.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Closes every device; what they saw.
    pub async fn stop(self) -> (DeviceFigures, Vec<String>) {
        let _ = self.stop.send(true);
        let mut drops = Vec::new();
        for handle in self.handles {
            if let Ok(Some(reason)) = handle.await {
                drops.push(reason);
            }
        }
        let figures = DeviceFigures {
            devices: self.ids.len() as u64,
            commands_answered: self.answered.load(Ordering::Relaxed),
            drops: drops.len() as u64,
        };
        (figures, drops)
    }
}

/// One device until told to stop; `Some(reason)` if the broker dropped it first.
async fn serve(
    id: String,
    mut conn: Conn,
    mut stopped: watch::Receiver<bool>,
    answered: Arc<AtomicU64>,
) -> Option<String> {
    let mut heartbeat = tokio::time::interval(HEARTBEAT_EVERY);
    heartbeat.tick().await;
    let mut answers: u64 = 0;
    loop {
        tokio::select! {
            frame = conn.next_text() => {
                let text = match frame {
                    Ok(text) => text,
                    Err(WireError::Unexpected(_)) => continue,
                    Err(e) => return Some(format!("bench device {id}: {e}")),
                };
                let Ok(inbound) = Inbound::parse(text.as_str()) else { continue };
                if inbound.kind == "command" {
                    answers += 1;
                    let request_id = format!("{id}-r{answers}");
                    let reply = wire::command_results(&id, &inbound, &request_id);
                    if let Err(e) = conn.send(reply).await {
                        return Some(format!("bench device {id}: {e}"));
                    }
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ = heartbeat.tick() => {
                if let Err(e) = conn.send(wire::heartbeat(&id, "device")).await {
                    return Some(format!("bench device {id}: {e}"));
                }
            }
            _ = stopped.changed() => {
                conn.close().await;
                return None;
            }
        }
    }
}
