-- Frames for clients are published to the gateway holding the client (`deliver.<gateway>`),
-- found when each frame is published: an outbox row names its client. Rows written before
-- hold the old per-client subject (`<prefix>.deliver.<client token>`) in `subject`, and a NULL
-- here; the session service reads their client from that subject. New rows leave `subject`
-- empty.
ALTER TABLE task_outbox ADD COLUMN client_id text;
