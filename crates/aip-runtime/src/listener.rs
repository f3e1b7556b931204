//! A service's own HTTP listener, or none when another server embeds the service.
//!
//! A service's binary binds its listener at build time (so a port in use fails the start, and
//! port 0 tells the test its port); `aip dev` builds the same services embedded and serves their
//! routers on its one address, so nothing else is bound.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::service::{ServiceName, StartError};

/// Where a built service serves HTTP.
#[derive(Debug)]
pub struct ServiceListener {
    bound: Option<TcpListener>,
    configured: SocketAddr,
    /// The connections the bound listener keeps open at most.
    limits: ConnectionLimits,
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

    /// Binds `addr` (port 0 picks a free port) with [`bind_tcp`].
    pub async fn bind(service: ServiceName, addr: SocketAddr) -> Result<Self, StartError> {
        let bound = bind_tcp(addr).map_err(|cause| StartError::Bind {
            service,
            addr,
            cause,
        })?;
        Ok(ServiceListener {
            bound: Some(bound),
            configured: addr,
            limits: ConnectionLimits::SERVICE_DEFAULT,
        })
    }

    /// Nothing bound: the embedding server serves the service's router. `configured` is the
    /// address the embedding server serves on, kept for [`ServiceListener::local_addr`].
    pub fn embedded(configured: SocketAddr) -> Self {
        ServiceListener {
            bound: None,
            configured,
            limits: ConnectionLimits::SERVICE_DEFAULT,
        }
    }

    /// The same listener, holding at most `limits` connections open (instead of
    /// [`ConnectionLimits::SERVICE_DEFAULT`]). Embedded, the embedding server's limits apply.
    pub fn with_limits(self, limits: ConnectionLimits) -> Self {
        ServiceListener { limits, ..self }
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
            Some(listener) => serve_http(listener, router, self.limits, shutdown).await,
            None => {
                shutdown.await;
                Ok(())
            }
        }
    }
}

/// Connections the kernel completes and holds for a listener until it accepts them, as asked
/// for. A burst of connections past the backlog (every device of a restarted gateway
/// reconnecting at once) is not refused but dropped: each dropped client sends its SYN again
/// only after 1 s, then 3 s, 7 s. `TcpListener::bind` asks for 128, which 200 devices
/// connecting at once already overflowed (`TcpExtListenOverflows`). The kernel caps what is
/// asked at `net.core.somaxconn` (4,096 by default since Linux 5.4; per network namespace, so
/// per Kubernetes pod), so that setting alone decides it.
pub const LISTEN_BACKLOG: u32 = 65_535;

/// Binds a TCP listener on `addr` the way every listener of aip is bound: `SO_REUSEADDR`
/// (a restart does not wait for the last run's connections in `TIME_WAIT`) and a backlog of
/// [`LISTEN_BACKLOG`]. Must be called within a Tokio runtime.
pub fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// How long a client has to send a request's headers, the WebSocket handshake's included,
/// from the moment it connects: a client that sends them slowly (slowloris) or not at all is
/// disconnected then instead of holding a socket forever.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Limits on the connections a listener keeps open, checked when a socket is accepted, before
/// any of its bytes is read: a client cannot hold more sockets than this by connecting and
/// never authenticating (authentication happens later, in the request). A socket over a limit
/// is closed at once. A connection counts until its socket closes, also after an upgrade to a
/// WebSocket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once (0: no limit).
    pub total: usize,
    /// Most connections open at once from one source (0: no limit): one IPv4 address, or one
    /// IPv6 /64 network (a single host usually has a whole /64 to pick addresses from).
    /// Behind a proxy or load balancer that does not keep the client's address, every
    /// connection comes from the proxy's address, so this must be high enough for all of them.
    pub per_address: usize,
}

impl ConnectionLimits {
    /// No limit at all.
    pub const UNLIMITED: ConnectionLimits = ConnectionLimits {
        total: 0,
        per_address: 0,
    };

    /// The REST listeners of the registry and the session service: far more connections than
    /// their clients (operators, tools, event streams of `aip dispatch`) hold, from one
    /// address or all together, even behind one proxy, and few enough that a flood of idle
    /// sockets cannot take every file descriptor of the process.
    pub const SERVICE_DEFAULT: ConnectionLimits = ConnectionLimits {
        total: 16_384,
        per_address: 4_096,
    };
}

/// Why an accepted socket was closed at once; the `reason` label of
/// `aip_listener_connections_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its source already holds [`ConnectionLimits::per_address`] connections.
    PerAddress,
    /// The listener already holds [`ConnectionLimits::total`] connections.
    Total,
}

impl Refusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::PerAddress => "per_address",
            Refusal::Total => "total",
        }
    }
}

/// The connections open now, in total and per source; shared by the accept loop (which takes
/// a [`ConnectionSlot`]) and the connections (whose slots give them back when dropped).
#[derive(Debug)]
struct ConnectionCount {
    limits: ConnectionLimits,
    open: Mutex<OpenConnections>,
}

#[derive(Debug, Default)]
struct OpenConnections {
    total: usize,
    per_source: HashMap<IpAddr, usize>,
}

impl ConnectionCount {
    fn new(limits: ConnectionLimits) -> Arc<Self> {
        Arc::new(ConnectionCount {
            limits,
            open: Mutex::new(OpenConnections::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OpenConnections> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a connection from `peer`, or why there is none.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<ConnectionSlot, Refusal> {
        let source = source_of(peer);
        let mut open = self.lock();
        if self.limits.total != 0 && open.total >= self.limits.total {
            return Err(Refusal::Total);
        }
        let from_source = open.per_source.get(&source).copied().unwrap_or(0);
        if self.limits.per_address != 0 && from_source >= self.limits.per_address {
            return Err(Refusal::PerAddress);
        }
        open.total += 1;
        open.per_source.insert(source, from_source + 1);
        Ok(ConnectionSlot {
            count: self.clone(),
            source,
        })
    }

    fn release(&self, source: IpAddr) {
        let mut open = self.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_source.get_mut(&source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.per_source.remove(&source);
            }
        }
    }
}

/// What the per-address limit counts `peer` as: an IPv4 address (also when it arrives as an
/// IPv4-mapped IPv6 address on a dual-stack listener), or an IPv6 address's /64 network.
fn source_of(peer: IpAddr) -> IpAddr {
    match peer.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let network = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(network.into())
        }
    }
}

/// One open connection's place in the count, given back when dropped.
#[derive(Debug)]
struct ConnectionSlot {
    count: Arc<ConnectionCount>,
    source: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.count.release(self.source);
    }
}

/// An accepted socket holding its [`ConnectionSlot`]: the slot goes wherever the socket goes
/// (into a WebSocket after an upgrade, when hyper's connection task has long ended) and is
/// given back when the socket is closed.
#[derive(Debug)]
struct CountedStream {
    stream: TcpStream,
    _slot: ConnectionSlot,
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// At most one warning per this interval sums up the sockets refused since the last one: a
/// flood of connections must not become a flood of log lines.
const REFUSAL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Counts refused sockets and sums them up in a warning at most every
/// [`REFUSAL_WARNING_INTERVAL`] (each one is logged at debug level).
#[derive(Debug, Default)]
struct RefusalLog {
    last_warning: Option<Instant>,
    per_address: u64,
    total: u64,
}

impl RefusalLog {
    fn refused(&mut self, refusal: Refusal, peer: SocketAddr, limits: ConnectionLimits) {
        metrics::counter!("aip_listener_connections_refused_total", "reason" => refusal.as_str())
            .increment(1);
        tracing::debug!(%peer, reason = refusal.as_str(), "connection refused: over the limit");
        match refusal {
            Refusal::PerAddress => self.per_address += 1,
            Refusal::Total => self.total += 1,
        }
        let now = Instant::now();
        if self
            .last_warning
            .is_some_and(|last| now.duration_since(last) < REFUSAL_WARNING_INTERVAL)
        {
            return;
        }
        tracing::warn!(
            over_per_address = self.per_address,
            over_total = self.total,
            per_address_limit = limits.per_address,
            total_limit = limits.total,
            last_peer = %peer,
            "connections refused at accept since the last warning (limits reached)"
        );
        self.last_warning = Some(now);
        self.per_address = 0;
        self.total = 0;
    }
}

/// Serves `router` on `listener` (HTTP/1.1 with upgrades, at most [`HEADER_READ_TIMEOUT`] for
/// a request's headers) until `shutdown` completes, then lets the requests in progress
/// finish. (`axum::serve` sets no header timeout.) A socket over `limits` is closed as soon as
/// it is accepted, before anything is read from it. Accepted sockets send small writes at once
/// (Nagle's algorithm off): AIP is request/response over small frames, and with Nagle on an
/// answer waits for the peer's delayed ACK (about 40 ms on Linux).
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnectionLimits,
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
    let count = ConnectionCount::new(limits);
    let mut refusals = RefusalLog::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
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
        let slot = match count.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(refusal) => {
                // Closed unread: the client sees the connection end (or reset) with no answer.
                drop(stream);
                refusals.refused(refusal, peer, limits);
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!("cannot turn Nagle's algorithm off on an accepted socket: {e}");
        }
        let stream = CountedStream {
            stream,
            _slot: slot,
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn counts_per_source_and_in_total_and_gives_slots_back() {
        let count = ConnectionCount::new(ConnectionLimits {
            total: 3,
            per_address: 2,
        });
        let a1 = count.admit(ip("10.0.0.1")).expect("first from a");
        let _a2 = count.admit(ip("10.0.0.1")).expect("second from a");
        assert_eq!(count.admit(ip("10.0.0.1")).err(), Some(Refusal::PerAddress));
        let _b1 = count.admit(ip("10.0.0.2")).expect("first from b");
        assert_eq!(count.admit(ip("10.0.0.3")).err(), Some(Refusal::Total));
        drop(a1);
        let _a3 = count.admit(ip("10.0.0.1")).expect("a's slot is back");
        assert_eq!(count.lock().total, 3);
    }

    #[test]
    fn zero_is_no_limit() {
        let count = ConnectionCount::new(ConnectionLimits::UNLIMITED);
        let slots: Vec<_> = (0..1000)
            .map(|_| count.admit(ip("10.0.0.1")).expect("no limit"))
            .collect();
        assert_eq!(count.lock().total, slots.len());
        drop(slots);
        assert_eq!(count.lock().total, 0);
        assert!(count.lock().per_source.is_empty());
    }

    #[test]
    fn ipv6_counts_per_network_and_mapped_ipv4_as_ipv4() {
        assert_eq!(
            source_of(ip("2001:db8::1")),
            source_of(ip("2001:db8::ffff:2"))
        );
        assert_ne!(
            source_of(ip("2001:db8::1")),
            source_of(ip("2001:db8:0:1::1"))
        );
        assert_eq!(source_of(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }
}
