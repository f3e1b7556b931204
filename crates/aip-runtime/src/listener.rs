//! A service's own HTTP listener, or none when another server embeds the service.
//!
//! A service's binary binds its listener at build time (so a port in use fails the start, and
//! port 0 tells the test its port); `aip dev` builds the same services embedded and serves their
//! routers on its one address, so nothing else is bound.

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;

use crate::service::{ServiceName, StartError};

/// Where a built service serves HTTP.
#[derive(Debug)]
pub struct ServiceListener {
    bound: Option<TcpListener>,
    configured: SocketAddr,
}

/// Whether a service binds a listener of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listening {
    /// Its binary (and tests): the configured address is bound at build time.
    Own,
    /// Embedded in another server (`aip dev`), which serves the service's router: nothing is
    /// bound.
    Embedded,
}

impl ServiceListener {
    /// The listener `listening` asks for, on `addr`.
    pub async fn open(
        service: ServiceName,
        addr: SocketAddr,
        listening: Listening,
    ) -> Result<Self, StartError> {
        match listening {
            Listening::Own => Self::bind(service, addr).await,
            Listening::Embedded => Ok(Self::embedded(addr)),
        }
    }

    /// Binds `addr` (port 0 picks a free port).
    pub async fn bind(service: ServiceName, addr: SocketAddr) -> Result<Self, StartError> {
        let bound = TcpListener::bind(addr)
            .await
            .map_err(|cause| StartError::Bind {
                service,
                addr,
                cause,
            })?;
        Ok(ServiceListener {
            bound: Some(bound),
            configured: addr,
        })
    }

    /// Nothing bound: the embedding server serves the service's router. `configured` is the
    /// address the embedding server serves on, kept for [`ServiceListener::local_addr`].
    pub fn embedded(configured: SocketAddr) -> Self {
        ServiceListener {
            bound: None,
            configured,
        }
    }

    /// The bound address (the real port when 0 was asked for); embedded, the configured one.
    pub fn local_addr(&self) -> SocketAddr {
        self.bound
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .unwrap_or(self.configured)
    }

    /// Whether a listener is bound (false when embedded).
    pub fn is_bound(&self) -> bool {
        self.bound.is_some()
    }

    /// Serves `router` until `shutdown` completes, then lets requests in progress finish.
    /// Embedded, only waits for `shutdown`.
    pub async fn serve(
        self,
        router: Router,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        match self.bound {
            Some(listener) => serve_http(listener, router, shutdown).await,
            None => {
                shutdown.await;
                Ok(())
            }
        }
    }
}

/// How long a client has to send a request's headers, the WebSocket handshake's included,
/// from the moment it connects: a client that sends them slowly (slowloris) or not at all is
/// disconnected then instead of holding a socket forever.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `router` on `listener` (HTTP/1.1 with upgrades, at most [`HEADER_READ_TIMEOUT`] for
/// a request's headers) until `shutdown` completes, then lets the requests in progress
/// finish. (`axum::serve` sets no header timeout.) Accepted sockets send small writes at once
/// (Nagle's algorithm off): AIP is request/response over small frames, and with Nagle on an
/// answer waits for the peer's delayed ACK (about 40 ms on Linux).
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tower::ServiceExt as _;

    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was taken:
                    // the listener itself is fine; pause briefly rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!("cannot turn Nagle's algorithm off on an accepted socket: {e}");
        }
        let service =
            router
                .clone()
                .map_request(|request: hyper::Request<hyper::body::Incoming>| {
                    request.map(axum::body::Body::new)
                });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service))
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::trace!("connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
