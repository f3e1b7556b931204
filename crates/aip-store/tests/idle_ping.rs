//! Pooled PostgreSQL connections are checked before use only after being idle for
//! [`PoolOptions::ping_after_idle`]: a connection that died while idle is replaced, and one in
//! steady use costs no round trip before its statement.
//!
//! Needs `DATABASE_URL` (PostgreSQL).

use std::time::Duration;

use aip_store::testing::TestDatabase;
use aip_store::{Database, PoolOptions};

/// A pool of one connection to `test_db`, pinged after `ping_after_idle`.
async fn pool_of_one(test_db: &TestDatabase, ping_after_idle: Duration) -> sqlx::PgPool {
    let options = PoolOptions {
        max_connections: 1,
        ping_after_idle,
        ..PoolOptions::default()
    };
    match Database::connect_with(test_db.url(), &options)
        .await
        .expect("connect")
    {
        Database::Postgres(pool) => pool,
        Database::Sqlite(_) => unreachable!("a PostgreSQL URL"),
    }
}

/// The server process of the pool's one connection, ended from another connection while the
/// connection is idle in the pool.
async fn kill_pooled_connection(pool: &sqlx::PgPool, other: &sqlx::PgPool) -> i32 {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("the pooled connection answers");
    // sqlx pings a returned connection before it is idle again: wait for that, so the
    // connection dies while idle, not during that ping.
    tokio::time::timeout(PATIENCE, async {
        while pool.num_idle() < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the connection goes back to the pool");
    // With a timeout, PostgreSQL waits until the process has exited.
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, $2)")
        .bind(pid)
        .bind(PATIENCE.as_millis() as i64)
        .fetch_one(other)
        .await
        .expect("terminate");
    assert!(ended, "backend {pid} terminated");
    pid
}

/// How long the test waits for the pool and the server.
const PATIENCE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_connection_that_died_while_idle_is_replaced_before_use() {
    let test_db = TestDatabase::postgres()
        .await
        .expect("PostgreSQL must be running (DATABASE_URL)");
    let other = pool_of_one(&test_db, Duration::ZERO).await;
    // Every connection counts as idle long enough: each is pinged before use.
    let pool = pool_of_one(&test_db, Duration::ZERO).await;
    let dead = kill_pooled_connection(&pool, &other).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("the dead connection is replaced, and the statement runs on a new one");
    assert_ne!(pid, dead);
    pool.close().await;
    other.close().await;
    test_db.cleanup().await;
}

#[tokio::test]
async fn a_connection_in_steady_use_is_not_pinged_first() {
    let test_db = TestDatabase::postgres()
        .await
        .expect("PostgreSQL must be running (DATABASE_URL)");
    let other = pool_of_one(&test_db, Duration::ZERO).await;
    // Nothing is idle this long within the test: no connection is pinged, so the statement
    // meets the dead one and fails as the server dropping it mid-statement would.
    let pool = pool_of_one(&test_db, Duration::from_secs(3600)).await;
    kill_pooled_connection(&pool, &other).await;
    let failed = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await;
    assert!(
        failed.is_err(),
        "no ping: the statement went to the dead connection"
    );
    let pid: Result<i32, _> = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await;
    assert!(
        pid.is_ok(),
        "the broken connection is not used again: {pid:?}"
    );
    pool.close().await;
    other.close().await;
    test_db.cleanup().await;
}
