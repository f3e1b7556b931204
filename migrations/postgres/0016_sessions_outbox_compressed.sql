-- The outbox row of a group commit holds the group's small frames as one JSON array (tens of
-- KiB at 100 clients). UFO frames repeat their field names and mostly null fields, so the
-- array compresses to under a third. Stored uncompressed (0012), the row went out of line
-- whole: a fifth of the WAL a task wrote (7.3 KB per task at 100 clients, 5.8 KB compressed;
-- docs/benchmarks.md, session 49).
--
-- lz4 only: it compresses quickly and fails quickly on what does not compress (a frame of
-- its own carrying a base64 file), where pglz cost seconds per 90 MiB (0012). A server
-- built without lz4 keeps the payload uncompressed, as before.
DO $$
BEGIN
    ALTER TABLE task_outbox
        ALTER COLUMN payload SET COMPRESSION lz4,
        ALTER COLUMN payload SET STORAGE EXTENDED;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no lz4: task_outbox.payload stays uncompressed';
END $$;
