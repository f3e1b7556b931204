//! A service's run loop inside a test, whose end is checked.
//!
//! A service that returns an error, panics, or ends before the test stopped it fails the
//! test: [`Service::stop`] panics with what happened, [`Service::try_stop`] returns it, and a
//! service dropped after it died (the test never stopped it) panics on drop. The error is
//! also printed the moment the run loop returns it, so a test that then times out on
//! something else shows the cause in its output.

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use anyhow::anyhow;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinHandle};

/// How long a stopped service may take to drain: above the services' default shutdown grace
/// (10 s), so a service that drains as designed is never cut off, and one that hangs is
/// reported instead of hanging the test.
pub const STOP_WAIT: Duration = Duration::from_secs(30);

/// The shutdown signal handed to a run loop: it completes when the test stops the service.
pub type Shutdown = BoxFuture<'static, ()>;

/// A service running in a task of the test's runtime.
#[must_use = "a service dropped while running is aborted and its outcome never checked"]
pub struct Service {
    name: String,
    stop: Option<oneshot::Sender<()>>,
    /// `None` once the outcome has been taken (stopped, killed or dropped).
    handle: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Service {
    /// Spawns `run` (a service's run-until-shutdown loop) with the shutdown signal.
    pub fn spawn<F, Fut, E>(name: impl Into<String>, run: F) -> Service
    where
        F: FnOnce(Shutdown) -> Fut,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<anyhow::Error>,
    {
        let name = name.into();
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown: Shutdown = Box::pin(async move {
            let _ = stopped.await;
        });
        let running = run(shutdown);
        let label = name.clone();
        let handle = tokio::spawn(async move {
            let outcome = running.await.map_err(Into::into);
            if let Err(e) = &outcome {
                eprintln!("aip-testkit: {label} failed: {e:#}");
            }
            outcome
        });
        Service {
            name,
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the run loop has ended. Before [`Service::stop`], that is a failure.
    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops it as SIGTERM would and waits for the drain; panics if it failed, panicked,
    /// ended before being stopped, or did not stop within [`STOP_WAIT`].
    pub async fn stop(self) {
        if let Err(e) = self.try_stop().await {
            panic!("{e:#}");
        }
    }

    /// Like [`Service::stop`], but returns the failure instead of panicking.
    pub async fn try_stop(mut self) -> anyhow::Result<()> {
        let Some(mut handle) = self.handle.take() else {
            return Ok(());
        };
        let ended_by_itself = handle.is_finished();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let joined = match tokio::time::timeout(STOP_WAIT, &mut handle).await {
            Ok(joined) => joined,
            Err(_) => {
                handle.abort();
                return Err(anyhow!("{} did not stop within {STOP_WAIT:?}", self.name));
            }
        };
        outcome(&self.name, joined, ended_by_itself)
    }

    /// Ends it abruptly (its task is aborted: no goodbye to anyone), like `kill -9`; panics
    /// if it had already died.
    pub fn kill(mut self) {
        if let Some(handle) = self.handle.take()
            && let Err(e) = died(&self.name, handle)
        {
            panic!("{e:#}");
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        let dead = died(&self.name, handle);
        if let Err(e) = dead
            && !std::thread::panicking()
        {
            panic!("{e:#} (and the test never stopped it)");
        }
    }
}

/// Aborts `handle` if it still runs; if it had ended, that was a death: the error says how.
fn died(name: &str, handle: JoinHandle<anyhow::Result<()>>) -> anyhow::Result<()> {
    if !handle.is_finished() {
        handle.abort();
        return Ok(());
    }
    // Finished, so the join is ready; `unconstrained` keeps tokio's task budget from
    // deferring it.
    match tokio::task::unconstrained(handle).now_or_never() {
        Some(joined) => outcome(name, joined, true),
        None => Err(anyhow!("{name} ended by itself during the test")),
    }
}

/// The verdict on a run loop's end.
fn outcome(
    name: &str,
    joined: Result<anyhow::Result<()>, JoinError>,
    ended_by_itself: bool,
) -> anyhow::Result<()> {
    match joined {
        Ok(Ok(())) if ended_by_itself => Err(anyhow!(
            "{name} ended by itself during the test, before it was stopped"
        )),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.context(format!("{name} failed"))),
        Err(e) if e.is_panic() => Err(anyhow!(
            "{name} panicked: {}",
            panic_message(e.into_panic())
        )),
        Err(e) => Err(anyhow!("{name} was cancelled: {e}")),
    }
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(text) => *text,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "(a non-text panic)".to_owned(), |s| (*s).to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::wait::wait_until;

    /// A run loop that does what real ones do: serves until told to stop.
    async fn serves_until(shutdown: Shutdown) -> Result<(), std::io::Error> {
        shutdown.await;
        Ok(())
    }

    /// Waits until `service`'s run loop has ended by itself.
    async fn until_dead(service: &Service) {
        wait_until("the service to die", || async { service.is_finished() }).await;
    }

    #[tokio::test]
    async fn a_service_that_stops_when_asked_passes() {
        let service = Service::spawn("well-behaved", serves_until);
        service.try_stop().await.expect("a clean stop");
    }

    #[tokio::test]
    async fn an_error_from_the_run_loop_fails_the_stop() {
        let service = Service::spawn("failing", |shutdown| async move {
            shutdown.await;
            Err(std::io::Error::other("the listener broke"))
        });
        let error = service.try_stop().await.expect_err("the error is reported");
        let text = format!("{error:#}");
        assert!(text.contains("failing failed"), "{text}");
        assert!(text.contains("the listener broke"), "{text}");
    }

    #[tokio::test]
    #[should_panic(expected = "the listener broke")]
    async fn stop_panics_with_the_services_error() {
        let service = Service::spawn("failing", |shutdown| async move {
            shutdown.await;
            Err(std::io::Error::other("the listener broke"))
        });
        service.stop().await;
    }

    #[tokio::test]
    async fn a_panic_in_the_run_loop_fails_the_stop() {
        let service = Service::spawn("panicking", |shutdown| async move {
            shutdown.await;
            if true {
                panic!("an invariant broke");
            }
            Ok::<(), std::io::Error>(())
        });
        let error = service.try_stop().await.expect_err("the panic is reported");
        assert_eq!(error.to_string(), "panicking panicked: an invariant broke");
    }

    #[tokio::test]
    async fn a_service_that_dies_during_the_test_fails_the_stop() {
        let service = Service::spawn("short-lived", |_shutdown| async {
            Ok::<(), std::io::Error>(())
        });
        until_dead(&service).await;
        let error = service.try_stop().await.expect_err("the death is reported");
        assert!(
            error
                .to_string()
                .contains("ended by itself during the test"),
            "{error}"
        );
    }

    #[tokio::test]
    #[should_panic(expected = "dying failed")]
    async fn a_dead_service_never_stopped_fails_the_test_on_drop() {
        let service = Service::spawn("dying", |_shutdown| async {
            Err::<(), _>(std::io::Error::other("gone"))
        });
        until_dead(&service).await;
        drop(service);
    }

    #[tokio::test]
    #[should_panic(expected = "crashed failed")]
    async fn killing_a_dead_service_fails_the_test() {
        let service = Service::spawn("crashed", |_shutdown| async {
            Err::<(), _>(std::io::Error::other("gone"))
        });
        until_dead(&service).await;
        service.kill();
    }

    #[tokio::test]
    async fn a_running_service_can_be_killed_or_dropped() {
        Service::spawn("killed", serves_until).kill();
        drop(Service::spawn("dropped", serves_until));
    }
}
