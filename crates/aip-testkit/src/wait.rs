//! Waiting in tests: every wait has a deadline and, when it passes, fails the test naming
//! what it waited for. A test never sleeps for a fixed time to let something happen, and
//! never awaits a stream, channel or task that might stay silent forever.

use std::future::IntoFuture;
use std::time::Duration;

use anyhow::bail;

/// How long a test waits for something that should happen: far above what anything takes
/// on a loaded 2-core machine, so reaching it means the thing will not happen.
pub const WAIT: Duration = Duration::from_secs(15);

/// Between two checks of a polled condition: often enough that a test does not wait long
/// after the condition holds, rarely enough not to load the services under test.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// `future`'s output, or a panic naming `what` once `limit` has passed.
pub async fn within<F: IntoFuture>(limit: Duration, what: &str, future: F) -> F::Output {
    match tokio::time::timeout(limit, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Waits until `check` returns `Some`, polling, at most [`WAIT`].
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_within(WAIT, what, check).await
}

/// Waits until `check` returns `Some`, polling, at most `limit`.
pub async fn eventually_within<T, F, Fut>(
    limit: Duration,
    what: &str,
    mut check: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Waits until `check` holds, polling; panics naming `what` after [`WAIT`].
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually(what, || {
        let checked = check();
        async move { checked.await.then_some(()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn within_returns_what_arrives_in_time() {
        let value = within(WAIT, "a ready value", async { 7 }).await;
        assert_eq!(value, 7);
    }

    #[tokio::test]
    #[should_panic(expected = "timed out after 50ms waiting for a silent channel")]
    async fn within_fails_the_test_when_nothing_arrives() {
        let (_keep, silent) = tokio::sync::oneshot::channel::<()>();
        let _ = within(Duration::from_millis(50), "a silent channel", silent).await;
    }

    #[tokio::test]
    async fn eventually_says_what_never_happened() {
        let error = eventually_within(Duration::from_millis(100), "the impossible", || async {
            None::<()>
        })
        .await
        .expect_err("never");
        assert!(
            error.to_string().contains("waiting for the impossible"),
            "{error}"
        );
    }
}
