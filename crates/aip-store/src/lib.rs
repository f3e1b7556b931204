//! # aip-store: the database behind aip's services
//!
//! One [`Database`] handle, PostgreSQL (the distributed mode) or SQLite (the embedded mode,
//! `aip dev`), opened from a URL with [`Database::connect`]. Every service shares the same two
//! migration sets (`migrations/postgres`, `migrations/sqlite` at the workspace root, files
//! named `NNNN_<service>_<what>.sql`), embedded at compile time; each service calls
//! [`Database::migrate`] at start. On PostgreSQL sqlx takes an advisory lock, so replicas
//! starting together apply each migration once; on SQLite a process-wide lock does the same
//! for services sharing one process.
//!
//! Services build their own stores (e.g. the registry's `AgentStore`) on it; this crate
//! knows no table. What differs between the two databases is stated once, in [`sql`]:
//! statements ([`Sql`]) written once with the fragments of [`Backend`] where the dialects
//! differ, run with [`Database::query`], [`Conn::query`] or [`Tx::query`].
//!
//! With the `testing` feature, `testing::TestDatabase` makes a throwaway database per test.

pub mod sql;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;

pub use sql::{AnyValue, Conn, FromAnyRow, List, Query, SQLITE_BEGIN_WRITE, Sql, Timestamp, Tx};

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

/// A connection pool to the service database.
#[derive(Debug, Clone)]
pub enum Database {
    /// PostgreSQL (`postgres://` or `postgresql://` URLs).
    Postgres(PgPool),
    /// SQLite (`sqlite://` URLs), for the embedded mode.
    Sqlite(SqlitePool),
}

/// Which database a [`Database`] talks to: its SQL dialect, whose differences are the
/// fragments in [`sql`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // the variants name their database
pub enum Backend {
    Postgres,
    Sqlite,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "PostgreSQL",
            Backend::Sqlite => "SQLite",
        })
    }
}

/// Pool sizing and timeouts.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Most connections in the pool (SQLite in-memory databases always use one).
    pub max_connections: u32,
    /// How long a query waits for a free connection (and the first connection is given to
    /// come up) before failing.
    pub acquire_timeout: Duration,
    /// How long SQLite waits on a locked database before failing with "database is locked".
    pub sqlite_busy_timeout: Duration,
    /// How PostgreSQL plans the pool's statements (SQLite: no effect).
    pub planner: Planner,
    /// A PostgreSQL connection idle in the pool at least this long is pinged before it is
    /// handed out, and replaced if it does not answer (SQLite: no effect). One in steady use
    /// is not: the ping is a round trip before the statement.
    pub ping_after_idle: Duration,
}

/// How PostgreSQL plans the statements of a pool.
///
/// A statement prepared on a connection is planned for its parameters five times; after that
/// PostgreSQL may keep one generic plan for it, made for the tables as they were then, until
/// their statistics are next refreshed (autovacuum looks once a minute). A table that grows
/// from empty within that minute (a new deployment taking its first thousands of agents) is
/// then read whole, row by row, by a statement that names its rows by key: measured on the
/// registry, a registration batch's two statements took 1.2 ms each at 10,000 agents
/// instead of 0.1 ms, and cost grew with every agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Planner {
    /// PostgreSQL's defaults.
    #[default]
    Default,
    /// No sequential scan where an index applies (`enable_seqscan = off` on every
    /// connection), so a plan made while a table was small still reads by key once it is
    /// large. For a store whose statements all read and write rows by key or by an indexed
    /// column. A statement no index serves still scans, as before.
    KeyedReads,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            sqlite_busy_timeout: Duration::from_secs(10),
            planner: Planner::Default,
            ping_after_idle: PING_AFTER_IDLE,
        }
    }
}

/// Why the database could not be opened or migrated. Every message names the URL with its
/// password masked, and says what to do.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // the fields are named for what they hold
pub enum DatabaseError {
    /// The URL's scheme is none of `postgres://`, `postgresql://`, `sqlite://`.
    #[error(
        "unsupported database URL `{url}`: use postgres://user[:password]@host[:port]/database \
         (or postgresql://) for PostgreSQL, or sqlite://path/to/file.db for SQLite"
    )]
    UnsupportedUrl {
        /// The URL, password masked.
        url: String,
    },
    /// The URL could not be parsed.
    #[error("invalid database URL `{url}`: {source}")]
    InvalidUrl {
        /// The URL, password masked.
        url: String,
        source: sqlx::Error,
    },
    /// The directory of an SQLite file could not be created.
    #[error("cannot create directory {path} for the SQLite database: {source}")]
    CreateDir {
        path: String,
        source: std::io::Error,
    },
    /// Connecting failed.
    #[error("cannot connect to {backend} at `{url}`: {source}. {hint}")]
    Connect {
        backend: Backend,
        /// The URL, password masked.
        url: String,
        /// What to check.
        hint: String,
        source: sqlx::Error,
    },
    /// Applying migrations failed.
    #[error(
        "migrating the {backend} database failed: {source}. If a migration was edited after it was \
         applied, restore it and add a new one instead"
    )]
    Migrate {
        backend: Backend,
        source: MigrateError,
    },
}

/// Serialises SQLite migrations within the process (services of `aip dev` share one file and
/// start together; SQLite has no migration lock of its own).
static SQLITE_MIGRATION_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The default of [`PoolOptions::ping_after_idle`]: a connection that died while idle (a
/// server restart) is replaced instead of failing a statement.
pub const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

impl Database {
    /// Opens a pool with default [`PoolOptions`]. See [`Database::connect_with`].
    pub async fn connect(url: &str) -> Result<Self, DatabaseError> {
        Self::connect_with(url, &PoolOptions::default()).await
    }

    /// Opens a pool and checks that one connection can be made.
    ///
    /// - `postgres://…` / `postgresql://…`: the database must exist.
    /// - `sqlite://path` (relative to the working directory; `sqlite:///abs/path` for absolute
    ///   paths; `sqlite::memory:` for a private in-memory database): the file and its parent
    ///   directory are created when missing; WAL journal, `synchronous=NORMAL`, foreign keys on
    ///   and a busy timeout are set on every connection, and the log of a file is checkpointed
    ///   in the background (`checkpoint_wal`; must then be called within a Tokio runtime).
    pub async fn connect_with(url: &str, options: &PoolOptions) -> Result<Self, DatabaseError> {
        let masked = mask_url(url);
        let scheme = url
            .split_once(':')
            .map(|(s, _)| s.to_ascii_lowercase())
            .unwrap_or_default();
        match scheme.as_str() {
            "postgres" | "postgresql" => {
                let connect = PgConnectOptions::from_str(url)
                    .map_err(|source| DatabaseError::InvalidUrl {
                        url: masked.clone(),
                        source,
                    })?
                    .application_name("aip");
                let planner = options.planner;
                let ping_after_idle = options.ping_after_idle;
                let pool = PgPoolOptions::new()
                    .max_connections(options.max_connections)
                    // A `SET` rather than a startup option: connection poolers refuse
                    // startup options they do not know.
                    .after_connect(move |conn, _| {
                        Box::pin(async move {
                            if planner == Planner::KeyedReads {
                                sqlx::Executor::execute(&mut *conn, "SET enable_seqscan = off")
                                    .await?;
                            }
                            Ok(())
                        })
                    })
                    .acquire_timeout(options.acquire_timeout)
                    // sqlx's own check pings every connection it hands out: a round trip
                    // before every statement. Only a connection idle for a while is checked
                    // (one in steady use has just answered); a statement that meets a
                    // connection that died meanwhile fails as unavailable, like one the
                    // server drops mid-statement, and the connection is not used again.
                    .test_before_acquire(false)
                    .before_acquire(move |conn, meta| {
                        Box::pin(async move {
                            if meta.idle_for >= ping_after_idle {
                                sqlx::Connection::ping(conn).await?;
                            }
                            Ok(true)
                        })
                    })
                    .after_release(|conn, _| {
                        // A connection's buffers grow to the largest statement or row it
                        // carried (a 90 MiB result) and keep that size; a pooled connection
                        // goes back to the default size when it is returned.
                        sqlx::Connection::shrink_buffers(conn);
                        Box::pin(async { Ok(true) })
                    })
                    .connect_with(connect)
                    .await
                    .map_err(|source| DatabaseError::Connect {
                        backend: Backend::Postgres,
                        hint: postgres_hint(&source, url),
                        url: masked.clone(),
                        source,
                    })?;
                tracing::debug!(url = %masked, "connected to PostgreSQL");
                Ok(Database::Postgres(pool))
            }
            "sqlite" => {
                let connect = SqliteConnectOptions::from_str(url)
                    .map_err(|source| DatabaseError::InvalidUrl {
                        url: masked.clone(),
                        source,
                    })?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .foreign_keys(true)
                    .busy_timeout(options.sqlite_busy_timeout)
                    .pragma("wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES.to_string());
                let in_memory = is_sqlite_memory(url);
                if !in_memory {
                    create_parent_dir(connect.get_filename())?;
                }
                let pool = SqlitePoolOptions::new()
                    .max_connections(if in_memory {
                        1
                    } else {
                        options.max_connections
                    })
                    .acquire_timeout(options.acquire_timeout)
                    // A connection to a file in this process does not die: no ping (a hop to
                    // the connection's thread) before every statement.
                    .test_before_acquire(false)
                    // An in-memory database lives as long as its connection.
                    .idle_timeout(if in_memory {
                        None
                    } else {
                        Some(Duration::from_secs(600))
                    })
                    .max_lifetime(if in_memory {
                        None
                    } else {
                        Some(Duration::from_secs(1800))
                    })
                    .connect_with(connect)
                    .await
                    .map_err(|source| DatabaseError::Connect {
                        backend: Backend::Sqlite,
                        hint: "Check that the path is writable and not used by another program."
                            .to_owned(),
                        url: masked.clone(),
                        source,
                    })?;
                tracing::debug!(url = %masked, "opened SQLite database");
                if !in_memory {
                    tokio::spawn(checkpoint_wal(pool.clone()));
                }
                Ok(Database::Sqlite(pool))
            }
            _ => Err(DatabaseError::UnsupportedUrl { url: masked }),
        }
    }

    /// Its dialect, for the statements written per database ([`Sql`]).
    pub fn backend(&self) -> Backend {
        match self {
            Database::Postgres(_) => Backend::Postgres,
            Database::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// Applies every embedded migration not yet applied. Migrations applied by a newer build
    /// (unknown to this one) are tolerated, so services can be upgraded one at a time.
    pub async fn migrate(&self) -> Result<(), DatabaseError> {
        let mut migrator: Migrator = match self {
            Database::Postgres(_) => sqlx::migrate!("../../migrations/postgres"),
            Database::Sqlite(_) => sqlx::migrate!("../../migrations/sqlite"),
        };
        migrator.set_ignore_missing(true);
        let result = match self {
            Database::Postgres(pool) => migrator.run(pool).await,
            Database::Sqlite(pool) => {
                let _guard = SQLITE_MIGRATION_LOCK.lock().await;
                migrator.run(pool).await
            }
        };
        result.map_err(|source| DatabaseError::Migrate {
            backend: self.backend(),
            source,
        })
    }

    /// Checks that the database answers (`SELECT 1`), for readiness probes.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        match self {
            Database::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
            Database::Sqlite(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
        }
    }

    /// Closes the pool, waiting for connections in use to be returned.
    pub async fn close(&self) {
        match self {
            Database::Postgres(pool) => pool.close().await,
            Database::Sqlite(pool) => pool.close().await,
        }
    }
}

/// How often [`checkpoint_wal`] copies the SQLite write-ahead log into the database file
/// while it is written: often, so each copy is short.
const WAL_CHECKPOINT_INTERVAL: Duration = Duration::from_millis(50);

/// How often [`checkpoint_wal`] looks while nothing is written.
const WAL_IDLE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The log size (pages of 4 KiB) at which a commit checkpoints by itself, SQLite's own
/// mechanism (its default is 1,000 pages): a backstop that bounds the log when
/// [`checkpoint_wal`] cannot keep it short.
const WAL_AUTOCHECKPOINT_PAGES: u32 = 16_384;

/// Checkpoints the write-ahead log of a file-backed SQLite pool until the pool is closed.
///
/// By default the commit that takes the log past 1,000 pages copies them into the database
/// file and syncs both, and every write waits behind it: under load one commit in about a
/// hundred did, and `aip dev` spent a third of its commit time there. Here a pooled
/// connection, on its own thread, checkpoints every [`WAL_CHECKPOINT_INTERVAL`] in `PASSIVE`
/// mode, which waits for no writer or reader, so commits only append to the log. Under
/// steady writes the log is never wholly copied at a moment no commit follows, so it is not
/// restarted and grows until a commit reaches [`WAL_AUTOCHECKPOINT_PAGES`] (64 MiB); that
/// checkpoint finds the pages copied already.
async fn checkpoint_wal(pool: SqlitePool) {
    let mut failing = false;
    let mut interval = WAL_IDLE_CHECK_INTERVAL;
    let mut last_log = 0;
    loop {
        tokio::time::sleep(interval).await;
        if pool.is_closed() {
            return;
        }
        match sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(&pool)
            .await
        {
            Ok((_busy, log, _copied)) => {
                failing = false;
                // Log frames written since the last look: keep up; none: look less often.
                interval = if log == last_log {
                    WAL_IDLE_CHECK_INTERVAL
                } else {
                    WAL_CHECKPOINT_INTERVAL
                };
                last_log = log;
            }
            Err(_) if pool.is_closed() => return,
            Err(e) => {
                if !failing {
                    tracing::warn!("checkpointing the SQLite write-ahead log failed: {e}");
                }
                failing = true;
                interval = WAL_IDLE_CHECK_INTERVAL;
            }
        }
    }
}

fn is_sqlite_memory(url: &str) -> bool {
    url.contains(":memory:") || url.contains("mode=memory")
}

fn create_parent_dir(file: &Path) -> Result<(), DatabaseError> {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.exists() => std::fs::create_dir_all(dir)
            .map_err(|source| DatabaseError::CreateDir {
                path: dir.display().to_string(),
                source,
            }),
        _ => Ok(()),
    }
}

/// What to check after a failed PostgreSQL connection.
fn postgres_hint(error: &sqlx::Error, url: &str) -> String {
    let code = match error {
        sqlx::Error::Database(e) => e.code().map(|c| c.into_owned()),
        _ => None,
    };
    match code.as_deref() {
        Some("3D000") => {
            let db = database_name(url).unwrap_or("<database>");
            format!(
                "The database does not exist: create it (e.g. `createdb {db}` or `CREATE DATABASE \"{db}\"`)."
            )
        }
        Some("28P01") | Some("28000") => {
            "The server refused the login: check the user and password in the URL and pg_hba.conf."
                .to_owned()
        }
        _ => match error {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => {
                "Is PostgreSQL running and listening on that host and port?".to_owned()
            }
            _ => "Check the URL and that the server accepts connections.".to_owned(),
        },
    }
}

/// The database name of a `postgres://…/name?…` URL.
fn database_name(url: &str) -> Option<&str> {
    let after_scheme = url.split_once("://")?.1;
    let path = after_scheme.split_once('/')?.1;
    let name = path.split(['?', '#']).next()?;
    (!name.is_empty()).then_some(name)
}

/// The URL with its password (if any) replaced by `***`, for logs and error messages.
///
/// ```
/// assert_eq!(aip_store::mask_url("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
/// assert_eq!(aip_store::mask_url("postgres://u@h/db"), "postgres://u@h/db");
/// assert_eq!(aip_store::mask_url("sqlite://data/aip.db"), "sqlite://data/aip.db");
/// ```
pub fn mask_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let (userinfo, host) = authority.split_at(at);
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{host}{tail}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_passwords_only() {
        assert_eq!(
            mask_url("postgresql://a:b:c@h/db?x=1"),
            "postgresql://a:***@h/db?x=1"
        );
        assert_eq!(mask_url("postgres://h/db"), "postgres://h/db");
        assert_eq!(mask_url("not a url"), "not a url");
        assert_eq!(
            mask_url("postgres://u:p@h/db/x@y"),
            "postgres://u:***@h/db/x@y"
        );
    }

    #[test]
    fn database_names() {
        assert_eq!(
            database_name("postgres://u@h:5432/aip?sslmode=disable"),
            Some("aip")
        );
        assert_eq!(database_name("postgres://u@h:5432"), None);
    }

    #[tokio::test]
    async fn unsupported_urls_say_what_is_accepted() {
        let err = Database::connect("mysql://root:pw@localhost/db")
            .await
            .expect_err("mysql is not supported");
        let text = err.to_string();
        assert!(text.contains("mysql://root:***@localhost/db"), "{text}");
        assert!(text.contains("sqlite://"), "{text}");
    }

    #[tokio::test]
    async fn sqlite_creates_the_file_and_its_directory() {
        let dir = std::env::temp_dir().join(format!("aip-store-{}", uuid::Uuid::new_v4().simple()));
        let file = dir.join("nested").join("aip.db");
        let db = Database::connect(&format!("sqlite://{}", file.display()))
            .await
            .expect("sqlite opens");
        db.migrate().await.expect("migrations apply");
        db.migrate().await.expect("migrating twice is harmless");
        db.ping().await.expect("ping");
        assert!(file.exists());
        db.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_sqlite_log_is_copied_into_the_database_file_in_the_background() {
        let dir = std::env::temp_dir().join(format!("aip-store-{}", uuid::Uuid::new_v4().simple()));
        let file = dir.join("aip.db");
        let db = Database::connect(&format!("sqlite://{}", file.display()))
            .await
            .expect("sqlite opens");
        let Database::Sqlite(pool) = &db else {
            panic!("sqlite expected")
        };
        let size = || std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
        let before = size();
        sqlx::query("CREATE TABLE t (x BLOB)")
            .execute(pool)
            .await
            .expect("create");
        // About 200 pages: far below any log size at which a commit checkpoints by itself,
        // so only the background checkpoint moves them into the file.
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200) \
             INSERT INTO t SELECT randomblob(4000) FROM n",
        )
        .execute(pool)
        .await
        .expect("insert");
        let written = 200 * 4000;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while size() < before + written && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            size() >= before + written,
            "the database file is {} bytes, {before} before {written} bytes were committed",
            size()
        );
        db.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn sqlite_in_memory_works() {
        let db = Database::connect("sqlite::memory:")
            .await
            .expect("in-memory sqlite");
        db.migrate().await.expect("migrations apply");
        let Database::Sqlite(pool) = &db else {
            panic!("sqlite expected")
        };
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM agents")
            .fetch_one(pool)
            .await
            .expect("agents exists");
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn postgres_connection_errors_mask_the_password_and_give_a_hint() {
        // Port 1 on loopback: nothing listens there.
        let err = Database::connect_with(
            "postgres://user:hunter2@127.0.0.1:1/db",
            &PoolOptions {
                acquire_timeout: Duration::from_secs(2),
                ..PoolOptions::default()
            },
        )
        .await
        .expect_err("nothing listens on port 1");
        let text = err.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("user:***@127.0.0.1:1/db"), "{text}");
        assert!(text.contains("Is PostgreSQL running"), "{text}");
    }
}
