//! HTTP/1.1 over turmoil's simulated TCP, with hyper on both ends: a client that opens one
//! connection per request (turmoil's faults break connections, so nothing is reused), and a
//! server that answers each request from a plain function.

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::time::Duration;

/// The port every simulated host serves on.
pub const PORT: u16 = 80;

/// Why a simulated request got no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetError {
    /// The connection was refused or broken before the request went out.
    Connect(String),
    /// No answer in time.
    Timeout,
    Other(String),
}

/// One request to `url` (`http://host[:port]/path`), answered within `timeout`.
pub async fn request(
    method: &str,
    url: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), NetError> {
    let parsed = url::Url::parse(url).map_err(|e| NetError::Other(format!("bad url: {e}")))?;
    let host = parsed
        .host_str()
        .ok_or_else(|| NetError::Other("url without host".to_owned()))?
        .to_owned();
    let port = parsed.port().unwrap_or(PORT);
    let path = match parsed.query() {
        Some(q) => format!("{}?{q}", parsed.path()),
        None => parsed.path().to_owned(),
    };
    let method = hyper::Method::from_bytes(method.as_bytes())
        .map_err(|e| NetError::Other(format!("bad method: {e}")))?;
    let exchange = async move {
        let stream = turmoil::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| NetError::Connect(e.to_string()))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| NetError::Connect(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", host)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| NetError::Other(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| NetError::Other(e.to_string()))?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| NetError::Other(e.to_string()))?
            .to_bytes();
        Ok((status, bytes.to_vec()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(NetError::Timeout))
}

/// A request as a handler sees it.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// Serves `handler` on [`PORT`] until the host stops.
///
/// # Errors
/// When the port cannot be bound or accepting fails.
pub async fn serve<H>(handler: H) -> Result<(), Box<dyn std::error::Error>>
where
    H: Fn(Request) -> (u16, String) + Clone + Send + Sync + 'static,
{
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let handler = handler.clone();
                async move {
                    let method = req.method().as_str().to_owned();
                    let path = req.uri().path().to_owned();
                    let body = match req.into_body().collect().await {
                        Ok(b) => b.to_bytes().to_vec(),
                        Err(_) => Vec::new(),
                    };
                    let (status, text) = handler(Request { method, path, body });
                    let mut response = hyper::Response::new(Full::new(Bytes::from(text)));
                    *response.status_mut() = hyper::StatusCode::from_u16(status)
                        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The simulation's clock: virtual time since the run began (zero outside a simulation).
pub fn elapsed() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}
