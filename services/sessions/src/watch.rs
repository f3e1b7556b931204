//! Requests that wait for a task's next events: event streams (SSE) and command waits.
//!
//! The leader wakes a task's waiters when a group commit holds events of that task, so a
//! waiting request reads the database once per change instead of polling it. A standby
//! replica commits nothing: its waiters, and a leader's should a wake-up be missed, read again
//! after a fallback interval. How many requests wait at once is bounded
//! (`sessions.max_event_watchers`); one more is refused with RATE_LIMITED.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_runtime::api_error::ApiError;
use proto_schemas::ErrorCode;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// The waiters of every task, shared by the REST handlers and the leader's applier.
#[derive(Debug, Clone)]
pub struct EventWatch {
    tasks: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
    permits: Arc<Semaphore>,
    max: usize,
}

/// One waiting request's hold on a task; dropping it ends the wait.
#[derive(Debug)]
pub struct Watcher {
    task_id: String,
    notify: Arc<Notify>,
    watch: EventWatch,
    _permit: OwnedSemaphorePermit,
}

impl EventWatch {
    /// At most `max` requests wait at once.
    pub fn new(max: usize) -> Self {
        EventWatch {
            tasks: Arc::default(),
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A wait on task `task_id`, or RATE_LIMITED when `max` requests already wait.
    pub fn watch(&self, task_id: &str) -> Result<Watcher, ApiError> {
        let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::RateLimited,
                format!(
                    "{} requests already wait for task events, the limit \
                     (sessions.max_event_watchers); retry later",
                    self.max
                ),
            )
        })?;
        let notify = self
            .lock()
            .entry(task_id.to_owned())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        Ok(Watcher {
            task_id: task_id.to_owned(),
            notify,
            watch: self.clone(),
            _permit: permit,
        })
    }

    /// A group commit wrote events of these tasks: their waiters read again.
    pub fn committed<'a>(&self, task_ids: impl Iterator<Item = &'a str>) {
        let tasks = self.lock();
        if tasks.is_empty() {
            return;
        }
        for id in task_ids {
            if let Some(notify) = tasks.get(id) {
                notify.notify_waiters();
            }
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.max - self.permits.available_permits()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // A panic while holding this lock leaves the map itself intact.
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Watcher {
    /// Runs `read` (a read of the task's events), and if it finds nothing, waits for the
    /// task's next commit (or `fallback`) and reads again, until `read` returns something or
    /// fails. A commit between the start of a read and the wait is not missed: the wake-up is
    /// registered before each read.
    pub async fn next<T, E, F, Fut>(&self, fallback: Duration, mut read: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Option<T>, E>>,
    {
        loop {
            let woken = self.notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if let Some(found) = read().await? {
                return Ok(found);
            }
            let _ = tokio::time::timeout(fallback, woken).await;
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let mut tasks = self.watch.lock();
        // The map's handle and this one: no other request waits on the task.
        if tasks
            .get(&self.task_id)
            .is_some_and(|n| Arc::ptr_eq(n, &self.notify) && Arc::strong_count(n) == 2)
        {
            tasks.remove(&self.task_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn a_commit_wakes_the_waiter_at_once() {
        let watch = EventWatch::new(2);
        let watcher = watch.watch("t1").expect("room");
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = reads.clone();
        let waiting = tokio::spawn(async move {
            watcher
                .next(Duration::from_secs(60), || {
                    let n = counted.fetch_add(1, Ordering::SeqCst);
                    async move { Ok::<_, ()>((n >= 1).then_some(n)) }
                })
                .await
        });
        // The first read has begun, so the wake-up is registered: the commit cannot be missed.
        while reads.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        watch.committed(["other", "t1"].into_iter());
        let found = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken well before the 60 s fallback")
            .expect("no panic");
        assert_eq!(found, Ok(1));
        assert_eq!(watch.waiting(), 0);
        assert!(
            watch.lock().is_empty(),
            "the task's entry is gone with its last waiter"
        );
    }

    #[tokio::test]
    async fn waiters_are_bounded() {
        let watch = EventWatch::new(1);
        let first = watch.watch("t1").expect("room");
        let refused = watch.watch("t2").expect_err("full");
        assert_eq!(refused.code(), ErrorCode::RateLimited);
        drop(first);
        watch.watch("t2").expect("room again");
    }
}
