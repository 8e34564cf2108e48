//! The seam between the queue and a PostgreSQL client library.
//!
//! A [`Driver`] runs a statement on a connection and reads a column of a row: nothing more.
//! Everything the queue means by its statements (which one, with which values, what the rows
//! say) is written once above it, in `statement.rs` and `queue.rs`, for every driver. A driver
//! is a marker type ([`Sqlx`](crate::Sqlx), [`TokioPostgres`](crate::TokioPostgres)) naming its
//! pool, connection, transaction and row types; the trait is sealed.
//!
//! Values cross the seam as [`Params`] (a tuple of [`Param`]s, bound by each driver as its
//! library binds them) and come back as [`Column`]s; both are the types that every enabled
//! driver can bind and read, so code written against them serves every driver. Adopters use
//! the same two traits through [`PostgresTx::query`](crate::PostgresTx::query) and friends to
//! write a hook once for both drivers.

use std::future::Future;
use std::pin::Pin;

use crate::error::PgError;

mod sealed {
    pub trait Sealed {}
}

pub(crate) use sealed::Sealed;

/// The most bytes one `COPY` data message carries: the server reads each message whole.
pub(crate) const COPY_CHUNK: usize = 1 << 20;

/// A statement's future. Boxed: the statements' futures are held across awaits of generic
/// code that must be `Send`, and a boxed `dyn Future + Send` keeps the compiler from having to
/// prove that through every borrowed parameter.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A PostgreSQL client library, as the queue uses it. Implemented by [`Sqlx`](crate::Sqlx) and
/// [`TokioPostgres`](crate::TokioPostgres); sealed.
pub trait Driver: Sealed + Sized + Send + Sync + 'static {
    /// The connection pool.
    type Pool: Clone + Send + Sync + 'static;
    /// A connection taken out of the pool, returned to it when dropped.
    type Pooled: Send;
    /// An open transaction; dropped without commit, it rolls back.
    type Tx: Send + 'static;
    /// What a statement runs on: a pooled connection, a transaction, or the caller's own.
    type Conn<'c>: Send;
    /// A result row.
    type Row: Send + Sync + 'static;

    /// Takes a connection out of `pool`.
    fn acquire(pool: &Self::Pool) -> impl Future<Output = Result<Self::Pooled, PgError>> + Send;
    /// Runs statements on a pooled connection.
    fn pooled(conn: &mut Self::Pooled) -> Self::Conn<'_>;
    /// Closes `conn` instead of returning it to the pool (its session holds state the pool
    /// must not lend out, such as an advisory lock).
    fn discard(conn: Self::Pooled);
    /// Begins a transaction on a connection of `pool`.
    fn begin(pool: &Self::Pool) -> impl Future<Output = Result<Self::Tx, PgError>> + Send;
    /// Runs statements inside `tx`.
    fn in_tx(tx: &mut Self::Tx) -> Self::Conn<'_>;
    /// Commits `tx`.
    fn commit(tx: Self::Tx) -> impl Future<Output = Result<(), PgError>> + Send;
    /// Rolls `tx` back.
    fn rollback(tx: Self::Tx) -> impl Future<Output = Result<(), PgError>> + Send;
    /// The same connection for one more statement.
    fn reborrow<'a>(conn: &'a mut Self::Conn<'_>) -> Self::Conn<'a>;
    /// Runs one statement with bound `params`; returns its rows.
    fn query<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: Self::Conn<'c>,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<Vec<Self::Row>, PgError>>;
    /// Runs one statement with bound `params`; returns how many rows it changed.
    fn execute<'c: 'q, 'q, 'p: 'q, P: Params<'p> + 'q>(
        conn: Self::Conn<'c>,
        sql: &'q str,
        params: &'q P,
    ) -> BoxFuture<'q, Result<u64, PgError>>;
    /// Runs statements without parameters, `;`-separated (DDL).
    fn batch_execute<'c: 'q, 'q>(
        conn: Self::Conn<'c>,
        sql: &'q str,
    ) -> BoxFuture<'q, Result<(), PgError>>;
    /// Runs `statement` (`COPY … FROM STDIN`, text format) and sends it `data`, rows in COPY's
    /// text format; returns how many rows it copied.
    fn copy_in<'c: 'q, 'q>(
        conn: Self::Conn<'c>,
        statement: &'q str,
        data: Vec<u8>,
    ) -> BoxFuture<'q, Result<u64, PgError>>;
    /// Reads `column` of `row`.
    fn get<T: Column>(row: &Self::Row, column: &str) -> Result<T, PgError>;
}

/// A value every enabled driver can bind: `i16`, `i32`, `i64`, `f64`, `bool`, `&str`, `String`,
/// `serde_json::Value`, `chrono::DateTime<Utc>`, `Option`s and `Vec`s of those (arrays), and
/// references to any of them. `'p` is how long borrowed values in it live.
pub trait Param<'p>: Send + Sync + bounds::SqlxParam<'p> + bounds::TokioPostgresParam {}

impl<'p, T> Param<'p> for T where
    T: Send + Sync + bounds::SqlxParam<'p> + bounds::TokioPostgresParam + ?Sized
{
}

/// A value every enabled driver can read from a column: the owned types of [`Param`].
pub trait Column: Sized + Send + bounds::SqlxColumn + bounds::TokioPostgresColumn {}

impl<T: Sized + Send + bounds::SqlxColumn + bounds::TokioPostgresColumn> Column for T {}

/// A statement's parameters: `()` or a tuple of up to twelve [`Param`]s, `$1` first.
pub trait Params<'p>: Send + Sync {
    /// Hands each parameter to `visitor`, in order.
    fn visit<'s, V: ParamVisitor<'s, 'p>>(&'s self, visitor: &mut V);
}

/// What a driver binds parameters with (see [`Params::visit`]).
pub trait ParamVisitor<'s, 'p> {
    /// Binds the next parameter.
    fn param<T: Param<'p>>(&mut self, value: &'s T);
}

impl<'p> Params<'p> for () {
    fn visit<'s, V: ParamVisitor<'s, 'p>>(&'s self, _visitor: &mut V) {}
}

macro_rules! tuple_params {
    ($($name:ident . $index:tt),+) => {
        impl<'p, $($name: Param<'p>),+> Params<'p> for ($($name,)+) {
            fn visit<'s, V: ParamVisitor<'s, 'p>>(&'s self, visitor: &mut V) {
                $(visitor.param(&self.$index);)+
            }
        }
    };
}

tuple_params!(A.0);
tuple_params!(A.0, B.1);
tuple_params!(A.0, B.1, C.2);
tuple_params!(A.0, B.1, C.2, D.3);
tuple_params!(A.0, B.1, C.2, D.3, E.4);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10);
tuple_params!(A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11);

/// Two parameter lists, the first's numbered first: how a statement made of two others
/// (`finalize_claim.sql`) binds both lists as they are.
pub(crate) struct Chain<A, B>(pub(crate) A, pub(crate) B);

impl<'p, A: Params<'p>, B: Params<'p>> Params<'p> for Chain<A, B> {
    fn visit<'s, V: ParamVisitor<'s, 'p>>(&'s self, visitor: &mut V) {
        self.0.visit(visitor);
        self.1.visit(visitor);
    }
}

/// The bounds each driver puts on values; a driver that is not compiled in puts none.
#[doc(hidden)]
pub mod bounds {
    #[cfg(feature = "sqlx")]
    pub use crate::sqlx_driver::{SqlxColumn, SqlxParam};

    #[cfg(not(feature = "sqlx"))]
    mod no_sqlx {
        pub trait SqlxParam<'p> {}
        impl<T: ?Sized> SqlxParam<'_> for T {}
        pub trait SqlxColumn {}
        impl<T> SqlxColumn for T {}
    }
    #[cfg(not(feature = "sqlx"))]
    pub use no_sqlx::{SqlxColumn, SqlxParam};

    #[cfg(feature = "tokio-postgres")]
    pub use crate::tokio_postgres_driver::{TokioPostgresColumn, TokioPostgresParam};

    #[cfg(not(feature = "tokio-postgres"))]
    mod no_tokio_postgres {
        pub trait TokioPostgresParam {}
        impl<T: ?Sized> TokioPostgresParam for T {}
        pub trait TokioPostgresColumn {}
        impl<T> TokioPostgresColumn for T {}
    }
    #[cfg(not(feature = "tokio-postgres"))]
    pub use no_tokio_postgres::{TokioPostgresColumn, TokioPostgresParam};
}
