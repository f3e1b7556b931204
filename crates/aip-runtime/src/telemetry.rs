//! Logs and traces, initialised in one function.
//!
//! Logs go to stderr, readable lines in development and one JSON object per line in
//! production. Traces go to an OTLP endpoint (Jaeger, an OpenTelemetry Collector) when one is
//! configured the standard way, `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), gRPC, `http://host:4317`; `OTEL_SERVICE_NAME`
//! names the service (else the binary's name). While traces are exported, every log line
//! written inside a traced operation carries its `trace_id` and `span_id`.

use std::fmt;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are written (`AIP_LOG_FORMAT=pretty|json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines (development).
    #[default]
    Pretty,
    /// One JSON object per line (production).
    Json,
}

/// Whether traces are exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traces {
    /// Never (the default of `aip dev`).
    Off,
    /// When an OTLP endpoint variable is set (the services).
    FromEnvironment,
    /// Always: to the configured endpoint, else `http://localhost:4317` (`aip dev --traces`).
    On,
}

/// The environment variables that name an OTLP endpoint for traces.
const ENDPOINT_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

impl Traces {
    fn wanted(self) -> bool {
        match self {
            Traces::Off => false,
            Traces::On => true,
            Traces::FromEnvironment => {
                let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
                let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v == "true")
                    || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v == "none");
                !disabled && ENDPOINT_VARIABLES.iter().any(|name| set(name))
            }
        }
    }
}

/// What [`init`] set up; [`Telemetry::shutdown`] sends the spans still buffered.
#[derive(Debug, Default)]
#[must_use = "dropping it loses the spans not yet exported; call shutdown"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether traces are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is buffered and stops the exporter (a few seconds at most).
    pub async fn shutdown(mut self) {
        if let Some(provider) = self.provider.take() {
            let result = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            if let Ok(Err(e)) = result {
                eprintln!("traces: the exporter did not shut down cleanly: {e}");
            }
        }
    }
}

/// Installs the global subscriber without traces (tests, tools). The filter comes from
/// `RUST_LOG` when set, else `default_filter` (e.g. `info`). Calling it twice is harmless.
pub fn init(format: LogFormat, default_filter: &str) {
    let _ = init_with(format, default_filter, Traces::Off, "aip");
}

/// Installs the global subscriber: logs as `format`, and traces as `traces` says, under
/// `service` unless `OTEL_SERVICE_NAME` names it. Must run inside the tokio runtime (the
/// exporter's connection lives there). A second call changes nothing.
pub fn init_with(
    format: LogFormat,
    default_filter: &str,
    traces: Traces,
    service: &str,
) -> Telemetry {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let provider = if traces.wanted() {
        match provider(service) {
            Ok(provider) => Some(provider),
            Err(e) => {
                eprintln!("traces are not exported: {e}");
                None
            }
        }
    } else {
        None
    };
    // Spans are exported whatever the log filter says (`RUST_LOG=warn` keeps traces whole).
    let otel = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(service.to_owned()))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    let logs = log_layer(format, std::io::stderr);
    let installed = tracing_subscriber::registry()
        .with(otel)
        .with(logs.with_filter(filter))
        .try_init()
        .is_ok();
    if !installed {
        // Another subscriber runs already (a second call, a test harness): it keeps going.
        return Telemetry::default();
    }
    if provider.is_some() {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        aip_bus::trace::enable();
    }
    Telemetry { provider }
}

fn provider(service: &str) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// The log lines, written as `format` says to `writer`.
fn log_layer<S, W>(
    format: LogFormat,
    writer: W,
) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let logs = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        LogFormat::Pretty => logs
            .event_format(WithTraceIds {
                inner: tracing_subscriber::fmt::format().compact(),
                json: false,
            })
            .boxed(),
        LogFormat::Json => logs
            .with_ansi(false)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(WithTraceIds {
                inner: tracing_subscriber::fmt::format().json(),
                json: true,
            })
            .boxed(),
    }
}

/// A log line format that adds the trace and span ids of the current span, when it is part
/// of an exported trace: top-level `trace_id` and `span_id` fields in JSON, `trace_id=…` at
/// the end of a readable line.
struct WithTraceIds<F> {
    inner: F,
    json: bool,
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = ids_in_scope(ctx) else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let ids = if self.json {
            format!("\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",")
        } else {
            format!(" trace_id={trace_id} span_id={span_id}")
        };
        if self.json && line.starts_with('{') {
            writer.write_str("{")?;
            writer.write_str(&ids)?;
            writer.write_str(&line[1..])
        } else {
            let body = line.trim_end_matches('\n');
            writer.write_str(body)?;
            writer.write_str(&ids)?;
            writer.write_str("\n")
        }
    }
}

/// The trace id and span id of the nearest span of the event's scope that recorded them
/// (`aip_bus::trace` records them on every span it makes). Read from the spans' formatted
/// fields: OpenTelemetry cannot be asked from inside a subscriber.
fn ids_in_scope<S, N>(ctx: &FmtContext<'_, S, N>) -> Option<(String, String)>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    if !aip_bus::trace::enabled() {
        return None;
    }
    ctx.event_scope()?.find_map(|span| {
        let extensions = span.extensions();
        let fields = extensions.get::<tracing_subscriber::fmt::FormattedFields<N>>()?;
        let text = without_ansi(&fields.fields);
        Some((
            hex_after(&text, "trace_id", 32)?,
            hex_after(&text, "span_id", 16)?,
        ))
    })
}

/// `text` without ANSI escape sequences.
fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The `len` hex digits that follow `key` and its separator (`="`, `":"`, `=`).
fn hex_after(text: &str, key: &str, len: usize) -> Option<String> {
    let at = text.find(key)? + key.len();
    let value = text[at..].trim_start_matches(['"', ':', '=']);
    let hex: String = value.chars().take_while(char::is_ascii_hexdigit).collect();
    (hex.len() == len).then_some(hex)
}

/// Middleware of the REST routes: while traces are exported, each request runs in a span
/// named `{method} {route}` (span kind server), child of the caller's `traceparent` header when
/// it sends one.
pub async fn traced_request(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if !aip_bus::trace::enabled() {
        return next.run(request).await;
    }
    let parent = request
        .headers()
        .get(aip_bus::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(aip_bus::trace::from_traceparent);
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(
            || request.uri().path().to_owned(),
            |p| p.as_str().to_owned(),
        );
    let name = format!("{} {route}", request.method());
    let span = aip_bus::trace::work_span(&name, "server", parent);
    tracing::Instrument::instrument(next.run(request), span).await
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// Log lines kept in memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Lines {
        type Writer = Lines;
        fn make_writer(&'w self) -> Lines {
            self.clone()
        }
    }

    #[test]
    fn json_lines_of_a_traced_operation_carry_its_trace_id() {
        let provider = SdkTracerProvider::builder().build();
        let lines = Lines::default();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
            .with(log_layer(LogFormat::Json, lines.clone()));
        aip_bus::trace::enable();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside any trace");
            let parent = aip_bus::trace::from_traceparent(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            );
            assert!(parent.is_none(), "no propagator is installed in this test");
            let span = aip_bus::trace::work_span("work", "internal", None);
            let trace_id = span.context().span().span_context().trace_id().to_string();
            span.in_scope(|| tracing::info!("inside"));
            let text = String::from_utf8(lines.0.lock().expect("lock").clone()).expect("utf-8");
            let lines: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).expect("a JSON line"))
                .collect();
            assert_eq!(lines.len(), 2, "{text}");
            assert!(lines[0].get("trace_id").is_none(), "{text}");
            assert_eq!(lines[1]["trace_id"], trace_id.as_str(), "{text}");
            assert_eq!(lines[1]["fields"]["message"], "inside", "{text}");
            assert!(
                lines[1]["span_id"].as_str().is_some_and(|s| s.len() == 16),
                "{text}"
            );
        });
    }
}
