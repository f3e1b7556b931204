//! The registry's PostgreSQL pool reads agents by key however much the table grew after a
//! statement was planned.
//!
//! PostgreSQL may keep one generic plan per prepared statement, made for the table as it was
//! when the plan was made. The agents table of a new deployment grows from empty by
//! thousands a minute, faster than autovacuum refreshes its statistics; a plan made on the
//! empty table reads it whole, row by row, for every registration (measured: 1.2 ms per
//! statement at 10,000 agents). The registry's pool ([`Planner::KeyedReads`]) must keep such a
//! plan on the primary key. The test forces the generic plan and keeps autovacuum away, so
//! what it sees does not depend on when PostgreSQL would have chosen it.

use aip_runtime::ServiceSettings;
use aip_store::testing::TestDatabase;
use aip_store::{Database, Planner, PoolOptions};

/// The plan of a statement locking agents by id, prepared while the table held one row and
/// explained after it grew to 20,000.
async fn plan_after_growth(options: &PoolOptions) -> String {
    let test_db = TestDatabase::postgres()
        .await
        .expect("PostgreSQL must be running (DATABASE_URL)");
    let db = Database::connect_with(test_db.url(), options)
        .await
        .expect("connect");
    db.migrate().await.expect("migrate");
    let Database::Postgres(pool) = &db else {
        unreachable!("a PostgreSQL URL opens a PostgreSQL pool")
    };
    let mut conn = pool.acquire().await.expect("a connection");
    for statement in [
        "ALTER TABLE agents SET (autovacuum_enabled = off)",
        "SET plan_cache_mode = force_generic_plan",
        "INSERT INTO agents (agent_id, client_type, platform, status, principal, gateway_id, \
             connection_id, connected_at, last_seen) \
         VALUES ('first', 'device', 'linux', 'available', 'p', 'g', 'c', now(), now())",
        "PREPARE holders(text[]) AS SELECT agent_id, status FROM agents \
         WHERE agent_id = ANY($1) ORDER BY agent_id FOR UPDATE",
        "EXECUTE holders('{first}')",
        "INSERT INTO agents (agent_id, client_type, platform, status, principal, gateway_id, \
             connection_id, connected_at, last_seen) \
         SELECT 'agent-' || i, 'device', 'linux', 'offline', 'p', 'g', 'c', now(), now() \
         FROM generate_series(1, 20000) AS i",
    ] {
        sqlx::query(statement)
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let lines: Vec<(String,)> = sqlx::query_as("EXPLAIN EXECUTE holders('{agent-5}')")
        .fetch_all(&mut *conn)
        .await
        .expect("explain");
    drop(conn);
    db.close().await;
    test_db.cleanup().await;
    lines
        .into_iter()
        .map(|(line,)| line)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn a_plan_made_on_a_small_agents_table_reads_by_key_once_it_grew() {
    let options = aip_registry::Settings::default().pool_options();
    assert_eq!(options.planner, Planner::KeyedReads);
    let plan = plan_after_growth(&options).await;
    assert!(
        plan.contains("on agents_pkey") && !plan.contains("Seq Scan"),
        "the registry's pool scans the grown table:\n{plan}"
    );
}

/// The control: with PostgreSQL's defaults the same plan reads all 20,001 rows, so the test
/// above sees the registry's setting at work and not a plan PostgreSQL would have made anyway.
#[tokio::test]
async fn with_the_defaults_the_same_plan_scans_the_whole_table() {
    let plan = plan_after_growth(&PoolOptions::default()).await;
    assert!(
        plan.contains("Seq Scan on agents"),
        "expected PostgreSQL's default generic plan to scan:\n{plan}"
    );
}
