-- Processed-frame ids are kept in two tables, each holding ten minutes of ids at a time
-- (`services/sessions/src/store.rs`, `ProcessedHalf`): the leader writes to the half of the
-- current ten-minute period and empties the other's old ids when a new period begins.
DROP INDEX processed_messages_at_idx;

CREATE TABLE processed_messages_b (
    msg_id  text PRIMARY KEY,
    at_ms   bigint NOT NULL
);
