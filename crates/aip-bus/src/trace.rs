//! W3C trace context on bus messages, and the messaging spans of OpenTelemetry's conventions.
//!
//! Tracing is off until a process installs an OpenTelemetry pipeline and calls [`enable`]
//! (`aip_runtime::telemetry` does). While it is off nothing here allocates: no span is made,
//! no header is written, no header is read. While it is on, every message published from
//! inside a traced span carries that span's `traceparent` (and `tracestate`), added by the
//! bus itself ([`with_current`]), and the receiving side starts its span as a child of it
//! ([`extract`]).

use std::sync::atomic::{AtomicBool, Ordering};

pub use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::Headers;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns trace propagation on for this process (once its exporter is installed).
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Whether this process exports traces.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The W3C header names.
pub const TRACEPARENT: &str = "traceparent";

struct HeaderInjector<'a>(&'a mut Headers);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value);
    }
}

struct HeaderExtractor<'a>(&'a Headers);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name).collect()
    }
}

/// A single-value carrier: a stored `traceparent`.
struct Single<'a>(&'a str);

impl Extractor for Single<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

fn is_valid(cx: &Context) -> bool {
    cx.span().span_context().is_valid()
}

/// `headers` with the trace context of the current span added, unless they carry one
/// already or tracing is off.
pub fn with_current(headers: Headers) -> Headers {
    if !enabled() || headers.get(TRACEPARENT).is_some() {
        return headers;
    }
    with_context(headers, &Span::current().context())
}

/// `headers` with the trace context `cx` added (nothing if `cx` is not part of a trace).
pub fn with_context(mut headers: Headers, cx: &Context) -> Headers {
    if is_valid(cx) {
        opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.inject_context(cx, &mut HeaderInjector(&mut headers))
        });
    }
    headers
}

/// The trace context a message carries, if tracing is on and it carries one.
pub fn extract(headers: &Headers) -> Option<Context> {
    headers.get(TRACEPARENT)?;
    extract_from(&HeaderExtractor(headers))
}

/// The trace context of a stored or received `traceparent` value (a frame's
/// `metadata.traceparent`), if tracing is on and the value is valid.
pub fn from_traceparent(traceparent: &str) -> Option<Context> {
    extract_from(&Single(traceparent))
}

fn extract_from(carrier: &dyn Extractor) -> Option<Context> {
    if !enabled() {
        return None;
    }
    let cx =
        opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(carrier));
    is_valid(&cx).then_some(cx)
}

/// The context of `span`, if tracing is on and the span is part of a trace.
pub fn context_of(span: &Span) -> Option<Context> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    is_valid(&cx).then_some(cx)
}

/// The `traceparent` value that continues `span`, if tracing is on and the span is part of
/// a trace (for a message that carries several frames, each with its own trace).
pub fn traceparent_of(span: &Span) -> Option<String> {
    let cx = context_of(span)?;
    with_context(Headers::new(), &cx)
        .get(TRACEPARENT)
        .map(str::to_owned)
}

/// What a messaging span does, after OpenTelemetry's messaging conventions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// A message sent to a subject or stream (`publish`, span kind producer).
    Publish,
    /// A request that waits for its reply (`send`, span kind client).
    Request,
    /// A message handled by its consumer (`process`, span kind consumer).
    Process,
    /// A request answered by its responder (`process`, span kind server).
    Serve,
}

impl Operation {
    fn name(self) -> &'static str {
        match self {
            Operation::Publish => "publish",
            Operation::Request => "send",
            Operation::Process | Operation::Serve => "process",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Operation::Publish => "producer",
            Operation::Request => "client",
            Operation::Process => "consumer",
            Operation::Serve => "server",
        }
    }
}

/// A messaging span named `{operation} {template}` (the subject with its ids as
/// placeholders, e.g. `aip.frames.{client}`), child of `parent` when given, else of the
/// current span. `Span::none()` while tracing is off.
pub fn messaging_span(
    operation: Operation,
    template: &str,
    subject: &str,
    parent: Option<Context>,
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        "message",
        otel.name = %format_args!("{} {template}", operation.name()),
        otel.kind = operation.kind(),
        messaging.system = "nats",
        messaging.operation.type = operation.name(),
        messaging.destination.name = subject,
        messaging.destination.template = template,
        aip.frame.type = tracing::field::Empty,
        aip.session_id = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    adopted(span, parent)
}

/// `span`, made a child of `parent` when given, with its ids recorded.
fn adopted(span: Span, parent: Option<Context>) -> Span {
    if let Some(parent) = parent {
        let _ = span.set_parent(parent);
    }
    record_ids(&span);
    span
}

/// Names the task (its session id) a span works for, so a trace is found by it
/// (`aip.session_id` in Jaeger's tag search).
pub fn record_session(span: &Span, session_id: &str) {
    if !span.is_none() {
        span.record("aip.session_id", session_id);
    }
}

/// Writes the span's trace and span ids into its `trace_id` and `span_id` fields, where log
/// lines find them (a log formatter cannot ask OpenTelemetry while it formats).
fn record_ids(span: &Span) {
    let cx = span.context();
    let otel = cx.span();
    let context = otel.span_context();
    if context.is_valid() {
        span.record("trace_id", tracing::field::display(context.trace_id()));
        span.record("span_id", tracing::field::display(context.span_id()));
    }
}

/// The span that continues `parent` across the bus (a [`messaging_span`] child of it), or
/// `Span::none()` when there is no trace to continue.
pub fn continuing(
    operation: Operation,
    template: &str,
    subject: &str,
    parent: Option<Context>,
) -> Span {
    match parent {
        Some(parent) => messaging_span(operation, template, subject, Some(parent)),
        None => Span::none(),
    }
}

/// A span for one piece of work (`name`, span kind internal unless `kind` says otherwise),
/// child of `parent` when given, else of the current span. `Span::none()` while tracing is
/// off.
pub fn work_span(name: &str, kind: &'static str, parent: Option<Context>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        "work",
        otel.name = name,
        otel.kind = kind,
        aip.session_id = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    adopted(span, parent)
}

/// A root span for work done for many traces at once (`name`, span kind internal), linked
/// to each of `links`. `Span::none()` while tracing is off or without links.
pub fn linked_span(name: &str, links: &[Context]) -> Span {
    if !enabled() || links.is_empty() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "work",
        otel.name = name,
        otel.kind = "internal",
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    for cx in links {
        span.add_link(cx.span().span_context().clone());
    }
    record_ids(&span);
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_added_or_read_while_tracing_is_off() {
        let headers = Headers::new().with(
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        assert!(extract(&headers).is_none());
        assert!(with_current(Headers::new()).is_empty());
        assert!(messaging_span(Operation::Publish, "a.{b}", "a.b", None).is_none());
    }
}
