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
            Some(listener) => {
                axum::serve(crate::nodelay(listener), router)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
            None => {
                shutdown.await;
                Ok(())
            }
        }
    }
}
