-- The connection an outbox frame is meant for (the executor's connection the task is bound
-- to), or NULL for a frame any connection of its client may receive. A gateway writes a
-- frame with a connection only to that connection, so a command re-sent after a gateway's
-- crash never reaches the client's next connection and runs twice.
ALTER TABLE task_outbox ADD COLUMN connection_id text;
