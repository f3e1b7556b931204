-- Large command results kept apart from their task's row (`services/sessions/src/apart.rs`).
--
-- A history entry whose results are over 1 MiB as JSON is written here first, as raw bytes
-- in parts of 8 MiB (each part committed on its own, several at once), and the task's row
-- then holds a marker `{"$apart": {"term": …, "parts": …, "bytes": …}}` in place of the
-- entry's results. Rows are keyed by the leader's term, so a leader whose lease ran out
-- cannot overwrite what its successor wrote. Stored uncompressed (base64 screenshots do not
-- compress, and the attempt is costly).
CREATE TABLE task_results (
    task_id TEXT NOT NULL,
    entry INTEGER NOT NULL,
    term BIGINT NOT NULL,
    part INTEGER NOT NULL,
    body BYTEA NOT NULL,
    PRIMARY KEY (task_id, entry, term, part)
);

ALTER TABLE task_results ALTER COLUMN body SET STORAGE EXTERNAL;
