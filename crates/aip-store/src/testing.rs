//! Throwaway databases for integration tests (feature `testing`).
//!
//! [`TestDatabase::postgres`] creates a database with a random name on the server named by
//! the environment variable `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); [`TestDatabase::sqlite`] a temporary
//! file. Either is removed by [`TestDatabase::cleanup`] or, failing that, when the value is
//! dropped, so tests sharing one server never see each other's tables.

use std::path::PathBuf;

use crate::{Database, mask_url};

/// Where test databases are created unless `DATABASE_URL` says otherwise.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A database that exists for one test.
#[derive(Debug)]
pub struct TestDatabase {
    url: String,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Postgres { admin_url: String, name: String },
    Sqlite { dir: PathBuf },
    Cleaned,
}

/// Why a test database could not be made.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // the fields are named for what they hold
pub enum TestDatabaseError {
    /// The server named by `DATABASE_URL` did not let us create a database.
    #[error(
        "cannot create test database `{name}` on `{admin_url}`: {source}. Tests need PostgreSQL with \
         a user allowed to create databases: start it (scripts/ensure-services.sh) or set DATABASE_URL"
    )]
    CreatePostgres {
        /// The admin URL, password masked.
        admin_url: String,
        /// The database we tried to create.
        name: String,
        source: sqlx::Error,
    },
    /// The temporary directory for an SQLite file could not be made.
    #[error("cannot create a temporary directory for a test SQLite database: {0}")]
    CreateSqlite(std::io::Error),
}

impl TestDatabase {
    /// Creates an empty PostgreSQL database with a random name (`aip_test_<uuid>`).
    pub async fn postgres() -> Result<Self, TestDatabaseError> {
        let admin_url =
            std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned());
        let name = format!("aip_test_{}", uuid::Uuid::new_v4().simple());
        let fail = |source| TestDatabaseError::CreatePostgres {
            admin_url: mask_url(&admin_url),
            name: name.clone(),
            source,
        };
        let mut conn = connect_admin(&admin_url).await.map_err(fail)?;
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await
            .map_err(fail)?;
        let _ = sqlx::Connection::close(conn).await;
        let url = with_database(&admin_url, &name);
        Ok(TestDatabase {
            url,
            kind: Kind::Postgres { admin_url, name },
        })
    }

    /// Creates a path for an SQLite database in a fresh temporary directory (the file itself
    /// is created by [`Database::connect`]).
    pub fn sqlite() -> Result<Self, TestDatabaseError> {
        let dir = std::env::temp_dir().join(format!("aip-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).map_err(TestDatabaseError::CreateSqlite)?;
        let url = format!("sqlite://{}", dir.join("aip.db").display());
        Ok(TestDatabase {
            url,
            kind: Kind::Sqlite { dir },
        })
    }

    /// The URL, for a service under test to connect to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connects to it (and applies nothing: call [`Database::migrate`] if needed).
    pub async fn connect(&self) -> Result<Database, crate::DatabaseError> {
        Database::connect(&self.url).await
    }

    /// Removes the database now (connections still open to it are terminated).
    pub async fn cleanup(mut self) {
        let kind = std::mem::replace(&mut self.kind, Kind::Cleaned);
        remove(kind).await;
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let kind = std::mem::replace(&mut self.kind, Kind::Cleaned);
        if matches!(kind, Kind::Cleaned) {
            return;
        }
        // Drop cannot await, and may run inside a runtime: use a thread with its own runtime.
        let handle =
            std::thread::spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(remove(kind)),
                    Err(e) => eprintln!(
                        "TestDatabase: cannot start a runtime to drop the test database: {e}"
                    ),
                }
            });
        let _ = handle.join();
    }
}

async fn remove(kind: Kind) {
    match kind {
        Kind::Postgres { admin_url, name } => {
            let result = async {
                let mut conn = connect_admin(&admin_url).await?;
                sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&mut conn)
                    .await?;
                sqlx::Connection::close(conn).await
            }
            .await;
            if let Err(e) = result {
                eprintln!(
                    "TestDatabase: could not drop test database `{name}` on `{}`: {e}",
                    mask_url(&admin_url)
                );
            }
        }
        Kind::Sqlite { dir } => {
            let _ = std::fs::remove_dir_all(dir);
        }
        Kind::Cleaned => {}
    }
}

async fn connect_admin(url: &str) -> Result<sqlx::PgConnection, sqlx::Error> {
    use sqlx::Connection;
    sqlx::PgConnection::connect(url).await
}

/// `url` with its database (path) replaced by `name`, keeping any query string.
fn with_database(url: &str, name: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.find('?').map(|i| &tail[i..]).unwrap_or("");
    format!("{scheme}://{authority}/{name}{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_in_urls() {
        assert_eq!(
            with_database("postgres://u@h:5432/postgres", "x"),
            "postgres://u@h:5432/x"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(
            with_database("postgres://u@h/db?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
    }

    /// A fresh PostgreSQL test database and its name.
    async fn named_test_database() -> (TestDatabase, String) {
        let test_db = TestDatabase::postgres()
            .await
            .expect("PostgreSQL must be running (DATABASE_URL)");
        let name = test_db
            .url()
            .rsplit('/')
            .next()
            .map(str::to_owned)
            .expect("the URL names its database");
        (test_db, name)
    }

    async fn assert_gone(name: &str) {
        let admin = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned());
        let mut conn = connect_admin(&admin).await.expect("admin connection");
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
                .bind(name)
                .fetch_optional(&mut conn)
                .await
                .expect("query");
        assert_eq!(exists, None, "database {name} should be gone");
    }

    #[tokio::test]
    async fn postgres_test_databases_come_and_go() {
        let (test_db, name) = named_test_database().await;
        let db = test_db.connect().await.expect("connect");
        db.migrate().await.expect("migrate");
        db.migrate().await.expect("migrating twice is harmless");
        // Cleanup terminates our own open pool, too.
        test_db.cleanup().await;
        assert_gone(&name).await;
    }

    #[tokio::test]
    async fn dropping_removes_the_database() {
        let (test_db, name) = named_test_database().await;
        drop(test_db);
        assert_gone(&name).await;
    }
}
