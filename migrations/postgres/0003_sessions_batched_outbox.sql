-- The session service now writes changes in batches (group commit). Outgoing frames are keyed
-- by the message id the gateways de-duplicate on, chosen before the batch commits.
CREATE TABLE task_outbox (
    msg_id      text PRIMARY KEY,
    subject     text NOT NULL,
    payload     bytea NOT NULL,
    created_ms  bigint NOT NULL
);

-- Frames a crash left unsent under the old layout keep their old message ids.
INSERT INTO task_outbox (msg_id, subject, payload, created_ms)
    SELECT 'outbox-' || id, subject, payload, created_ms FROM outbox;
DROP TABLE outbox;

CREATE INDEX processed_messages_at_idx ON processed_messages (at_ms);

-- The leader keeps live tasks, queues and deadlines in memory, so the indexes that served
-- per-change queries only slow every write down. Taking over needs the live tasks once.
DROP INDEX tasks_executor_live_idx;
DROP INDEX tasks_requester_live_idx;
DROP INDEX tasks_deadline_idx;
DROP INDEX tasks_needs_plan_idx;
CREATE INDEX tasks_live_idx ON tasks (created_ms)
    WHERE state IN ('submitted', 'dispatched', 'working', 'input_required');
