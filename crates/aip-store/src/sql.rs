//! Statements written once for PostgreSQL and SQLite.
//!
//! A statement is one [`Sql`]: the same text for both databases when both accept it, or a
//! text per database rendered from one template whose differences are the fragments of
//! [`Backend`] ([`Backend::now`], [`Backend::ago`], [`Backend::in_list`], ...). Placeholders
//! are `$1`, `$2`, ... on both: SQLite reads `$1` as a parameter named "1" and sqlx binds it
//! to the first argument, so no rewriting is needed (a number may be used several times).
//!
//! [`Database::query`], [`Conn::query`] and [`Tx::query`] run a statement where the database
//! handle says, with arguments that encode on both databases ([`Query::bind`]) and rows that
//! decode on both ([`FromAnyRow`]); the typed values whose representation differs are
//! [`Timestamp`] (`timestamptz` / integer milliseconds) and [`List`] (array / JSON array).
//! Code that must differ by more than a fragment (PostgreSQL's multi-row statements over
//! arrays, say) matches on [`Tx`] or [`Conn`] and uses sqlx directly.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgArguments, PgRow, PgTypeInfo, PgValueRef};
use sqlx::sqlite::{
    SqliteArgumentValue, SqliteArguments, SqliteRow, SqliteTypeInfo, SqliteValueRef,
};
use sqlx::{
    Decode, Encode, FromRow, PgConnection, PgPool, Postgres, Sqlite, SqliteConnection, SqlitePool,
    Type,
};

use crate::{Backend, Database};

/// A statement's text for each database.
#[derive(Debug, Clone)]
pub struct Sql {
    postgres: Cow<'static, str>,
    sqlite: Cow<'static, str>,
}

impl Sql {
    /// A statement both databases accept as written.
    pub const fn same(text: &'static str) -> Sql {
        Sql {
            postgres: Cow::Borrowed(text),
            sqlite: Cow::Borrowed(text),
        }
    }

    /// A statement written per database, for a difference in shape that no fragment of
    /// [`Backend`] covers.
    pub const fn each(postgres: &'static str, sqlite: &'static str) -> Sql {
        Sql {
            postgres: Cow::Borrowed(postgres),
            sqlite: Cow::Borrowed(sqlite),
        }
    }

    /// A statement rendered from one template for each database; `template` gets the backend
    /// to ask for its fragments. Rendered once: keep the result (e.g. in a `LazyLock`), so that
    /// every use has the same text and stays in the connections' prepared-statement caches.
    pub fn render(template: impl Fn(Backend) -> String) -> Sql {
        Sql {
            postgres: Cow::Owned(template(Backend::Postgres)),
            sqlite: Cow::Owned(template(Backend::Sqlite)),
        }
    }

    /// The text for `backend`.
    pub fn text(&self, backend: Backend) -> &str {
        match backend {
            Backend::Postgres => &self.postgres,
            Backend::Sqlite => &self.sqlite,
        }
    }
}

/// How SQLite writes the current time in integer milliseconds since the epoch (the way
/// [`Timestamp`] stores times there). `unixepoch('subsec')` is seconds with a millisecond
/// fraction; rounding removes the floating-point error of the multiplication.
const SQLITE_NOW_MS: &str = "CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER)";

/// The SQL fragments that differ between the databases.
impl Backend {
    /// The current time as a [`Timestamp`] column holds it, from the database's clock:
    /// PostgreSQL's `now()` (the start of the transaction, one clock for every replica);
    /// SQLite's clock in milliseconds (the same within one statement).
    pub fn now(self) -> &'static str {
        match self {
            Backend::Postgres => "now()",
            Backend::Sqlite => SQLITE_NOW_MS,
        }
    }

    /// [`Backend::now`] minus the milliseconds bound at `$param` (an `i64`): the oldest time
    /// still within a window.
    pub fn ago(self, param: u32) -> String {
        match self {
            Backend::Postgres => format!("(now() - ${param}::float8 * interval '1 millisecond')"),
            Backend::Sqlite => format!("({SQLITE_NOW_MS} - ${param})"),
        }
    }

    /// `expression` is one of the elements of the [`List`] bound at `$param`.
    pub fn in_list(self, expression: &str, param: u32) -> String {
        match self {
            Backend::Postgres => format!("{expression} = ANY(${param})"),
            Backend::Sqlite => {
                format!("{expression} IN (SELECT value FROM json_each(${param}))")
            }
        }
    }

    /// The elements of the [`List`] bound at `$param` as a table `alias` with one column,
    /// `value`, for a `FROM` clause.
    pub fn list_rows(self, param: u32, alias: &str) -> String {
        match self {
            Backend::Postgres => format!("unnest(${param}) AS {alias}(value)"),
            Backend::Sqlite => format!("json_each(${param}) AS {alias}"),
        }
    }

    /// `column`, a JSON array, holds every element of the JSON array bound at `$param`
    /// (bound as `sqlx::types::Json`). PostgreSQL's `@>` can use a GIN index on the column.
    pub fn json_contains_all(self, column: &str, param: u32) -> String {
        match self {
            Backend::Postgres => format!("{column} @> ${param}"),
            Backend::Sqlite => format!(
                "NOT EXISTS (SELECT 1 FROM json_each(${param}) wanted WHERE NOT EXISTS \
                 (SELECT 1 FROM json_each({column}) held WHERE held.value = wanted.value))"
            ),
        }
    }

    /// The end of a `SELECT` that locks the rows it reads of `table` until the transaction
    /// ends: `FOR UPDATE OF` on PostgreSQL; nothing on SQLite, where a write transaction
    /// ([`Database::begin`]) holds the database's only write lock already.
    pub fn lock_rows(self, table: &str) -> String {
        match self {
            Backend::Postgres => format!(" FOR UPDATE OF {table}"),
            Backend::Sqlite => String::new(),
        }
    }
}

/// A value that encodes on both databases, for [`Query::bind`].
pub trait AnyValue<'t>:
    Encode<'t, Postgres> + Type<Postgres> + Encode<'t, Sqlite> + Type<Sqlite>
{
}

impl<'t, T> AnyValue<'t> for T where
    T: Encode<'t, Postgres> + Type<Postgres> + Encode<'t, Sqlite> + Type<Sqlite>
{
}

/// A row type that decodes from both databases (derive `sqlx::FromRow` with field types
/// both decode: text, integers, `bool`, `sqlx::types::Json`, [`Timestamp`]). Tuples work
/// too; beware `SELECT 1`, an `INT4` on PostgreSQL: read it as `i32`.
pub trait FromAnyRow:
    for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin
{
}

impl<T> FromAnyRow for T where
    T: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin
{
}

/// A connection borrowed for a few statements: a transaction's, or one a service keeps for
/// itself.
#[allow(missing_docs)] // the variants name their database
pub enum Conn<'c> {
    Postgres(&'c mut PgConnection),
    Sqlite(&'c mut SqliteConnection),
}

impl<'c> Conn<'c> {
    /// Its dialect, for code that differs by more than a fragment.
    pub fn backend(&self) -> Backend {
        match self {
            Conn::Postgres(_) => Backend::Postgres,
            Conn::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// `sql` on this connection; add arguments with [`Query::bind`].
    pub fn query(self, sql: &'c Sql) -> Query<'c> {
        match self {
            Conn::Postgres(conn) => Query(On::Postgres(
                Executor::Conn(conn),
                sqlx::query(&sql.postgres),
            )),
            Conn::Sqlite(conn) => Query(On::Sqlite(Executor::Conn(conn), sqlx::query(&sql.sqlite))),
        }
    }

    /// Begins a write transaction on this connection (see [`Database::begin`]).
    pub async fn begin(self) -> Result<Tx<'c>, sqlx::Error> {
        Ok(match self {
            Conn::Postgres(conn) => Tx::Postgres(sqlx::Connection::begin(conn).await?),
            Conn::Sqlite(conn) => {
                Tx::Sqlite(sqlx::Connection::begin_with(conn, SQLITE_BEGIN_WRITE).await?)
            }
        })
    }
}

/// Takes SQLite's write lock when the transaction begins: a transaction that reads and then
/// writes would otherwise fail with "database is locked" (not waited for) when another
/// writer got in between its read and its write.
pub const SQLITE_BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

/// A write transaction on either database ([`Database::begin`], [`Conn::begin`]). Dropped
/// without [`Tx::commit`], it is rolled back.
#[allow(missing_docs)] // the variants name their database
pub enum Tx<'c> {
    Postgres(sqlx::Transaction<'c, Postgres>),
    Sqlite(sqlx::Transaction<'c, Sqlite>),
}

impl Tx<'_> {
    /// Its dialect, for code that differs by more than a fragment.
    pub fn backend(&self) -> Backend {
        match self {
            Tx::Postgres(_) => Backend::Postgres,
            Tx::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// The transaction's connection, for one statement.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Postgres(tx) => Conn::Postgres(tx),
            Tx::Sqlite(tx) => Conn::Sqlite(tx),
        }
    }

    /// `sql` inside this transaction.
    pub fn query<'q>(&'q mut self, sql: &'q Sql) -> Query<'q> {
        self.conn().query(sql)
    }

    /// Commits; a failed commit leaves nothing written.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Postgres(tx) => tx.commit().await,
            Tx::Sqlite(tx) => tx.commit().await,
        }
    }
}

impl Database {
    /// `sql` on a pooled connection; add arguments with [`Query::bind`].
    pub fn query<'q>(&'q self, sql: &'q Sql) -> Query<'q> {
        match self {
            Database::Postgres(pool) => Query(On::Postgres(
                Executor::Pool(pool),
                sqlx::query(&sql.postgres),
            )),
            Database::Sqlite(pool) => {
                Query(On::Sqlite(Executor::Pool(pool), sqlx::query(&sql.sqlite)))
            }
        }
    }

    /// Begins a write transaction on a pooled connection. On SQLite it takes the write lock
    /// at once (`BEGIN IMMEDIATE`), so what it reads stays true until it commits, as with
    /// rows it locks on PostgreSQL ([`Backend::lock_rows`]).
    pub async fn begin(&self) -> Result<Tx<'static>, sqlx::Error> {
        Ok(match self {
            Database::Postgres(pool) => Tx::Postgres(pool.begin().await?),
            Database::Sqlite(pool) => Tx::Sqlite(pool.begin_with(SQLITE_BEGIN_WRITE).await?),
        })
    }
}

/// Where a [`Query`] runs.
enum Executor<'e, Pool, Connection> {
    Pool(&'e Pool),
    Conn(&'e mut Connection),
}

/// A statement with its arguments and where it runs, on either database; `'q` is how long
/// the executor, the statement's text and the arguments are borrowed.
pub struct Query<'q>(On<'q>);

/// A [`Query`]'s statement, typed for its database, and its executor.
enum On<'q> {
    Postgres(
        Executor<'q, PgPool, PgConnection>,
        sqlx::query::Query<'q, Postgres, PgArguments>,
    ),
    Sqlite(
        Executor<'q, SqlitePool, SqliteConnection>,
        sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>,
    ),
}

/// Runs `$body` with `$executor` (a pool or a connection) and `$query` bound, for whichever
/// of the four the query holds: the same code, typed for each.
macro_rules! on_executor {
    ($on:expr, |$executor:ident, $query:ident| $body:expr) => {
        match $on {
            On::Postgres(Executor::Pool($executor), $query) => $body,
            On::Postgres(Executor::Conn($executor), $query) => $body,
            On::Sqlite(Executor::Pool($executor), $query) => $body,
            On::Sqlite(Executor::Conn($executor), $query) => $body,
        }
    };
}

impl<'q> Query<'q> {
    /// Adds the next argument (`$1` first). An argument that fails to encode (JSON that
    /// cannot be serialised, say) fails the statement when it runs.
    pub fn bind<T: AnyValue<'q> + 'q>(self, value: T) -> Self {
        Query(match self.0 {
            On::Postgres(executor, query) => On::Postgres(executor, query.bind(value)),
            On::Sqlite(executor, query) => On::Sqlite(executor, query.bind(value)),
        })
    }

    /// Plans the statement each time it runs instead of preparing it once. PostgreSQL keeps a
    /// prepared statement's generic plan, made when the statement was first prepared, for as
    /// long as the connection lives, and does not revisit it as the table grows: a lookup of
    /// a list of keys planned as a sequential scan on a new, small table stays one on a table
    /// of millions. Use it for such lookups on tables that grow; each run costs a planning.
    pub fn planned_each_time(self) -> Self {
        Query(match self.0 {
            On::Postgres(executor, query) => On::Postgres(executor, query.persistent(false)),
            On::Sqlite(executor, query) => On::Sqlite(executor, query.persistent(false)),
        })
    }

    /// Runs it and returns every row.
    pub async fn fetch_all<R: FromAnyRow>(self) -> Result<Vec<R>, sqlx::Error> {
        on_executor!(self.0, |executor, query| {
            query
                .try_map(|row| R::from_row(&row))
                .fetch_all(executor)
                .await
        })
    }

    /// Runs it and returns the first row, if any.
    pub async fn fetch_optional<R: FromAnyRow>(self) -> Result<Option<R>, sqlx::Error> {
        on_executor!(self.0, |executor, query| {
            query
                .try_map(|row| R::from_row(&row))
                .fetch_optional(executor)
                .await
        })
    }

    /// Runs it and returns the first row (`sqlx::Error::RowNotFound` without one).
    pub async fn fetch_one<R: FromAnyRow>(self) -> Result<R, sqlx::Error> {
        on_executor!(self.0, |executor, query| {
            query
                .try_map(|row| R::from_row(&row))
                .fetch_one(executor)
                .await
        })
    }

    /// Runs it and returns how many rows it changed.
    pub async fn execute(self) -> Result<u64, sqlx::Error> {
        on_executor!(self.0, |executor, query| {
            query
                .execute(executor)
                .await
                .map(|done| done.rows_affected())
        })
    }
}

/// A point in time, stored as `timestamptz` on PostgreSQL and as INTEGER milliseconds since
/// the Unix epoch on SQLite (which has no time type). Compare it in SQL with
/// [`Backend::now`] and [`Backend::ago`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub DateTime<Utc>);

impl Type<Postgres> for Timestamp {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl Type<Sqlite> for Timestamp {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }

    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for Timestamp {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        <DateTime<Utc> as Decode<Postgres>>::decode(value).map(Timestamp)
    }
}

impl<'r> Decode<'r, Sqlite> for Timestamp {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let millis = <i64 as Decode<Sqlite>>::decode(value)?;
        DateTime::from_timestamp_millis(millis)
            .map(Timestamp)
            .ok_or_else(|| format!("timestamp {millis} ms is out of range").into())
    }
}

impl Encode<'_, Postgres> for Timestamp {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <DateTime<Utc> as Encode<Postgres>>::encode_by_ref(&self.0, buf)
    }
}

impl<'q> Encode<'q, Sqlite> for Timestamp {
    fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<Sqlite>>::encode(self.0.timestamp_millis(), buf)
    }
}

/// A list bound as one argument: an array on PostgreSQL, JSON text on SQLite (which has no
/// arrays). Use it where [`Backend::in_list`] or [`Backend::list_rows`] reads it.
#[derive(Debug, Clone, Copy)]
pub struct List<'a, T>(pub &'a [T]);

impl<T: sqlx::postgres::PgHasArrayType> Type<Postgres> for List<'_, T> {
    fn type_info() -> PgTypeInfo {
        <[T] as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <[T] as Type<Postgres>>::compatible(ty)
    }
}

impl<T> Type<Sqlite> for List<'_, T> {
    fn type_info() -> SqliteTypeInfo {
        <String as Type<Sqlite>>::type_info()
    }

    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <String as Type<Sqlite>>::compatible(ty)
    }
}

impl<'q, T> Encode<'q, Postgres> for List<'_, T>
where
    T: Encode<'q, Postgres> + Type<Postgres>,
{
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <&[T] as Encode<Postgres>>::encode_by_ref(&self.0, buf)
    }
}

impl<'q, T: serde::Serialize> Encode<'q, Sqlite> for List<'_, T> {
    fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
        let json = serde_json::to_string(self.0)?;
        <String as Encode<Sqlite>>::encode(json, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestDatabase;
    use sqlx::types::Json;

    #[test]
    fn fragments_name_their_parameter() {
        assert_eq!(Backend::Postgres.in_list("a.id", 3), "a.id = ANY($3)");
        assert_eq!(
            Backend::Sqlite.in_list("a.id", 3),
            "a.id IN (SELECT value FROM json_each($3))"
        );
        assert!(Backend::Sqlite.ago(2).ends_with("- $2)"));
        assert_eq!(Backend::Sqlite.lock_rows("a"), "");
    }

    #[test]
    fn rendered_statements_differ_only_where_asked() {
        let sql = Sql::render(|b| format!("SELECT x FROM t WHERE {}", b.in_list("x", 1)));
        assert_eq!(
            sql.text(Backend::Postgres),
            "SELECT x FROM t WHERE x = ANY($1)"
        );
        assert_eq!(
            sql.text(Backend::Sqlite),
            "SELECT x FROM t WHERE x IN (SELECT value FROM json_each($1))"
        );
    }

    /// A database of either kind with a table using every value type the fragments serve.
    async fn open(backend: Backend) -> (TestDatabase, Database) {
        let test_db = match backend {
            Backend::Postgres => TestDatabase::postgres()
                .await
                .expect("PostgreSQL must be running (DATABASE_URL)"),
            Backend::Sqlite => TestDatabase::sqlite().expect("temporary SQLite file"),
        };
        let db = test_db.connect().await.expect("connect");
        let table = Sql::each(
            "CREATE TABLE items (id text PRIMARY KEY, n integer NOT NULL, \
             tags jsonb NOT NULL, at timestamptz NOT NULL)",
            "CREATE TABLE items (id TEXT PRIMARY KEY, n INTEGER NOT NULL, \
             tags TEXT NOT NULL, at INTEGER NOT NULL) STRICT",
        );
        db.query(&table).execute().await.expect("create table");
        (test_db, db)
    }

    static INSERT: Sql = Sql::same("INSERT INTO items (id, n, tags, at) VALUES ($1, $2, $3, $4)");

    static INSERT_NOW: std::sync::LazyLock<Sql> = std::sync::LazyLock::new(|| {
        Sql::render(|b| {
            format!(
                "INSERT INTO items (id, n, tags, at) VALUES ($1, $2, $3, {now})",
                now = b.now()
            )
        })
    });

    #[derive(Debug, PartialEq, sqlx::FromRow)]
    struct Item {
        id: String,
        n: i32,
        tags: Json<Vec<String>>,
        at: Timestamp,
    }

    async fn statements_run_alike(backend: Backend) {
        let (test_db, db) = open(backend).await;
        let (one,): (i32,) = db
            .query(&Sql::same("SELECT 1"))
            .fetch_one()
            .await
            .expect("SELECT 1 reads as i32 on both");
        assert_eq!(one, 1);

        let at = DateTime::from_timestamp_millis(1_700_000_000_123).expect("time");
        for (id, n, tags) in [
            ("a", 1, vec!["x", "y"]),
            ("b", 2, vec!["y"]),
            ("c", 3, vec![]),
        ] {
            let written = db
                .query(&INSERT)
                .bind(id)
                .bind(n)
                .bind(Json(tags))
                .bind(Timestamp(at))
                .execute()
                .await
                .expect("insert");
            assert_eq!(written, 1);
        }
        db.query(&INSERT_NOW)
            .bind("now")
            .bind(4)
            .bind(Json(Vec::<String>::new()))
            .execute()
            .await
            .expect("insert now");

        let item: Option<Item> = db
            .query(&Sql::same(
                "SELECT id, n, tags, at FROM items WHERE id = $1",
            ))
            .bind("a")
            .fetch_optional()
            .await
            .expect("read");
        assert_eq!(
            item,
            Some(Item {
                id: "a".to_owned(),
                n: 1,
                tags: Json(vec!["x".to_owned(), "y".to_owned()]),
                at: Timestamp(at),
            }),
            "timestamps keep their milliseconds"
        );
        let missing: Option<Item> = db
            .query(&Sql::same(
                "SELECT id, n, tags, at FROM items WHERE id = $1",
            ))
            .bind("zz")
            .fetch_optional()
            .await
            .expect("read");
        assert_eq!(missing, None);

        // A parameter used twice, and out of order.
        let both = Sql::same("SELECT id FROM items WHERE n >= $2 AND n <= $2 + $1 ORDER BY id");
        let rows: Vec<(String,)> = db
            .query(&both)
            .bind(1_i64)
            .bind(2_i64)
            .fetch_all()
            .await
            .expect("reused parameter");
        assert_eq!(rows, [("b".to_owned(),), ("c".to_owned(),)]);

        let in_list = Sql::render(|b| {
            format!(
                "SELECT id FROM items WHERE {} ORDER BY id",
                b.in_list("id", 1)
            )
        });
        let wanted = ["c", "a", "nobody"];
        let rows: Vec<(String,)> = db
            .query(&in_list)
            .bind(List(&wanted[..]))
            .fetch_all()
            .await
            .expect("in list");
        assert_eq!(rows, [("a".to_owned(),), ("c".to_owned(),)]);
        let none: Vec<(String,)> = db
            .query(&in_list)
            .bind(List::<&str>(&[]))
            .fetch_all()
            .await
            .expect("empty list");
        assert!(none.is_empty());

        let list_rows =
            Sql::render(|b| format!("SELECT l.value FROM {} ORDER BY 1", b.list_rows(1, "l")));
        let rows: Vec<(String,)> = db
            .query(&list_rows)
            .bind(List(&["q", "p"][..]))
            .fetch_all()
            .await
            .expect("list rows");
        assert_eq!(rows, [("p".to_owned(),), ("q".to_owned(),)]);

        let tagged = Sql::render(|b| {
            format!(
                "SELECT id FROM items WHERE {} ORDER BY id",
                b.json_contains_all("tags", 1)
            )
        });
        let rows: Vec<(String,)> = db
            .query(&tagged)
            .bind(Json(["y"]))
            .fetch_all()
            .await
            .expect("contains");
        assert_eq!(rows, [("a".to_owned(),), ("b".to_owned(),)]);
        let rows: Vec<(String,)> = db
            .query(&tagged)
            .bind(Json(["x", "y"]))
            .fetch_all()
            .await
            .expect("contains all");
        assert_eq!(rows, [("a".to_owned(),)]);

        let recent = Sql::render(|b| {
            format!(
                "SELECT id, at >= {} AS recent FROM items ORDER BY id",
                b.ago(1)
            )
        });
        let rows: Vec<(String, bool)> = db
            .query(&recent)
            .bind(60_000_i64)
            .fetch_all()
            .await
            .expect("bool and time fragments");
        let recent: Vec<&str> = rows
            .iter()
            .filter(|(_, recent)| *recent)
            .map(|(id, _)| id.as_str())
            .collect();
        assert_eq!(recent, ["now"], "only the row written with now() is recent");

        let (count,): (i64,) = db
            .query(&Sql::same("SELECT count(*) FROM items"))
            .fetch_one()
            .await
            .expect("count");
        assert_eq!(count, 4);
        db.close().await;
        test_db.cleanup().await;
    }

    async fn insert(tx: &mut Tx<'_>, id: &str) -> Result<u64, sqlx::Error> {
        tx.query(&INSERT)
            .bind(id)
            .bind(0)
            .bind(Json(["t"]))
            .bind(Timestamp(Utc::now()))
            .execute()
            .await
    }

    async fn transactions_commit_or_roll_back(backend: Backend) {
        let (test_db, db) = open(backend).await;
        let mut tx = db.begin().await.expect("begin");
        assert_eq!(tx.backend(), backend);
        insert(&mut tx, "kept").await.expect("insert");
        tx.commit().await.expect("commit");
        let mut tx = db.begin().await.expect("begin");
        insert(&mut tx, "dropped").await.expect("insert");
        drop(tx);

        let ids = Sql::same("SELECT id FROM items ORDER BY id");
        let rows: Vec<(String,)> = db.query(&ids).fetch_all().await.expect("read");
        assert_eq!(rows, [("kept".to_owned(),)]);

        // A connection of one's own, as a service's writer keeps it.
        match &db {
            Database::Postgres(pool) => {
                let mut conn = pool.acquire().await.expect("acquire");
                let mut tx = Conn::Postgres(&mut conn).begin().await.expect("begin");
                insert(&mut tx, "own").await.expect("insert");
                tx.commit().await.expect("commit");
                let rows: Vec<(String,)> = Conn::Postgres(&mut conn)
                    .query(&ids)
                    .fetch_all()
                    .await
                    .expect("read");
                assert_eq!(rows.len(), 2);
            }
            Database::Sqlite(pool) => {
                let mut conn = pool.acquire().await.expect("acquire");
                let mut tx = Conn::Sqlite(&mut conn).begin().await.expect("begin");
                insert(&mut tx, "own").await.expect("insert");
                tx.commit().await.expect("commit");
                let rows: Vec<(String,)> = Conn::Sqlite(&mut conn)
                    .query(&ids)
                    .fetch_all()
                    .await
                    .expect("read");
                assert_eq!(rows.len(), 2);
            }
        }
        db.close().await;
        test_db.cleanup().await;
    }

    #[tokio::test]
    async fn statements_run_alike_on_postgres() {
        statements_run_alike(Backend::Postgres).await
    }

    #[tokio::test]
    async fn statements_run_alike_on_sqlite() {
        statements_run_alike(Backend::Sqlite).await
    }

    #[tokio::test]
    async fn transactions_commit_or_roll_back_on_postgres() {
        transactions_commit_or_roll_back(Backend::Postgres).await
    }

    #[tokio::test]
    async fn transactions_commit_or_roll_back_on_sqlite() {
        transactions_commit_or_roll_back(Backend::Sqlite).await
    }
}
