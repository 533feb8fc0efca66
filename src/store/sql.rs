//! One way to run the store's queries on either backend: statements prepared on a
//! [`Conn`] (SQLite through rusqlite's statement cache, PostgreSQL through the worker of
//! `pg.rs`), parameters that bind to both ([`Param`], [`params!`](crate::params)), and rows
//! read the same way ([`Row::get`] into a [`Column`]).
//!
//! The queries keep SQLite's spelling: numbered `?N` parameters, which the PostgreSQL side
//! rewrites to `$N` once per statement. rusqlite's `Result` and `Error` stay the row-level
//! error of both backends (a PostgreSQL failure travels boxed inside it and is told apart
//! again in `StoreError::from`), so the table files read the same whichever backend runs.
//!
//! Hand-written on purpose: the crates that span both (sqlx's `Any`, sea-query) are async or
//! build SQL from a tree, and either would rewrite every query of the store; this layer is
//! the little the two drivers lack in common.

use super::pg::PgSession;
use rusqlite::types::{FromSql, ToSql};

/// A value as both backends bind and return it.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// A query parameter: anything rusqlite binds, which also says what it is as a [`Val`].
pub trait Param: ToSql {
    fn val(&self) -> Val;
}

macro_rules! int_param {
    ($($t:ty),*) => {$(
        impl Param for $t {
            fn val(&self) -> Val {
                Val::Int(i64::try_from(*self).unwrap_or(i64::MAX))
            }
        }
    )*};
}
int_param!(i64, i32, u32, u16, u8, i16);

impl Param for bool {
    fn val(&self) -> Val {
        Val::Int(i64::from(*self))
    }
}
impl Param for f64 {
    fn val(&self) -> Val {
        Val::Real(*self)
    }
}
impl Param for str {
    fn val(&self) -> Val {
        Val::Text(self.to_owned())
    }
}
impl Param for String {
    fn val(&self) -> Val {
        Val::Text(self.clone())
    }
}
impl Param for Vec<u8> {
    fn val(&self) -> Val {
        Val::Blob(self.clone())
    }
}
impl<T: Param> Param for Option<T> {
    fn val(&self) -> Val {
        self.as_ref().map_or(Val::Null, Param::val)
    }
}
impl<T: Param + ?Sized> Param for &T {
    fn val(&self) -> Val {
        (**self).val()
    }
}
impl<T: Param + ?Sized> Param for Box<T> {
    fn val(&self) -> Val {
        (**self).val()
    }
}

/// A statement's parameters: `params![a, b]`, an array of one type (`[id]`), or none (`[]`).
pub trait Params {
    fn vals(&self) -> Vec<Val>;
    fn lite(&self) -> Vec<&dyn ToSql>;
}

impl Params for &[&dyn Param] {
    fn vals(&self) -> Vec<Val> {
        self.iter().map(Param::val).collect()
    }
    fn lite(&self) -> Vec<&dyn ToSql> {
        self.iter().map(|p| *p as &dyn ToSql).collect()
    }
}

impl Params for [&dyn Param; 0] {
    fn vals(&self) -> Vec<Val> {
        Vec::new()
    }
    fn lite(&self) -> Vec<&dyn ToSql> {
        Vec::new()
    }
}

macro_rules! array_params {
    ($($n:literal),*) => {$(
        impl<T: Param> Params for [T; $n] {
            fn vals(&self) -> Vec<Val> {
                self.iter().map(Param::val).collect()
            }
            fn lite(&self) -> Vec<&dyn ToSql> {
                self.iter().map(|p| p as &dyn ToSql).collect()
            }
        }
    )*};
}
array_params!(1, 2, 3, 4, 5, 6, 7, 8);

/// Parameters of mixed types, bound in order to `?1`, `?2`, …
#[macro_export]
#[doc(hidden)]
macro_rules! store_params {
    () => { [] as [&dyn $crate::store::sql::Param; 0] };
    ($($p:expr),+ $(,)?) => {
        &[$(&$p as &dyn $crate::store::sql::Param),+] as &[&dyn $crate::store::sql::Param]
    };
}
pub use crate::store_params as params;

/// A value a row's column is read into, from either backend.
pub trait Column: FromSql + Sized {
    /// `Err` says why the value does not fit.
    fn from_val(v: &Val) -> Result<Self, String>;
}

fn mismatch(v: &Val, want: &str) -> String {
    format!("a column holds {v:?} where {want} was expected")
}

macro_rules! int_column {
    ($($t:ty),*) => {$(
        impl Column for $t {
            fn from_val(v: &Val) -> Result<Self, String> {
                match v {
                    Val::Int(i) => <$t>::try_from(*i).map_err(|e| e.to_string()),
                    other => Err(mismatch(other, stringify!($t))),
                }
            }
        }
    )*};
}
int_column!(i64, i32, u32, u16, u8);

impl Column for bool {
    fn from_val(v: &Val) -> Result<Self, String> {
        match v {
            Val::Int(i) => Ok(*i != 0),
            other => Err(mismatch(other, "a boolean")),
        }
    }
}
impl Column for f64 {
    fn from_val(v: &Val) -> Result<Self, String> {
        match v {
            Val::Real(f) => Ok(*f),
            #[allow(clippy::cast_precision_loss)]
            Val::Int(i) => Ok(*i as f64),
            other => Err(mismatch(other, "a number")),
        }
    }
}
impl Column for String {
    fn from_val(v: &Val) -> Result<Self, String> {
        match v {
            Val::Text(s) => Ok(s.clone()),
            other => Err(mismatch(other, "text")),
        }
    }
}
impl Column for Vec<u8> {
    fn from_val(v: &Val) -> Result<Self, String> {
        match v {
            Val::Blob(b) => Ok(b.clone()),
            Val::Text(s) => Ok(s.clone().into_bytes()),
            other => Err(mismatch(other, "bytes")),
        }
    }
}
impl<T: Column> Column for Option<T> {
    fn from_val(v: &Val) -> Result<Self, String> {
        match v {
            Val::Null => Ok(None),
            other => T::from_val(other).map(Some),
        }
    }
}

/// One row of a result, from either backend.
#[derive(Debug)]
pub enum Row<'r, 's> {
    Lite(&'r rusqlite::Row<'s>),
    Pg(&'r [Val]),
}

impl Row<'_, '_> {
    /// The value of column `idx` (from 0).
    pub fn get<T: Column>(&self, idx: usize) -> rusqlite::Result<T> {
        match self {
            Row::Lite(r) => r.get(idx),
            Row::Pg(vals) => {
                let v = vals
                    .get(idx)
                    .ok_or(rusqlite::Error::InvalidColumnIndex(idx))?;
                T::from_val(v).map_err(|e| {
                    rusqlite::Error::FromSqlConversionFailure(
                        idx,
                        rusqlite::types::Type::Null,
                        e.into(),
                    )
                })
            }
        }
    }
}

/// A connection inside a transaction, on either backend.
#[derive(Clone, Copy, Debug)]
pub enum Conn<'a> {
    Lite(&'a rusqlite::Connection),
    Pg(&'a PgSession),
}

impl<'a> Conn<'a> {
    /// `sql`, prepared once per connection (both backends keep a statement cache).
    pub fn prepare_cached(&self, sql: &str) -> rusqlite::Result<Stmt<'a>> {
        Ok(match *self {
            Conn::Lite(c) => Stmt::Lite(c.prepare_cached(sql)?),
            Conn::Pg(pg) => Stmt::Pg(pg, sql.to_owned()),
        })
    }

    /// Whether this is PostgreSQL (for the few statements the two spell differently).
    pub fn is_pg(&self) -> bool {
        matches!(self, Conn::Pg(_))
    }

    /// The PostgreSQL server process of this session, as of the transaction running now
    /// (a session opened anew at its `BEGIN` has a new one); `None` on SQLite.
    pub fn session_pid(&self) -> Option<i64> {
        match self {
            Conn::Pg(s) => Some(s.backend_pid()),
            Conn::Lite(_) => None,
        }
    }
}

/// A prepared statement, on either backend.
#[allow(missing_debug_implementations)] // rusqlite's cached statement has no Debug
pub enum Stmt<'a> {
    Lite(rusqlite::CachedStatement<'a>),
    Pg(&'a PgSession, String),
}

// Parameters are taken by value, as rusqlite's own calls take them: callers hand over
// temporaries (`[id]`, `params![…]`).
#[allow(clippy::needless_pass_by_value)]
impl Stmt<'_> {
    /// Runs the statement; the number of rows it changed.
    pub fn execute(&mut self, params: impl Params) -> rusqlite::Result<usize> {
        match self {
            Stmt::Lite(st) => st.execute(params.lite().as_slice()),
            Stmt::Pg(pg, sql) => pg.execute(sql, params.vals()),
        }
    }

    /// The first row, through `f`; `QueryReturnedNoRows` when there is none.
    pub fn query_row<T>(
        &mut self,
        params: impl Params,
        f: impl FnOnce(&Row<'_, '_>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        match self {
            Stmt::Lite(st) => st.query_row(params.lite().as_slice(), |r| f(&Row::Lite(r))),
            Stmt::Pg(pg, sql) => {
                let rows = pg.query(sql, params.vals())?;
                let first = rows.first().ok_or(rusqlite::Error::QueryReturnedNoRows)?;
                f(&Row::Pg(first))
            }
        }
    }

    /// Every row, through `f`, in order.
    pub fn query_map<T>(
        &mut self,
        params: impl Params,
        mut f: impl FnMut(&Row<'_, '_>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<std::vec::IntoIter<rusqlite::Result<T>>> {
        let out: Vec<rusqlite::Result<T>> = match self {
            Stmt::Lite(st) => st
                .query_map(params.lite().as_slice(), |r| f(&Row::Lite(r)))?
                .collect(),
            Stmt::Pg(pg, sql) => pg
                .query(sql, params.vals())?
                .iter()
                .map(|r| f(&Row::Pg(r)))
                .collect(),
        };
        Ok(out.into_iter())
    }
}
