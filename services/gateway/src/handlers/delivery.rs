//! What arrives for the client on the gateway's delivery subject ([`crate::deliveries`]):
//! server frames for it, already serialised by the session service, written to the socket as
//! they are; and the control message telling a replaced connection to close.

use aip_bus::trace::Operation;
use aip_bus::{Message as BusMessage, names};
use proto_schemas::{ErrorCode, server};

use crate::blob_reads::BodyError;
use crate::client::{Client, End};
use crate::connection::close;

pub(crate) async fn handle(client: &mut Client, message: BusMessage) -> Result<(), End> {
    if message.headers.get(names::CONTROL) == Some("disconnect") {
        if message.headers.get(names::CONNECTION) == Some(client.connection_id.as_str()) {
            client.connection.close(
                close::POLICY,
                "replaced by a newer connection of the same client",
            );
            return Err(End::Replaced);
        }
        return Ok(());
    }
    // A frame for one connection of this client (an executor's command, bound to the
    // connection its task was placed on) that reaches another one, the client's next
    // connection after a crash, is not written: it would run a command twice. Acknowledged,
    // since no connection can take it any more; and that connection's end is announced, in
    // case it was not when it ended (`crate::events`).
    if let Some(connection) = message.headers.get(names::CONNECTION)
        && connection != client.connection_id
    {
        tracing::debug!(
            connection,
            "a frame for an earlier connection of this client dropped"
        );
        metrics::counter!("aip_gateway_deliveries_total", "outcome" => "other_connection")
            .increment(1);
        if let Some(identity) = &client.identity {
            client.state.closings.announce_gone(
                &client.state.gateway_id,
                &identity.client_id,
                connection,
                identity.client_type,
            );
        }
        acknowledge(client, &message).await;
        return Ok(());
    }
    if let Some(id) = message.headers.get(names::MSG_ID)
        && !client.recent_deliveries.first_time(id)
    {
        tracing::debug!(id, "duplicate delivery dropped");
        metrics::counter!("aip_gateway_deliveries_total", "outcome" => "duplicate").increment(1);
        acknowledge(client, &message).await;
        return Ok(());
    }
    let started = std::time::Instant::now();
    let state = &client.state;
    let text = match state
        .blob_reads
        .payload_of(&state.bus, &state.blobs, &message)
        .await
    {
        Ok(text) => text,
        Err(BodyError::NotUtf8) => {
            tracing::error!(subject = %message.subject, "delivery is not UTF-8 JSON; dropped");
            // Sending it again cannot make it readable.
            acknowledge(client, &message).await;
            return Ok(());
        }
        Err(BodyError::Bus(e)) => {
            tracing::error!(subject = %message.subject, "a large frame for this client could not be read back: {e}");
            return Ok(client.connection.write(&server::error(
                ErrorCode::Internal,
                format!("a frame for you was lost in transit: {e}"),
            ))?);
        }
    };
    if text.len() >= crate::client::LARGE_FRAME_BYTES {
        tracing::debug!(
            bytes = text.len(),
            read_us = started.elapsed().as_micros() as u64,
            "large delivery read back"
        );
    }
    // Without a copy: the body read back (shared with other deliveries of it) is written.
    metrics::counter!("aip_gateway_deliveries_total", "outcome" => "written").increment(1);
    {
        let traced = aip_bus::trace::extract(&message.headers)
            .map(|parent| written_span(client, &message.subject, parent, text.as_str()));
        let _entered = traced.as_ref().map(|span| span.enter());
        client.connection.write_utf8(text)?;
    }
    acknowledge(client, &message).await;
    Ok(())
}

/// The span of a traced frame written to the socket (`process aip.deliver.{gateway}`), child of
/// the sender's; a command's is remembered, so the results that answer it join its trace.
fn written_span(
    client: &mut Client,
    subject: &str,
    parent: aip_bus::trace::Context,
    text: &str,
) -> tracing::Span {
    #[derive(serde::Deserialize)]
    struct Peek<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<&'a str>,
        #[serde(borrow)]
        session_id: Option<&'a str>,
    }
    let template = client.state.subjects.template(subject);
    let span = aip_bus::trace::messaging_span(Operation::Process, &template, subject, Some(parent));
    let peek: Option<Peek> = serde_json::from_str(text).ok();
    if let Some(Peek {
        kind: Some(kind),
        session_id,
    }) = peek
    {
        span.record("aip.frame.type", kind);
        if let Some(id) = session_id {
            aip_bus::trace::record_session(&span, id);
        }
        if kind == "command"
            && let Some(session_id) = session_id
            && let Some(cx) = aip_bus::trace::context_of(&span)
        {
            client.command_traces.remember(session_id, cx);
        }
    }
    span
}

/// Tells the sender that asked (`Aip-Ack`) that the frame is written, so it stops re-sending
/// it (gathered with the gateway's other acknowledgements, [`crate::acks`]). A lost
/// acknowledgement costs a re-send, which is dropped as a duplicate above.
async fn acknowledge(client: &Client, message: &BusMessage) {
    let (Some(subject), Some(msg_id)) = (
        message.headers.get(names::ACK),
        message.headers.get(names::MSG_ID),
    ) else {
        return;
    };
    client.state.acks.ack(subject, msg_id).await;
}
