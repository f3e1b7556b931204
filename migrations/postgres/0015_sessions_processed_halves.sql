-- Processed-frame ids are kept in two tables, each holding ten minutes of ids at a time
-- (`services/sessions/src/store.rs`, `ProcessedHalf`): the leader writes to the half of the
-- current ten-minute period and empties the other's old ids with TRUNCATE when a new period
-- begins. Forgetting old ids was a DELETE of a minute's ids every minute (some 360,000 rows
-- at 3,000 tasks/s, in one group commit), and every id an entry in an index on its time.
DROP INDEX processed_messages_at_idx;

CREATE TABLE processed_messages_b (
    msg_id  text PRIMARY KEY,
    at_ms   bigint NOT NULL
);
