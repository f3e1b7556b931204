-- The session service now writes changes in batches (group commit). Outgoing frames are keyed
-- by the message id the gateways de-duplicate on, chosen before the batch commits.
CREATE TABLE task_outbox (
    msg_id      text PRIMARY KEY,
    subject     text NOT NULL,
    payload     bytea NOT NULL,
    created_ms  bigint NOT NULL
);
CREATE INDEX task_outbox_created_idx ON task_outbox (created_ms);

-- Frames a crash left unsent under the old layout keep their old message ids.
INSERT INTO task_outbox (msg_id, subject, payload, created_ms)
    SELECT 'outbox-' || id, subject, payload, created_ms FROM outbox;
DROP TABLE outbox;

CREATE INDEX processed_messages_at_idx ON processed_messages (at_ms);
