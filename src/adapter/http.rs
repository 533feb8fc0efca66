//! The HTTP the adapters and the outage guard speak, behind one small trait: the real client
//! (reqwest) in production, the simulated network in `handoffs sim`. Only what the command
//! adapter's protocol needs: a GET or a POST of JSON, a status code and a body back, and three
//! kinds of failure the delivery rules tell apart (no connection, no answer in time, other).

use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// GET or POST.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
}

/// An answer: its status code and body.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn is_client_error(&self) -> bool {
        (400..500).contains(&self.status)
    }

    /// The body as JSON.
    pub fn json(&self) -> Result<Value, String> {
        serde_json::from_slice(&self.body).map_err(|e| format!("not JSON: {e}"))
    }
}

/// Why no answer came.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// Nothing listened: the request certainly did not arrive.
    #[error("could not connect: {0}")]
    Connect(String),
    /// Sent, but no answer in time: it may or may not have arrived.
    #[error("no answer in time")]
    Timeout,
    #[error("{0}")]
    Other(String),
}

/// The future a transport returns.
pub type Call<'a> = Pin<Box<dyn Future<Output = Result<Reply, HttpError>> + 'a>>;

/// One HTTP exchange, as the adapters need it.
pub trait Transport: std::fmt::Debug {
    fn call<'a>(
        &'a self,
        method: Method,
        url: &'a str,
        body: Option<&'a Value>,
        timeout: Duration,
    ) -> Call<'a>;
}

/// A shareable handle on a transport.
#[derive(Clone, Debug)]
pub struct Http(Arc<dyn Transport>);

impl Http {
    pub fn new(transport: impl Transport + 'static) -> Http {
        Http(Arc::new(transport))
    }

    /// The real network.
    pub fn real() -> Http {
        Http::new(Reqwest::new())
    }

    pub async fn get(&self, url: &str, timeout: Duration) -> Result<Reply, HttpError> {
        self.0.call(Method::Get, url, None, timeout).await
    }

    pub async fn post(
        &self,
        url: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Reply, HttpError> {
        self.0.call(Method::Post, url, Some(body), timeout).await
    }
}

/// The real network, through reqwest: no redirects (a redirect must not turn one write into
/// two, or a POST into a GET), a pool of idle connections per host.
#[derive(Clone, Debug)]
pub struct Reqwest(reqwest::Client);

impl Reqwest {
    pub fn new() -> Reqwest {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(16)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Reqwest(client)
    }
}

impl Default for Reqwest {
    fn default() -> Self {
        Reqwest::new()
    }
}

impl Transport for Reqwest {
    fn call<'a>(
        &'a self,
        method: Method,
        url: &'a str,
        body: Option<&'a Value>,
        timeout: Duration,
    ) -> Call<'a> {
        Box::pin(async move {
            let request = match method {
                Method::Get => self.0.get(url),
                Method::Post => self.0.post(url),
            };
            let request = match body {
                Some(b) => request.json(b),
                None => request,
            };
            let classify = |e: reqwest::Error| {
                if e.is_connect() {
                    HttpError::Connect(e.to_string())
                } else if e.is_timeout() {
                    HttpError::Timeout
                } else {
                    HttpError::Other(e.to_string())
                }
            };
            let response = request.timeout(timeout).send().await.map_err(classify)?;
            let status = response.status().as_u16();
            let body = response.bytes().await.map_err(classify)?;
            Ok(Reply {
                status,
                body: body.to_vec(),
            })
        })
    }
}
